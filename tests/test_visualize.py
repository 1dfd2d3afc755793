"""Attention rollout (Abnar & Zuidema 2020) against a step-by-step computation, and the attention maps."""
from __future__ import annotations

import pytest
import torch

from vitlab import create_model
from vitlab.visualize import attention_rollout, block_attention_map, cls_attention_map


def _random_maps(blocks=3, b=2, h=4, n=10, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(b, h, n, n, generator=g).softmax(-1) for _ in range(blocks)]


def _rollout_by_hand(maps, fusion, discard_ratio, prefix=1):
    """The formula, one sample, one row and one layer at a time, with Python loops."""
    b, _, n, _ = maps[0].shape
    out = torch.empty(b, n, n, dtype=torch.float64)
    for s in range(b):
        result = torch.eye(n, dtype=torch.float64)
        for layer in maps:
            w = layer[s].double()
            fused = {"mean": w.mean(0), "max": w.max(0).values, "min": w.min(0).values}[fusion]
            a = torch.empty(n, n, dtype=torch.float64)
            for i in range(n):
                row = fused[i].clone()
                candidates = list(range(prefix, n))  # never the CLS column
                k = int(discard_ratio * len(candidates))
                lowest = sorted(candidates, key=lambda j: row[j].item())[:k]
                for j in lowest:
                    row[j] = 0.0
                row[i] += 1.0  # the residual path
                a[i] = row / row.sum()
            result = a @ result  # layers multiplied from the first to the last
        out[s] = result
    return out


def test_rollout_of_identity_attention_is_the_identity():
    eye = torch.eye(7).expand(2, 3, 7, 7)
    torch.testing.assert_close(attention_rollout([eye, eye, eye]), torch.eye(7).expand(2, 7, 7))


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.5])
def test_rollout_is_the_formula_and_its_rows_sum_to_one(fusion, discard_ratio):
    maps = _random_maps()
    rollout = attention_rollout(maps, head_fusion=fusion, discard_ratio=discard_ratio)
    assert rollout.shape == (2, 10, 10)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 10))
    torch.testing.assert_close(rollout.double(), _rollout_by_hand(maps, fusion, discard_ratio), rtol=1e-5, atol=1e-6)


def test_discarding_changes_the_rollout_but_never_the_cls_column():
    maps = _random_maps()
    kept = attention_rollout(maps, discard_ratio=0.9)
    assert not torch.allclose(kept, attention_rollout(maps))
    # With the CLS column protected, every row keeps a positive weight on the CLS token.
    assert (kept[:, :, 0] > 0).all()


def test_cls_map_has_the_patch_grid_shape_and_block_maps_pick_a_block_and_head():
    torch.manual_seed(0)
    model = create_model("vit_cifar_tiny_patch4_32").eval()  # 32 px, patch 4: an 8 x 8 grid + CLS
    maps = model.get_attention_maps(torch.randn(3, 3, 32, 32))
    heat = cls_attention_map(attention_rollout(maps), model)
    assert heat.shape == (3, 8, 8)
    raw = block_attention_map(maps, model, block=1, head=2)
    torch.testing.assert_close(raw, maps[1][:, 2, 0, 1:].reshape(3, 8, 8))
    torch.testing.assert_close(block_attention_map(maps, model, block=-1, head="mean"),
                               maps[-1][:, :, 0, 1:].mean(1).reshape(3, 8, 8))
    with pytest.raises(ValueError, match="block 9 is out of range: the model has 4 blocks"):
        block_attention_map(maps, model, block=9, head=0)
    with pytest.raises(ValueError, match="head 7 is out of range"):
        block_attention_map(maps, model, block=0, head=7)


def test_rollout_rejects_bad_options():
    maps = _random_maps()
    with pytest.raises(ValueError, match="head_fusion='median'.*mean, max, min"):
        attention_rollout(maps, head_fusion="median")
    with pytest.raises(ValueError, match=r"discard_ratio=1.0.*\[0, 1\)"):
        attention_rollout(maps, discard_ratio=1.0)
