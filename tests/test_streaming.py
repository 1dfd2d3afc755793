"""Data larger than memory: images streamed from where they live (decoded by DataLoader workers when
read), with the numbers of the same images held in memory, every sample once an epoch, and the choice
said in one line."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import reset_accelerate, same_run_records, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import ConfigError
from vitlab.training import train

RANDOM = ("data.loader=torch", "data.augment=randaugment", "data.mixup_alpha=0.2", "model.drop_path_rate=0.1",
          "train.ema_decay=0.9")


@pytest.mark.slow
def test_streamed_and_in_memory_runs_of_the_same_images_end_with_the_same_weights(cifar10_dir, tmp_path, on_cpu):
    # 200 real CIFAR-10 training images (20 held out for validation) and 40 test images, 2 epochs with
    # RandAugment, mixup, drop path and EMA: decoded once into memory, or by 2 workers when read.
    extra = (*RANDOM, "model.num_classes=10", "data.train_subset=180", "data.val_size=20", "data.test_subset=40",
             "train.batch_size=20")
    runs = {}
    for name, where in (("memory", ("data.in_memory=true",)), ("streamed", ("data.in_memory=false",
                                                                               "data.num_workers=2"))):
        runs[name] = tmp_path / name
        train(load_config(None, tiny_overrides(cifar10_dir, runs[name], *extra, *where)))
        reset_accelerate()
    for weights in ("model.safetensors", "ema.safetensors"):
        a, b = (load_file(str(runs[n] / "checkpoints/last" / weights)) for n in ("memory", "streamed"))
        assert all(torch.equal(a[k], b[k]) for k in a), weights
    assert same_run_records(runs["memory"], runs["streamed"])
    records = [json.loads(line) for line in (runs["streamed"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_samples"] for r in records if r["split"] == "eval"] == [180, 180]  # 9 steps of 20 an epoch


def test_auto_streams_a_data_set_over_the_memory_budget_and_says_why(tiny_imagefolder, tmp_path, monkeypatch,
                                                                      capsys):
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 100 if name == "SC_PHYS_PAGES" else real(name))  # ~400 KB
    train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "train.epochs=1")))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data: "))
    assert line.startswith("data: 132 images at 32 x 32 take 0.00 GiB decoded, over the budget of 0.0 GiB a process")
    assert "streamed, decoded by 0 DataLoader worker(s) (data.in_memory=auto; true or false to choose)" in line
    reset_accelerate()
    with pytest.raises(ConfigError, match=r"data.loader=gpu holds the whole data set on the device, and "
                                          r"data.in_memory=auto chose to stream it"):
        train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "gpu", "data.loader=gpu")))
    with pytest.raises(ConfigError, match=r"data.in_memory=False is invalid; expected true or auto with "
                                          r"data.loader=gpu"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "x", "data.loader=gpu", "data.in_memory=false"))


def test_auto_streams_imagenet_style_crops_of_files_at_their_own_sizes(tiny_imagefolder):
    # In memory the images would be squashed to one size before the random resized crops and the
    # evaluation's center crop: other pixels than streaming gives. auto keeps them at their own sizes.
    from vitlab.tasks.image_data import in_memory, index_splits

    cfg = load_config(None, tiny_overrides(tiny_imagefolder, tiny_imagefolder / "unused", "data.train_crop=rrc"))
    train_index, test_index = index_splits(cfg.data)
    keep, line = in_memory(cfg.data, train_index, test_index, (32, 32))
    assert not keep and line.startswith("data: streamed, decoded at their own sizes by 0 DataLoader worker(s): "
                                        "data.train_crop=rrc crops each image at its own size")
    for extra in ("data.decode_size=48", "data.in_memory=true"):
        d = load_config(None, tiny_overrides(tiny_imagefolder, tiny_imagefolder / "unused", "data.train_crop=rrc",
                                             extra)).data
        assert in_memory(d, train_index, test_index, (32, 32))[0]


def test_every_streamed_sample_once_an_epoch_across_two_processes_and_two_workers(tiny_imagefolder):
    # Each process as Accelerate builds it for 2 processes, each loader with 2 workers; the labels
    # are the images' numbers. 96 images, global batches of 16: 6 batches, nothing dropped.
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from vitlab.data import index_split
    from vitlab.data.images import TensorImageDataset
    from vitlab.training import set_epoch

    index = index_split("imagefolder", tiny_imagefolder, "train")
    streamed, memory = index.load((32, 32), in_memory=False), index.load((32, 32))
    streamed.labels = torch.arange(len(index))
    dataset = TensorImageDataset(streamed)
    orders = []
    for epoch in (1, 2):
        seen = []
        for rank in (0, 1):
            loader = prepare_data_loader(DataLoader(dataset, batch_size=16, shuffle=True, drop_last=True,
                                                    num_workers=2), num_processes=2, process_index=rank,
                                         split_batches=True, put_on_device=False, use_seedable_sampler=True,
                                         data_seed=0)
            set_epoch(loader, epoch)
            for images, ids in loader:
                assert torch.equal(images, memory.images[ids])  # decoded in a worker as in memory
                seen += ids.tolist()
        assert sorted(seen) == list(range(96))  # every image once, over both processes
        orders.append(seen)
    assert orders[0] != orders[1]  # a new order each epoch


@pytest.mark.slow
def test_a_corrupt_image_met_while_streaming_stops_the_run_in_one_line_naming_it(tmp_path):
    # Decided: stop, not skip (a skipped image would change what an epoch is, silently). The worker's
    # error reaches the user as the one line it raised, not as a worker traceback. In a process of its
    # own: run in pytest's process, the error's traceback keeps the DataLoader's iterator alive, and its
    # workers, which ignore SIGTERM (stop signals are the main process's), held pytest's exit forever.
    import subprocess
    import sys
    from pathlib import Path

    from conftest import make_imagefolder

    root = make_imagefolder(tmp_path / "data", {"train": 8, "test": 2})
    broken = root / "train" / "class_1" / "0003.png"
    broken.write_bytes(b"not a png")
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(repo / "train.py"), "--config", str(repo / "configs/cifar10_cpu_quick.yaml"),
                           *tiny_overrides(root, tmp_path / "run", "data.in_memory=false", "data.loader=torch",
                                           "data.num_workers=2", "train.batch_size=8")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: cannot read image '{broken}'")


@pytest.mark.parametrize("layout, expected_gib", [
    ({"proc": "0::/job/step\n", "job/memory.max": "8589934592\n", "job/step/memory.max": "max\n"}, 8),  # v2: a parent's
    ({"proc": "4:memory:/slurm/uid_0/job_1\n0::/\n", "memory/slurm/uid_0/job_1/memory.limit_in_bytes": "4294967296\n",
      "memory/memory.limit_in_bytes": "9223372036854771712\n"}, 4),  # v1 (SLURM's --mem=4G)
    ({"proc": "0::/\n", "unified/memory.max": "2147483648\n"}, 2),  # v2 beside v1 (a hybrid mount)
    ({"proc": "0::/\n", "memory.max": "max\n"}, None),  # unlimited: the machine's memory
    ({"proc": "4:memory:/\n", "memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),
    ({}, None),  # no cgroups at all (macOS)
])
def test_the_memory_budget_is_the_cgroups_limit_where_one_is_set(tmp_path, layout, expected_gib):
    # A 4 GiB SLURM job on a 512 GiB node must plan for 4 GiB: data.in_memory=auto decoded everything and
    # was killed. The limit is read from this process's cgroup and every cgroup above it.
    from vitlab.tasks.image_data.loaders import _memory_bytes

    root = tmp_path / "cgroup"
    for name, text in layout.items():
        path = tmp_path / "self_cgroup" if name == "proc" else root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    physical = _memory_bytes(tmp_path / "missing", root)
    assert physical == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    found = _memory_bytes(tmp_path / "self_cgroup", root)
    assert found == (physical if expected_gib is None else expected_gib * 2 ** 30)


@pytest.fixture(scope="module")
def streamed_sources(tiny_imagefolder, tmp_path_factory) -> dict[str, tuple[str, ...]]:
    """The tiny ImageFolder three ways, each streamed by DataLoader workers: the folder itself, a saved
    DatasetDict of its files, its WebDataset shards."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("webdataset")
    from vitlab.cli import main

    root = tmp_path_factory.mktemp("sources")
    classes = sorted(p.name for p in (tiny_imagefolder / "train").iterdir())
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    datasets.DatasetDict({split: datasets.Dataset.from_dict(
        {"image": [str(f) for c in classes for f in sorted((tiny_imagefolder / split / c).iterdir())],
         "label": [i for i, c in enumerate(classes) for _ in sorted((tiny_imagefolder / split / c).iterdir())]},
        features=features) for split in ("train", "test")}).save_to_disk(str(root / "saved"))
    main(["shards", str(tiny_imagefolder), str(root / "shards"), "--shard-size", "48"])
    # The folder and the shards with timm's crops: each file is then decoded by the crop that needs it, at the
    # scale it needs (data.scaled_decode), in the workers; the Hub set with the CIFAR-style padded crop.
    return {"imagefolder": ("data.dataset=imagefolder", f"data.root={tiny_imagefolder}", "data.in_memory=false",
                            "data.train_crop=rrc"),
            "hf": ("data.dataset=hf", f"data.root={root / 'saved'}", "data.in_memory=false"),
            "wds": ("data.dataset=wds", f"data.root={root / 'shards'}", "data.train_crop=rrc")}


@pytest.fixture(scope="module")
def forked_results() -> dict[str, dict]:
    return {}  # source -> the run with workers started by fork, the reference


@pytest.mark.slow
@pytest.mark.parametrize("source, method", [("imagefolder", "forkserver"), ("imagefolder", "spawn"),
                                            ("hf", "spawn"), ("wds", "spawn")])
def test_streamed_sources_train_with_workers_started_by_forkserver_and_spawn_as_by_fork(
        streamed_sources, forked_results, tiny_imagefolder, tmp_path, on_cpu, source, method, capsys):
    # Python 3.14 starts multiprocessing workers by forkserver on Linux, macOS and Windows by spawn: both
    # pickle the dataset for each worker (a listed split held lambdas: "Can't pickle local object
    # 'index_imagefolder.<locals>.<lambda>'", and every streamed run there died at its first batch). The
    # workers read the same images, augmented by the same per-image seeds, whichever way they started.
    # Both methods pickle the dataset alike (the same reducers; neither inherits the parent's memory): every
    # source goes through spawn, which also imports the parent's main module anew, and one through forkserver
    # (each run costs its workers' 3.5 s imports of torch and vitlab).
    import multiprocessing

    from vitlab.training import train

    keys = (*streamed_sources[source], "data.loader=torch", "data.num_workers=1", "train.epochs=1")  # 1 pickles as 2 do
    # forkserver's run with a time budget: its steps timed on workers of their own, ended, then the epoch's started;
    # the result is the unbudgeted run's (train.epochs bounds the budget)
    budgeted = ("train.budget_minutes=30",) if method == "forkserver" else ()
    previous = multiprocessing.get_start_method(allow_none=True)
    for start in ("fork", method) if source not in forked_results else (method,):
        multiprocessing.set_start_method(start, force=True)
        try:
            extra = budgeted if start == method else ()
            result = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / start, *keys, *extra)))
        finally:
            multiprocessing.set_start_method(previous, force=True)
            reset_accelerate()
        forked_results.setdefault(source, result)
    assert result["test_top1"] == forked_results[source]["test_top1"]
    assert result["test_loss"] == pytest.approx(forked_results[source]["test_loss"], abs=1e-6)
    assert ("train.budget_minutes=30: 1 epoch" in capsys.readouterr().out) == bool(budgeted)
