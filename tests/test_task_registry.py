"""Each task is one entry of vitlab.tasks.registry, which the config, the training loop and vitlab eval consult: a task
added there alone is read from a config, checked, trained, resumed and evaluated."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.models import list_models, preset_class
from vitlab.tasks import registry
from vitlab.tasks.base import EvalRequest, Resumed


def test_every_task_has_one_entry_whose_default_model_it_trains() -> None:
    assert set(registry.TASKS) == {"classification", "seq2seq", "lm", "mae", "dino"}
    for name, task in registry.TASKS.items():
        assert preset_class(task.default_model).__name__ in task.models, name
        cfg = load_config(None, [f"task={name}", "train.output_dir=unused", *(["data.root=corpus.txt"] if name == "lm"
                                                                              else [])])
        assert type(cfg.data) is task.data and cfg.model.name == task.default_model
        assert set(task.eval_options) <= set(registry.EVAL_OPTIONS)
    presets = {preset_class(n).__name__ for n in list_models()}
    assert {m for t in registry.TASKS.values() for m in t.models} <= presets


def test_an_unknown_task_is_one_line_naming_the_tasks() -> None:
    with pytest.raises(ConfigError, match=r"^task='clasification' is not allowed; expected one of 'classification', "
                                          r"'seq2seq', 'lm', 'mae', 'dino'$"):
        load_config(None, ["task=clasification"])


def test_a_task_added_to_the_registry_alone_is_checked_trained_resumed_and_evaluated(
        tiny_imagefolder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vitlab.cli import main
    from vitlab.training import train

    calls: dict[str, list] = {"check": [], "build": [], "evaluate": []}
    base = registry.TASKS["classification"]

    def check(cfg):
        calls["check"].append(cfg.task)
        if cfg.train.epochs > 5:
            raise ConfigError("train.epochs: the toy task trains 5 epochs at most")

    def build(cfg, accelerator, micro_batch, run_dir, resumed):
        calls["build"].append(resumed)
        return base.build(cfg, accelerator, micro_batch, run_dir, resumed)

    def evaluate(request, cfg, model):
        calls["evaluate"].append(request)
        return {"toy": 1.0}

    toy = replace(base, name="toy", build=build, evaluate=evaluate, check=check, eval_options=("tta",),
                  sections=("generate",))  # a section no task owned: the config sees the registry as it is now
    monkeypatch.setitem(registry.TASKS, "toy", toy)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"section 'generate' is read by task: toy runs alone"):
        load_config(None, ["generate.beam_size=3", *tiny_overrides(tiny_imagefolder, run)])
    with pytest.raises(ConfigError, match="the toy task trains 5 epochs at most"):
        load_config(None, ["task=toy", *tiny_overrides(tiny_imagefolder, run, "train.epochs=6")])
    cfg = load_config(None, ["task=toy", *tiny_overrides(tiny_imagefolder, run, "data.loader=torch", "data.val_size=9",
                                                         "data.test_size=6")])
    assert cfg.task == "toy" and calls["check"] == ["toy", "toy"] and cfg.generate.beam_size == 1  # its own section
    train(cfg, stop_after_epoch=1)
    reset_accelerate()
    train(cfg)  # train.resume=auto: goes on from last/
    reset_accelerate()
    first, resumed = calls["build"]
    assert first is None and isinstance(resumed, Resumed)
    assert resumed.directory == run / "checkpoints" / "last"
    assert resumed.meta["classes"] == ["class_0", "class_1", "class_2"] and len(resumed.meta["mean"]) == 3
    assert set(resumed.data_state) == {"held_out"}
    main(["eval", "--checkpoint", str(run), "--split", "val", "--tta", "flip"])
    (request,) = calls["evaluate"]
    assert request == EvalRequest(run / "checkpoints" / "best", str(run), "val", 256, tta="flip")
    with pytest.raises(SystemExit):  # an option the entry does not take: one line, before the model is read
        main(["eval", "--checkpoint", str(run), "--knn", "3"])
