"""The optimizer and the schedule from timm's factories (issue 52, 1): today's recipes keep the learning rate of
every step (against the formula vitlab used before, written out here), each of timm's schedules against its
own formula, the optimizers and parameter groups against timm's own factory, bad names in one line."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from vitlab import create_model
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.training import create_optimizer, create_scheduler

ROOT = Path(__file__).resolve().parents[1]


def _old_multiplier(step: int, warmup: int, total: int, min_ratio: float, schedule: str = "cosine") -> float:
    """vitlab's schedule before timm's (LambdaLR over this), kept here as the reference."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "inverse_sqrt":
        return max(min_ratio, math.sqrt(warmup / (step + 1)))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _lrs(model: torch.nn.Module, overrides: list[str], steps_per_epoch: int, epochs: int,
         config: str | None = None, lower: bool = False) -> tuple[list[list[float]], torch.optim.Optimizer]:
    cfg = load_config(config, overrides)
    optimizer = create_optimizer(model, cfg.optim, cfg.train.batch_size, torch.device("cpu"))
    schedule = create_scheduler(optimizer, cfg.optim, steps_per_epoch, epochs, lower_is_better=lower)
    seen = []
    for _ in range(steps_per_epoch * epochs + 1):
        seen.append([g["lr"] for g in optimizer.param_groups])
        schedule.step()
    return seen, optimizer


def _tiny() -> torch.nn.Module:
    return create_model("vit_cifar_tiny_patch4_32", num_classes=10, depth=2, embed_dim=32, num_heads=2)


@pytest.mark.parametrize("config, overrides", [
    ("configs/cifar10_cpu_quick.yaml", []),
    ("configs/cifar10_cpu_quick.yaml", ["optim.layer_decay=0.75", "optim.warmup_epochs=0"]),
    ("configs/seq2seq_reverse.yaml", ["optim.schedule=inverse_sqrt", "optim.min_lr=1e-4"])])
def test_todays_recipes_keep_the_learning_rate_of_every_step(config, overrides):
    cfg = load_config(ROOT / config, overrides)
    steps_per_epoch = 50_000 // cfg.train.batch_size if cfg.task == "classification" else 312
    model = _tiny()
    seen, optimizer = _lrs(model, overrides, steps_per_epoch, cfg.train.epochs, config=str(ROOT / config))
    o = cfg.optim
    warmup, total = max(1, round(o.warmup_epochs * steps_per_epoch)), steps_per_epoch * cfg.train.epochs
    scales = [g.get("lr_scale", 1.0) for g in optimizer.param_groups]
    assert len(set(scales)) == (4 if o.layer_decay else 1)  # embeddings, 2 blocks, head
    for step in range(total + 1):
        expected = o.lr * _old_multiplier(step, warmup, total, o.min_lr / o.lr, o.schedule)
        assert seen[step] == pytest.approx([expected * s for s in scales], rel=1e-12, abs=0), step


def test_timms_schedules_follow_their_formulas_in_optimizer_steps():
    S, E, peak, low = 10, 12, 1e-2, 1e-4  # 10 steps an epoch, 12 epochs
    base = ["optim.lr=1e-2", "optim.min_lr=1e-4", "optim.warmup_epochs=1", f"train.epochs={E}"]
    model = _tiny()
    lr = lambda extra: [g[0] for g in _lrs(model, base + extra, S, E)[0]]
    step = lr(["optim.schedule=step", "optim.decay_epochs=4", "optim.decay_rate=0.5"])
    multistep = lr(["optim.schedule=multistep", "optim.decay_milestones=[3,7.5]", "optim.decay_rate=0.1"])
    poly = lr(["optim.schedule=poly", "optim.decay_rate=2", "optim.cooldown_epochs=3"])
    cycles = lr(["optim.schedule=cosine", "optim.cycle_limit=2", "optim.cycle_decay=0.5", "optim.warmup_lr=1e-3"])
    for s in range(S, S * E):  # after the warmup
        assert step[s] == pytest.approx(peak * 0.5 ** (s // 40), rel=1e-12)
        # timm's convention (kept on purpose, timm #2745): a milestone m takes effect at t = m - 1.
        assert multistep[s] == pytest.approx(peak * 0.1 ** ((s >= 29) + (s >= 74)), rel=1e-12)
        expected = low + (peak - low) * (1 - (s - S) / 80) ** 2 if s < 90 else low  # 80 steps, then 30 at min_lr
        assert poly[s] == pytest.approx(expected, rel=1e-12)
        cycle, at = divmod(s - S, 55)  # 110 steps after warmup, 2 cycles of 55
        top = peak * 0.5 ** cycle
        assert cycles[s] == pytest.approx(low + 0.5 * (top - low) * (1 + math.cos(math.pi * at / 55)), rel=1e-12)
    assert cycles[0] == pytest.approx(1e-3 + (peak - 1e-3) / S, rel=1e-12)  # one warmup step above optim.warmup_lr
    assert cycles[S - 1] == cycles[S] == pytest.approx(peak, rel=1e-12) and poly[-1] == pytest.approx(low)


def test_inverse_sqrt_schedule_is_the_papers():
    # Vaswani et al.: lr = d^-0.5 * min(step^-0.5, step * warmup^-1.5), peak at step = warmup.
    from vitlab.training.optim import InverseSqrtLRScheduler

    d, warmup = 512, 4000
    paper = lambda step: d ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=paper(warmup))
    schedule = InverseSqrtLRScheduler(optimizer, warmup)
    for step in (1, 100, 3999, 4000, 4001, 10000, 100000):
        assert schedule._get_lr(step)[0] == pytest.approx(paper(step), rel=1e-12)


def test_plateau_lowers_the_rate_after_its_patience_on_the_validation_metric_in_its_direction():
    model = _tiny()
    cfg = load_config(None, ["optim.schedule=plateau", "optim.patience_epochs=1", "optim.decay_rate=0.5",
                             "optim.lr=1e-2", "optim.warmup_epochs=1", "data.val_size=100"])
    optimizer = create_optimizer(model, cfg.optim, 128, torch.device("cpu"))
    schedule = create_scheduler(optimizer, cfg.optim, 4, 10, lower_is_better=True)  # a loss
    seen, saved = [], None
    for loss in [1.0, 0.9, 0.95, 0.92, 0.89, 0.91, 0.93]:  # one evaluation an epoch of 4 steps
        for _ in range(4):
            schedule.step()
        schedule.evaluated(loss)
        seen.append(schedule.get_last_lr()[0])
        if len(seen) == 6:  # one evaluation without a better loss: the next one lowers the rate
            saved = (schedule.state_dict(), [dict(g) for g in optimizer.param_groups])
    # Patience 1: the second epoch in a row without a better loss halves the rate (0.92 after the best 0.9).
    assert seen == pytest.approx([1e-2, 1e-2, 1e-2, 5e-3, 5e-3, 5e-3, 2.5e-3])
    again = create_scheduler(optimizer, cfg.optim, 4, 10, lower_is_better=True)  # a resume: built, then the
    for group, kept in zip(optimizer.param_groups, saved[1]):                     # optimizer restored, then it
        group["lr"] = kept["lr"]
    again.load_state_dict(saved[0])
    assert again.get_last_lr()[0] == pytest.approx(5e-3) and again.plateau.num_bad_epochs == 1
    again.evaluated(0.93)
    assert again.get_last_lr()[0] == pytest.approx(2.5e-3)


@pytest.mark.parametrize("opt, extra", [("sgd", {"momentum": 0.8}), ("momentum", {"momentum": 0.8}),
                                        ("lamb", {"betas": (0.9, 0.98), "eps": 1e-6}), ("lion", {"betas": (0.9, 0.99)}),
                                        ("lars", {"momentum": 0.8}), ("adafactor", {}), ("adamw", {"eps": 1e-6})])
def test_each_optimizer_is_timms_with_its_hyperparameters_and_timms_weight_decay_split(opt, extra):
    from timm.optim import create_optimizer_v2, param_groups_weight_decay

    model = _tiny()
    keys = [f"optim.opt={opt}", "optim.lr=0.02", "optim.weight_decay=0.1",
            *(f"optim.{k}={list(v) if isinstance(v, tuple) else v}" for k, v in extra.items())]
    ours = create_optimizer(model, load_config(None, keys).optim, 128, torch.device("cpu"))
    theirs = create_optimizer_v2(model, opt=opt, lr=0.02, weight_decay=0.1, **extra)
    assert type(ours) is type(theirs)
    differing = {k for k in theirs.defaults if k not in ("weight_decay",) and ours.defaults[k] != theirs.defaults[k]}
    assert not differing, differing
    decayed = lambda groups: {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    reference = param_groups_weight_decay(model, 0.1, no_weight_decay_list=model.no_weight_decay())
    assert decayed(ours.param_groups) == decayed(reference) and len(decayed(reference)) > 0
    assert sum(len(g["params"]) for g in ours.param_groups) == len(list(model.parameters()))


def test_bad_optimizer_and_schedule_settings_are_one_line_before_anything_runs():
    with pytest.raises(ConfigError, match=r"optim.opt='lamba' is not one of timm's optimizers; did you mean lamb"):
        load_config(None, ["optim.opt=lamba"])
    with pytest.raises(ConfigError, match=r"optim.schedule='plateau' reads the validation split, and this run holds "
                                          r"out none: set data.val_size=N"):
        load_config(None, ["optim.schedule=plateau"])
    with pytest.raises(ConfigError, match=r"optim.schedule='linear' is not allowed"):
        load_config(None, ["optim.schedule=linear"])
    with pytest.raises(ConfigError, match=r"optim.cooldown_epochs=10.0 is invalid; expected a number in \[0, "
                                          r"train.epochs=10\)"):
        load_config(None, ["train.epochs=10", "optim.cooldown_epochs=10"])
    with pytest.raises(ConfigError, match=r"optim.cooldown_epochs=2.0 is invalid; expected 0 with "
                                          r"optim.schedule=step \(only cosine and poly end in a cooldown"):
        load_config(None, ["train.epochs=10", "optim.schedule=step", "optim.cooldown_epochs=2"])
    with pytest.raises(ConfigError, match=r"optim.cycle_limit=3 is invalid; expected 1 with optim.schedule=plateau"):
        load_config(None, ["optim.schedule=plateau", "optim.cycle_limit=3", "data.val_size=100"])
    with pytest.raises(ConfigError, match=r"optim.decay_milestones=\[60.0, 30.0\]"):
        load_config(None, ["optim.schedule=multistep", "optim.decay_milestones=[60,30]"])


def test_deit3_trains_with_lamb_as_its_paper_did():
    cfg = load_config(ROOT / "configs/deit3_small_imagenet.yaml", ["data.root=/nowhere"])
    assert cfg.optim.opt == "lamb"


def test_a_restored_optimizer_keeps_its_moments_and_takes_this_runs_hyperparameters(tmp_path):
    # torch's AdamW restored from the saved state, its groups then set by hand to the new settings, is the reference
    from vitlab.checkpoint import load_optimizer, save_optimizer

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    groups = lambda: [{"params": [weights[0]], "weight_decay": 0.05}, {"params": [weights[1]], "weight_decay": 0.0}]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]

    def step(opt: torch.optim.Optimizer, k: int) -> None:
        for w, g in zip(weights, grads[k]):
            w.grad = g.clone()
        opt.step()

    before = torch.optim.AdamW(groups(), lr=1e-2)
    step(before, 0)
    step(before, 1)
    save_optimizer(before, tmp_path)
    start = [w.detach().clone() for w in weights]
    new = dict(betas=(0.8, 0.9), eps=1e-6)
    resumed = torch.optim.AdamW([{**g, "weight_decay": 0.5 * (i == 0)} for i, g in enumerate(groups())], lr=1e-2, **new)
    load_optimizer(resumed, tmp_path)
    assert [g["weight_decay"] for g in resumed.param_groups] == [0.5, 0.0]
    assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in resumed.param_groups)
    step(resumed, 2)
    got = [w.detach().clone() for w in weights]

    with torch.no_grad():
        for w, s in zip(weights, start):
            w.copy_(s)
    reference = torch.optim.AdamW(groups(), lr=1e-2)
    reference.load_state_dict(before.state_dict())
    for group, decay in zip(reference.param_groups, (0.5, 0.0)):
        group.update(weight_decay=decay, **new)
    step(reference, 2)
    for a, b in zip(got, weights):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    # what no state can match: other parameter groups (optim.layer_decay, model.freeze changed)
    from vitlab.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"the optimizer's parameter groups there hold \[1, 1\] tensors, this "
                                              r"run's \[2\]"):
        load_optimizer(torch.optim.AdamW(weights, lr=1e-2), tmp_path)
