"""What a run says: progress wherever its output goes, a last line with the result, where the model is and
the next command, what an interruption kept and lost, and bad paths answered with what is there."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import reset_accelerate, tiny_overrides
from vitlab.cli import main, train_main
from vitlab.config import load_config
from vitlab.errors import CheckpointError, ConfigError
from vitlab.progress import Progress


def test_a_finished_run_ends_with_its_result_in_percent_where_the_model_is_and_the_next_command(
        tiny_imagefolder, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train_main(["--config", "configs/cifar10_cpu_quick.yaml", "--json", *tiny_overrides(tiny_imagefolder, run_dir)])
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("model "))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where Accelerate puts a single process
    assert f" process(es) on {device}, " in header and " torch thread(s) each" in header
    summary = json.loads((run_dir / "summary.json").read_text())
    assert json.loads(out[-1]) == summary  # --json: the same summary, as the last line
    assert out[-2] == (f"finished 2 epochs in {summary['wall_time']:.0f} s: test top-1 "
                       f"{100 * summary['test_top1']:.2f}% at the final epoch | model: {run_dir}/checkpoints/last | "
                       f"next: vitlab eval --checkpoint {run_dir}")


def test_progress_reaches_a_log_file_at_least_every_interval(monkeypatch, capsys):
    clock = iter(range(0, 1000, 7))  # each call to time.time() moves 7 s on
    monkeypatch.setattr("vitlab.progress.time.time", lambda: next(clock))
    with Progress(range(10), total=10, desc="epoch 1/2", unit="batches", enabled=True, interval=30) as progress:
        for i in progress:
            progress.set_postfix(loss=f"{1 / (i + 1):.2f}")
    lines = capsys.readouterr().out.splitlines()
    assert not progress.terminal and len(lines) == 2  # captured output is not a terminal: plain lines, no bar
    assert lines == ["epoch 1/2: 5/10 batches (50%) | 35 s | loss 0.20", "epoch 1/2: 10/10 batches (100%) | 70 s | loss 0.10"]


def test_an_interrupted_run_says_what_it_kept_and_what_it_lost(tiny_imagefolder, tmp_path, monkeypatch, capsys):
    from vitlab import training

    original = training.Loop.step

    def ctrl_c_in_step_7(self, group):
        if self.state["global_step"] + 1 == 7:
            raise KeyboardInterrupt
        original(self, group)

    monkeypatch.setattr(training.Loop, "step", ctrl_c_in_step_7)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--config", "configs/cifar10_cpu_quick.yaml",
              *tiny_overrides(tiny_imagefolder, run_dir, "train.save_every_steps=4")])
    assert stopped.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"interrupted: kept {run_dir}/checkpoints/last (step 6, the end of epoch 1); the steps after it "
                   f"are lost (a stop signal, SIGTERM, would have kept them); the same command continues from it"]


def test_a_missing_config_lists_the_configs_there_and_an_empty_run_directory_lists_the_runs_below(tmp_path):
    with pytest.raises(ConfigError, match=r"config file 'configs/vit_cifar.yaml' does not exist; the configs in "
                                          r"configs: configs/cifar10_cpu_quick.yaml, .*configs/vit_cifar10.yaml"):
        load_config("configs/vit_cifar.yaml")
    (tmp_path / "runs" / "a" / "checkpoints" / "last").mkdir(parents=True)
    (tmp_path / "runs" / "b" / "checkpoints").mkdir(parents=True)
    from vitlab.checkpoint import resolve_checkpoint

    with pytest.raises(CheckpointError, match=r"expected a run directory \(checkpoints/best/ or checkpoints/last/\).*"
                                              r"; runs below it: runs/a, runs/b"):
        resolve_checkpoint(tmp_path)
    reset_accelerate()


def test_a_run_on_a_busy_machine_says_how_many_threads_to_give_torch(monkeypatch):
    import os
    import subprocess
    import sys

    import torch

    from vitlab.training.report import busy_machine_advice as _busy_machine_advice

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: torch runs one thread, nothing to advise")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()  # a pytest-xdist worker runs one (conftest): a run's default is a core each
    torch.set_num_threads(os.cpu_count())
    spinner = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                               stdout=subprocess.PIPE, text=True)  # another job on one core
    try:
        assert spinner.stdout.readline() == "spinning\n"  # it runs from now on
        advice = _busy_machine_advice()
    finally:
        spinner.kill()
        spinner.wait()
        torch.set_num_threads(threads)
    # The spinner takes a core at least (other tests, pytest-xdist's other workers, may take more).
    advised = re.search(r"OMP_NUM_THREADS=(\d+)", advice)
    assert "the machine is busy (" in advice and advised and 1 <= int(advised[1]) <= os.cpu_count() - 1, advice
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user has chosen: nothing to say
    assert _busy_machine_advice() == ""


def test_a_run_continued_by_several_commands_reports_the_whole_runs_time(tiny_imagefolder, tmp_path, capsys):
    # A job requeued 20 times must not say it took its last slice: the summary and the last line give the
    # run's time, the earlier commands' (kept in trainer_state.json) plus this one's.
    import time

    from vitlab import checkpoint as ckpt
    from vitlab.training import train

    run_dir = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, run_dir))
    train(cfg, stop_after_epoch=1)
    reset_accelerate()
    state_file = run_dir / "checkpoints/last/trainer_state.json"
    state = ckpt.read_json(state_file)
    ckpt.write_json(state_file, {**state, "wall_time": 1000.0})  # as if the first command had run 1000 s
    started = time.time()
    result = train(cfg, resume=run_dir)
    this_command = time.time() - started
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 1000.0 < result["wall_time"] == summary["wall_time"] < 1000.0 + this_command
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"finished 2 epochs in {summary['wall_time']:.0f} s")


def test_the_last_line_gives_the_best_validation_value_not_the_last_one():
    """The H100's char LM run (benchmarks/results/gpu_h100_s2/lm.summary.json): best 1.4398 at epoch 5,
    last 1.4794 at epoch 10. The line said 'best validation 1.4794 at epoch 5'."""
    from vitlab.training.report import result_line as _result_line

    result = {"val_loss": 1.4793837870181268, "best_metric": 1.4397721314913534, "best_epoch": 5,
              "epochs_done": 10, "wall_time": 166.46502017974854}
    line = _result_line(result, "loss", has_val=True, run_dir=Path("runs/lm"))
    assert "best validation loss 1.4398 at epoch 5 (runs/lm/checkpoints/best)" in line
    result = {"val_top1": 0.81, "test_top1": 0.8, "best_metric": 0.8312, "best_epoch": 3, "epochs_done": 4,
              "wall_time": 9.0}
    line = _result_line(result, "top1", has_val=True, run_dir=Path("r"))
    assert line.startswith("finished 4 epochs in 9 s: test top-1 80.00% at the final epoch, "
                           "best validation top-1 83.12% at epoch 3 (r/checkpoints/best)")
