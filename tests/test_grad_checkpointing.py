"""Gradient checkpointing changes memory, never the numbers: same loss and gradients with and without it."""
from __future__ import annotations

import pytest
import torch

import vitlab
from vitlab.config import load_config
from vitlab.layers import moe_aux_loss
from vitlab.tasks.base import build_model

CASES = {
    "vit": (lambda: vitlab.create_model("vit_cifar_tiny_patch4_32", drop_path_rate=0.1, proj_drop_rate=0.1),
            lambda g: (torch.randn(4, 3, 32, 32, generator=g),)),
    "vit_moe": (lambda: vitlab.create_model("vit_cifar_tiny_patch4_32", mlp_layer="moe", depth=2),
                lambda g: (torch.randn(4, 3, 32, 32, generator=g),)),
    "transformer": (lambda: vitlab.create_model("transformer_tiny", src_vocab_size=20, tgt_vocab_size=20, dropout=0.1),
                    lambda g: (torch.randint(3, 20, (3, 9), generator=g), torch.randint(3, 20, (3, 7), generator=g))),
    "gpt": (lambda: vitlab.create_model("gpt_char_tiny", vocab_size=30, dropout=0.1),
            lambda g: (torch.randint(0, 30, (3, 40), generator=g),)),
    "rnn": (lambda: vitlab.create_model("rnn_attention_tiny", src_vocab_size=20, tgt_vocab_size=20, dropout=0.2),
            lambda g: (torch.randint(3, 20, (3, 9), generator=g), torch.randint(3, 20, (3, 7), generator=g))),
}


def _loss_and_grads(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list]:
    torch.manual_seed(123)  # the same dropout masks in both runs (checkpointing replays the RNG state)
    loss = model(*inputs).float().pow(2).mean()
    aux = moe_aux_loss(model)  # the MoE balancing loss of this forward
    loss = loss if aux is None else loss + aux
    model.zero_grad()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", list(CASES))
def test_grad_checkpointing_gives_the_same_loss_and_gradients(name: str) -> None:
    make_model, make_inputs = CASES[name]
    torch.manual_seed(0)
    model = make_model().train()
    inputs = make_inputs(torch.Generator().manual_seed(1))
    plain_loss, plain_grads = _loss_and_grads(model, inputs)
    model.set_grad_checkpointing(True)
    assert model.grad_checkpointing
    ckpt_loss, ckpt_grads = _loss_and_grads(model, inputs)
    assert len(ckpt_grads) == len(plain_grads) > 0
    assert torch.equal(ckpt_loss, plain_loss)
    assert max((a - b).abs().max().item() for a, b in zip(ckpt_grads, plain_grads)) <= 1e-6


def test_grad_checkpointing_really_recomputes() -> None:
    """With it on, each block's forward runs a second time during backward (so activations were not kept)."""
    model = vitlab.create_model("vit_cifar_tiny_patch4_32", depth=2).train()
    calls = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: calls.append(1))  # recomputation may stop early
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert len(calls) == 2
    calls.clear()
    model.set_grad_checkpointing(True)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert len(calls) == 4
    calls.clear()
    with torch.no_grad():  # nothing to recompute for: plain forward
        model(torch.randn(2, 3, 32, 32))
    assert len(calls) == 2


def test_config_turns_grad_checkpointing_on() -> None:
    cfg = load_config(None, ["model.name=vit_cifar_tiny_patch4_32", "model.grad_checkpointing=true"])
    assert cfg.model.grad_checkpointing and "grad_checkpointing" not in cfg.model.args
    assert build_model(cfg).grad_checkpointing
    assert not build_model(load_config(None, ["model.name=vit_cifar_tiny_patch4_32"])).grad_checkpointing
