"""Attention rollout (Abnar & Zuidema 2020) against a step-by-step computation, and the attention maps."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import train_tiny
from vitlab import create_model, load_model
from vitlab.cli import main
from vitlab.data import read_image
from vitlab.data.text import train_bpe
from vitlab.tasks.seq2seq import alignment
from vitlab.visualize import (attention_heatmaps, attention_rollout, block_attention_map, cls_attention_map,
                              plot_alignment, plot_attention, plot_mistakes, save_figure)


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


@pytest.mark.parametrize("args", [dict(reg_tokens=4, class_token=False, global_pool="avg"),  # ..._reg4_gap_256
                                  dict(reg_tokens=2, global_pool="avg"),  # a CLS token the pool does not read
                                  dict(reg_tokens=2)])  # the CLS token's row
def test_the_map_reads_the_rows_the_classifier_pools(args):
    # An average pool reads the mean of the patch tokens (forward_head: x[:, prefix:].mean(1)), so its map is
    # the mean of the patch rows; the token pool reads the CLS token's row. Registers are read by neither.
    torch.manual_seed(0)
    model = create_model("vit_cifar_tiny_patch4_32", depth=2, **args).eval()
    maps = model.get_attention_maps(torch.randn(2, 3, 32, 32))
    rollout, prefix = attention_rollout(maps, num_prefix_tokens=model.num_prefix_tokens), model.num_prefix_tokens
    rows = rollout[:, prefix:] if model.global_pool == "avg" else rollout[:, :1]
    torch.testing.assert_close(cls_attention_map(rollout, model), rows.mean(1)[:, prefix:].reshape(2, 8, 8))
    block = maps[-1].mean(1)
    rows = block[:, prefix:] if model.global_pool == "avg" else block[:, :1]
    torch.testing.assert_close(block_attention_map(maps, model), rows.mean(1)[:, prefix:].reshape(2, 8, 8))


def test_rollout_rejects_bad_options():
    maps = _random_maps()
    with pytest.raises(ValueError, match="head_fusion='median'.*mean, max, min"):
        attention_rollout(maps, head_fusion="median")
    with pytest.raises(ValueError, match=r"discard_ratio=1.0.*\[0, 1\)"):
        attention_rollout(maps, discard_ratio=1.0)


@pytest.fixture(scope="module")
def image_run(tiny_imagefolder, tmp_path_factory):
    return train_tiny(tiny_imagefolder, tmp_path_factory.mktemp("attn") / "run", "train.epochs=1", "model.depth=2")


ROOT = Path(__file__).resolve().parents[1]


def test_plot_attention_from_python_draws_each_image_and_its_overlay(image_run, tiny_imagefolder):
    model = load_model(image_run)
    images = [read_image(p) for p in sorted((tiny_imagefolder / "test" / "class_1").glob("*.png"))[:3]]
    fig = plot_attention(model, images, discard_ratio=0.5)
    assert len(fig.axes) == 9  # 3 rows x (image, overlay, its colour scale)
    assert fig.axes[1].get_title().startswith(("predicted: class_0 ", "predicted: class_1 ", "predicted: class_2 "))
    heat, probs = attention_heatmaps(model, images, method="block", block=1, head=0)
    assert heat.shape == (3, 8, 8) and torch.allclose(probs.sum(-1), torch.ones(3))


def test_attention_command_writes_pngs_and_refuses_bad_input_in_one_line(image_run, tiny_imagefolder, tmp_path,
                                                                         capsys):
    files = [str(p) for p in sorted((tiny_imagefolder / "test" / "class_0").glob("*.png"))[:2]]
    out = tmp_path / "attention.png"
    main(["attention", "--checkpoint", str(image_run), *files, "--output", str(out), "--discard-ratio", "0.9"])
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (560, 500)  # 2 rows of 5.6 x 2.5 inches at 100 dpi
    grid = tmp_path / "grid.png"
    main(["attention", "--checkpoint", str(image_run), files[0], "--grid", "--output", str(grid)])
    with Image.open(grid) as img:
        assert img.size == (320, 360)  # 2 blocks x 2 heads, 1.6 inches each + a title
    bad_image = tmp_path / "bad.png"
    bad_image.write_text("not a picture")
    for args, code, message in [
        (["--method", "block", "--block", "5", files[0]], 2, "--block 5 is out of range: the model has 2 blocks"),
        (["--method", "block", "--head", "3", files[0]], 2, "--head 3 is out of range: each block has 2 heads"),
        (["--grid", *files], 2, "--grid draws every block x head of one image; got 2 images"),
        ([files[0], str(bad_image)], 1, f"cannot read image '{bad_image}'"),
    ]:
        target = tmp_path / "never.png"
        with pytest.raises(SystemExit) as exit_info:
            main(["attention", "--checkpoint", str(image_run), "--output", str(target), *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == code and err.count("\n") == 1 and message in err, err
        assert not target.exists()


def test_a_compact_grid_puts_each_image_above_its_map_and_the_docs_picture_is_drawn_by_this_code(
        image_run, tiny_imagefolder, tmp_path):
    # The picture in docs/attention.md and the README is `vitlab attention --columns 4` of 8 images: the
    # same command on any model draws a figure of its size, so a change of the layout shows here.
    files = [str(p) for c in range(3) for p in sorted((tiny_imagefolder / "test" / f"class_{c}").glob("*.png"))[:3]][:8]
    out = tmp_path / "grid.png"
    main(["attention", "--checkpoint", str(image_run), *files, "--columns", "4", "--output", str(out)])
    with Image.open(out) as drawn, Image.open(ROOT / "docs/attention_cifar10.png") as docs:
        assert drawn.size == docs.size == (580, 630)  # 4 x 1.45 in wide, 2 rows of (image over map) x 3 in + title
    model = load_model(image_run)
    fig = plot_attention(model, [read_image(f) for f in files[:3]], columns=2, true_labels=["class_0"] * 3)
    titles = [ax.get_title() for ax in fig.axes]
    # rows of axes: the tops of images 0 and 1, their maps, the top of image 2 (and an empty cell), its map
    assert titles[0] == titles[1] == titles[4] == "true: class_0" and len(fig.axes) == 8
    assert all(titles[i].startswith("class_") for i in (2, 3, 6)) and titles[5] == titles[7] == ""


def test_the_attention_picture_names_the_true_class_from_the_folder_and_has_a_colour_scale(
        image_run, tiny_imagefolder, tmp_path, monkeypatch):
    from vitlab.visualize import plots

    drawn = {}
    original = plots.plot_attention

    def spy(*args, **kwargs):
        drawn["figure"] = original(*args, **kwargs)
        return drawn["figure"]

    monkeypatch.setattr(plots, "plot_attention", spy)
    monkeypatch.setattr("vitlab.visualize.plot_attention", spy)
    elsewhere = tmp_path / "elsewhere.png"
    first = sorted((tiny_imagefolder / "test" / "class_2").glob("*.png"))[0]
    elsewhere.write_bytes(first.read_bytes())
    main(["attention", "--checkpoint", str(image_run), str(first), str(elsewhere), "--output", str(tmp_path / "a.png")])
    axes = drawn["figure"].axes
    assert axes[0].get_title() == f"{first.name}\ntrue: class_2"  # its folder is one of the model's classes
    assert axes[2].get_title() == "elsewhere.png"  # no class folder: no true label
    colour_scales = [ax for ax in axes if ax.get_label() == "<colorbar>"]
    assert len(colour_scales) == 2 and colour_scales[0].get_ylim() == (0.0, 1.0)


def test_transformer_cross_attention_weights_are_torch_multihead_attentions():
    torch.manual_seed(0)
    model = create_model("transformer_tiny", src_vocab_size=30, tgt_vocab_size=30).eval()
    src = torch.randint(3, 30, (2, 7))
    src[1, 5:] = 0  # padding
    tgt = torch.randint(3, 30, (2, 4))
    inputs = {}
    last = model.transformer.decoder_layers[-1]
    last.cross_attn.register_forward_hook(lambda m, args, kwargs, out: inputs.update(q=args[0], kv=args[1]),
                                          with_kwargs=True)
    weights = model.attention_weights(src, tgt)  # (B, T, S), the last layer, mean over heads
    reference = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    with torch.no_grad():
        reference.in_proj_weight.copy_(last.cross_attn.qkv.weight)
        reference.in_proj_bias.copy_(last.cross_attn.qkv.bias)
    _, expected = reference(inputs["q"], inputs["kv"], inputs["kv"], key_padding_mask=src == 0,
                            need_weights=True, average_attn_weights=True)
    torch.testing.assert_close(weights, expected)
    assert (weights[1, :, 5:] == 0).all()
    first = model.attention_weights(src, tgt, layer=0)
    assert first.shape == (2, 4, 7) and not torch.allclose(first, weights)
    with pytest.raises(ValueError, match="layer 2 is out of range: the decoder has 2 layers"):
        model.attention_weights(src, tgt, layer=2)


@pytest.mark.parametrize("name", ["transformer_tiny", "rnn_attention_tiny"])
def test_alignment_of_a_translation_labels_every_source_and_generated_subword(name, tmp_path):
    texts = ["ein mann fährt fahrrad", "a man rides a bike", "eine frau liest", "a woman reads"] * 5
    tokenizer = train_bpe(texts, 64, tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    model = create_model(name, src_vocab_size=tokenizer.get_vocab_size(), tgt_vocab_size=tokenizer.get_vocab_size(),
                         pad_id=0, bos_id=1, eos_id=2).eval()
    weights, source, target = alignment(model, tokenizer, "ein mann liest", beam_size=2)
    assert source == tokenizer.encode("ein mann liest").tokens
    assert weights.shape == (len(target), len(source)) and len(target) >= 1
    torch.testing.assert_close(weights.sum(-1), torch.ones(len(target)))  # each generated subword's attention
    path = save_figure(plot_alignment(weights, source, target, "test"), tmp_path / "align.png")
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] > 100
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not the temporary file's private 0600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_gpt_attention_maps_are_causal_and_torchs_multihead_attention():
    torch.manual_seed(0)
    model = create_model("gpt_char_tiny", vocab_size=20).eval()
    idx = torch.randint(0, 20, (2, 9))
    inputs = {}
    block = model.blocks[1]
    block.attn.register_forward_hook(lambda m, args, kwargs, out: inputs.update(h=args[0]), with_kwargs=True)
    maps = model.get_attention_maps(idx)
    assert len(maps) == 4 and maps[1].shape == (2, 4, 9, 9)
    reference = torch.nn.MultiheadAttention(128, 4, batch_first=True).eval()
    with torch.no_grad():
        reference.in_proj_weight.copy_(block.attn.qkv.weight)
        reference.in_proj_bias.copy_(block.attn.qkv.bias)
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1)  # torch: True = blocked
    _, expected = reference(inputs["h"], inputs["h"], inputs["h"], attn_mask=causal, need_weights=True,
                            average_attn_weights=False)
    torch.testing.assert_close(maps[1], expected)
    assert (maps[1].masked_select(causal) == 0).all()


def test_mistakes_figure_shows_the_most_confident_mistakes_first():
    images = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    probs = torch.tensor([[0.9, 0.05, 0.05],   # right
                          [0.7, 0.2, 0.1],     # wrong, 0.7
                          [0.1, 0.85, 0.05],   # wrong, 0.85
                          [0.4, 0.6, 0.0],     # wrong, 0.6
                          [0.1, 0.8, 0.1],     # right
                          [0.3, 0.3, 0.4]])    # right
    fig = plot_mistakes(images, labels, probs, ["cat", "dog", "frog"], count=2, columns=2)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["true frog\npred dog 0.85", "true dog\npred cat 0.70"]
    assert fig._suptitle.get_text() == "the 2 most confident of 3 mistakes"
