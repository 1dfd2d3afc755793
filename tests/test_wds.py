"""WebDataset shards (data.dataset=wds): written by `vitlab shards` from an ImageFolder byte for byte,
read back by the webdataset package; the epoch's plan: the same global batches on any processes x
workers from an uneven number of shards (resumed on another layout: tests/test_elastic.py); an epoch
resumed inside it ends bit-identical; the same images give the same numbers
as their folder; bad input in one line."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_imagefolder, reset_accelerate, same_run_records, signal_at_step, tiny_overrides
from vitlab.config import load_config
from vitlab.errors import ConfigError, DataError, Preempted
from vitlab.training import train

pytest.importorskip("webdataset")  # a test dependency (vitlab[dev]); the package's own error is tested below

ROOT = Path(__file__).resolve().parents[1]
RANDOM = ("data.augment=randaugment", "data.mixup_alpha=0.2", "model.drop_path_rate=0.1", "train.ema_decay=0.9")


@pytest.fixture(scope="module")
def tiny_shards(tiny_imagefolder, tmp_path_factory) -> Path:
    """The tiny ImageFolder (96 training images, 36 test) as shards of 14: 7 training shards (6 x 14 + 12)."""
    from vitlab.cli import main

    out = tmp_path_factory.mktemp("shards")
    main(["shards", str(tiny_imagefolder), str(out), "--shard-size", "14"])
    return out


def wds(shards: Path, *extra: str) -> tuple[str, ...]:
    return ("data.dataset=wds", f"data.root={shards}", "data.loader=torch", *extra)


def test_vitlab_shards_writes_every_image_byte_for_byte_with_torchvisions_class(tiny_imagefolder, tiny_shards):
    import webdataset
    from torchvision.datasets import ImageFolder

    for split, shards in (("train", 7), ("test", 3)):
        reference = ImageFolder(str(tiny_imagefolder / split))
        expected = sorted((hashlib.sha256(Path(p).read_bytes()).hexdigest(), c) for p, c in reference.samples)
        urls = sorted(str(p) for p in tiny_shards.glob(f"{split}-*.tar"))
        assert len(urls) == shards
        samples = list(webdataset.WebDataset(urls, shardshuffle=False))
        got = sorted((hashlib.sha256(s["png"]).hexdigest(), int(s["cls"])) for s in samples)
        assert got == expected
        classes = (tiny_shards / "classes.txt").read_text().split()
        assert classes == reference.classes
        # Shuffled before writing: a shard holds several classes, not one.
        assert len({int(s["cls"]) for s in samples[:14]}) == 3
    with pytest.raises(DataError, match="already holds shards"):
        from vitlab.data.convert import convert_to_shards

        convert_to_shards(tiny_imagefolder, tiny_shards, ["train"])


def test_vitlab_shards_max_size_writes_photos_upright_at_most_n_px_as_pil_resizes_them_and_keeps_small_ones(tmp_path):
    # Photos written once at a training resolution (FFCV's max_resolution): a 300 x 200 JPEG whose EXIF
    # orientation 6 stands it upright as 200 x 300, a 60 x 40 PNG smaller than the limit, a 120 x 40 one.
    import io

    import webdataset
    from PIL import Image, ImageOps

    from vitlab.cli import main

    root = tmp_path / "photos" / "train"
    rng = torch.Generator().manual_seed(0)
    pixels = lambda w, h: Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6
    pixels(300, 200).save(root / "a" / "tall.jpg", quality=95, exif=exif.tobytes())
    pixels(60, 40).save(root / "a" / "small.png")
    pixels(120, 40).save(root / "b" / "wide.png")
    main(["shards", str(tmp_path / "photos"), str(tmp_path / "out"), "--split", "train", "--max-size", "64",
          "--quality", "85"])
    got = list(webdataset.WebDataset(str(tmp_path / "out" / "train-000000.tar"), shardshuffle=False))
    assert len(got) == 3 and sorted(int(s["cls"]) for s in got) == [0, 0, 1]
    small = next(s for s in got if "png" in s)
    assert small["png"] == (root / "a" / "small.png").read_bytes()  # at most 64 px already: its own bytes
    for name, size in (("a/tall.jpg", (43, 64)), ("b/wide.png", (64, 21))):
        upright = ImageOps.exif_transpose(Image.open(root / name)).convert("RGB")
        expected = io.BytesIO()
        upright.resize(size, Image.BICUBIC).save(expected, format="JPEG", quality=85, subsampling=0)
        assert any(s.get("jpg") == expected.getvalue() for s in got), name
    with pytest.raises(SystemExit):
        main(["shards", str(tmp_path / "photos"), str(tmp_path / "out2"), "--max-size", "0"])


def test_shards_with_their_wids_index_are_listed_without_reading_them_and_a_stale_index_is_not_trusted(
        tiny_shards, tmp_path, monkeypatch):
    import shutil

    from vitlab.data import shards

    scanned = []
    real_scan = shards._scan
    monkeypatch.setattr(shards, "_scan", lambda url: scanned.append(url) or real_scan(url))
    index = shards.index_shards(tiny_shards, "train")
    assert index.counts == [14] * 6 + [12] and index.labels is None and not scanned  # from train.json
    assert json.loads((tiny_shards / "train.json").read_text())["__kind__"] == "wids-shard-index-v1"
    copy = tmp_path / "copy"
    shutil.copytree(tiny_shards, copy)
    with open(copy / "train-000003.tar", "ab") as f:  # a shard changed since its index was written
        f.write(b"\0" * 10240)
    index = shards.index_shards(copy, "train")
    assert index.counts == [14] * 6 + [12] and len(scanned) == 7 and len(index.labels) == 96  # read instead


def test_shards_read_through_a_pipe_command_give_what_the_files_give(tiny_shards, tmp_path):
    # pipe: (how object stores are read, e.g. pipe:aws s3 cp ... -) with cat: no index, every shard read
    # through as a stream, listed and streamed alike.
    from vitlab.data.shard_stream import ShardStream
    from vitlab.data.shards import index_shards

    local = index_shards(tmp_path, f"{tiny_shards}/test-*.tar")  # listed by test.json, labels read with samples
    piped = index_shards(tmp_path, f"pipe:cat {tiny_shards}/test-{{000000..000002}}.tar")  # every cls read now
    assert piped.counts == local.counts == [14, 14, 8] and local.labels is None and len(piped.labels) == 36
    read = [[(x, int(y)) for xs, ys in ShardStream(ix, [(s, 0, n) for s, n in enumerate(ix.counts)], None, 4, False,
                                                   (32, 32)) for x, y in zip(xs, ys)] for ix in (local, piped)]
    assert len(read[0]) == 36 and all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(*read))


def _global_batches(index, processes: int, workers: int, epoch: int, start: int = 0, partitions: int = 4,
                    batch: int = 24, buffer: int = 5) -> list[list[int]]:
    """The global batches of an epoch from step ``start`` on, as ``processes`` x ``workers`` read them: each
    process's loader as a run builds it, the processes' batches joined in process order; the labels are
    the samples' ids."""
    from vitlab.data.shard_stream import ShardLoader, ShardStream

    per_process = []
    for rank in range(processes):
        stream = ShardStream(index, [(s, 0, n) for s, n in enumerate(index.counts)], None, batch // processes, True,
                             (32, 32), seed=0, num_processes=processes, process_index=rank, num_workers=workers,
                             shuffle_buffer=buffer, partitions=partitions)
        loader = ShardLoader(stream)
        loader.set_epoch(epoch)
        per_process.append([labels.tolist() for _, labels in loader.batches_from(start)])
        assert len(loader) == 96 // batch and all(len(b) == batch // processes for b in per_process[-1])
    return [[i for p in per_process for i in p[step]] for step in range(len(per_process[0]))]


@pytest.mark.slow
def test_the_global_batches_of_streamed_shards_are_the_same_on_any_processes_and_workers_and_resume_so(tiny_shards):
    # Elastic determinism (the epoch's plan, vitlab.data.plan): 96 samples in 7 uneven shards, 4
    # partitions, global batches of 24. Every layout that divides the partitions gives the plan's global
    # batches, from the start and from any step; every sample once an epoch; another order each epoch.
    from vitlab.data.plan import EpochPlan
    from vitlab.data.shards import index_shards

    index = index_shards(tiny_shards, "train")
    assert index.counts == [14] * 6 + [12]
    index.labels = torch.arange(len(index))
    plan = EpochPlan(tuple((s, 0, n) for s, n in enumerate(index.counts)), (0, 14, 28, 42, 56, 70, 84), 24, 4,
                     shuffle_buffer=5)
    for epoch in (1, 2):
        expected = [plan.batch_ids(epoch, step) for step in range(4)]
        assert sorted(i for b in expected for i in b) == list(range(96))  # every sample once
        for processes, workers in ((1, 0), (1, 2), (2, 2), (4, 1), (2, 3)):  # 3 workers: 2 partitions, 2 used
            assert _global_batches(index, processes, workers, epoch) == expected, (processes, workers)
        for start in (1, 3):  # resumed inside the epoch on another layout than the one that stopped
            assert _global_batches(index, 1, 1, epoch, start) == expected[start:]
            assert _global_batches(index, 2, 2, epoch, start) == expected[start:]
    assert plan.batch_ids(1, 0) != plan.batch_ids(2, 0)
    with pytest.raises(ConfigError, match=r"^this run reads its training shards as 4 partitions, fixed when it started "
                                          r"\(data.partitions, else its processes x DataLoader workers then\); 3 processes "
                                          r"cannot share them equally: launch 1, 2, 4 process\(es\)$"):
        _global_batches(index, 3, 1, 1)
    # Evaluation: every sample once over the processes, nothing dropped, in parts that may differ by one.
    from vitlab.data.shard_stream import ShardLoader, ShardStream

    eval_seen = []
    for rank in (0, 1):
        stream = ShardStream(index, [(s, 0, n) for s, n in enumerate(index.counts)][:5], None, 8, False, (32, 32),
                             num_processes=2, process_index=rank, num_workers=2)
        eval_seen += [i for _, labels in ShardLoader(stream) for i in labels.tolist()]
    assert sorted(eval_seen) == list(range(70))


def test_shard_workers_live_across_epochs_and_read_each_epochs_plan(tiny_shards):
    # Workers started once for the run (a fork each epoch, from a process with live threads, can hang):
    # each epoch, and a start inside one, reaches them through shared memory.
    from vitlab.data.shard_stream import ShardLoader, ShardStream
    from vitlab.data.shards import index_shards

    index = index_shards(tiny_shards, "train")
    index.labels = torch.arange(len(index))
    stream = ShardStream(index, [(s, 0, n) for s, n in enumerate(index.counts)], None, 24, True, (32, 32),
                         num_workers=2, shuffle_buffer=5, partitions=4)
    loader, pids = ShardLoader(stream), []
    for epoch, start in ((1, 0), (2, 0), (3, 2), (2, 1)):
        loader.set_epoch(epoch)
        expected = [stream.plan.batch_ids(epoch, step) for step in range(start, 4)]
        assert [labels.tolist() for _, labels in loader.batches_from(start)] == expected, (epoch, start)
        pids.append(sorted(w.pid for w in loader._loader._iterator._workers))
    assert len(pids[0]) == 2 and all(p == pids[0] for p in pids) and os.getpid() not in pids[0]


@pytest.mark.slow
def test_shards_without_an_index_are_listed_by_one_process_of_a_run_and_shared(tiny_shards, tmp_path):
    # Listing shards without an index reads every sample's cls (minutes for ImageNet-1k): process 0 lists,
    # the others get its listing, or its error, and read nothing.
    import shutil
    import socket

    import torch.multiprocessing as mp

    from helpers.listing import list_shards

    for tar in tiny_shards.glob("*.tar"):
        shutil.copy(tar, tmp_path)  # no <split>.json, no classes.txt: every shard read through
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    mp.start_processes(list_shards, args=([str(tmp_path), str(tmp_path / "nothing")], port, str(tmp_path / "got")),
                       nprocs=2, start_method="spawn")
    listed, failed = zip(*(json.loads((tmp_path / f"got.{rank}.json").read_text()) for rank in (0, 1)))
    assert [g.pop("scanned") for g in listed] == [10, 0] and listed[0] == listed[1]  # 7 + 3 shards, read once
    assert len(listed[0]["labels"]) == 36 and listed[0]["total"] == 96
    assert failed[0] == failed[1] and failed[0]["scanned"] == 0
    assert failed[0]["error"].startswith("DataError: no WebDataset shards match")


@pytest.mark.slow
@pytest.mark.parametrize("step,buffer", [(3, 1000), (4, 1000), (3, 5)])
def test_a_signal_inside_an_epoch_of_streamed_shards_resumes_at_the_next_sample_bit_identical(
        tiny_shards, tmp_path, monkeypatch, on_cpu, step, buffer):
    # 2 workers, 2 partitions of 42 samples giving 7 to each of 6 steps: stopping after step 3 or 4
    # resumes each partition at its sample 21 or 28. A buffer of 5 holds a few of them: the resumed
    # partition reads again only what its buffer still held.
    extra = (*RANDOM, *wds(tiny_shards, "data.num_workers=2", "data.val_size=12", f"data.shuffle_buffer={buffer}"),
             "train.batch_size=14")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, tiny_overrides(tiny_shards, whole, *extra)))
    reset_accelerate()
    cfg = load_config(None, tiny_overrides(tiny_shards, parts, *extra))
    with monkeypatch.context() as m:
        signal_at_step(m, step)
        with pytest.raises(Preempted):
            train(cfg)
    reset_accelerate()
    state = json.loads((parts / "checkpoints/last/trainer_state.json").read_text())
    assert (state["epoch"], state["epoch_step"]) == (0, step)
    train(cfg)  # the same command continues at the next sample
    for name in ("model.safetensors", "ema.safetensors"):
        a, b = (load_file(str(run / "checkpoints/last" / name)) for run in (whole, parts))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert same_run_records(whole, parts)
    records = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_samples"] for r in records if r["split"] == "eval"] == [84, 84]  # 6 global batches of 14


@pytest.mark.parametrize("crop", ["pad", "rrc"])
def test_vitlab_eval_of_a_model_on_the_shards_of_a_folder_gives_the_folders_numbers(
        tiny_imagefolder, tiny_shards, tmp_path, crop):
    # One model, its test split read from the ImageFolder and from the shards `vitlab shards` wrote of
    # it: the same pixels, so the same predictions (evaluated in other orders and batches).
    from vitlab.cli import main

    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(tiny_imagefolder, run, "train.epochs=1", "data.loader=torch",
                                           f"data.train_crop={crop}")))
    reset_accelerate()
    main(["eval", "--checkpoint", str(run), "--output", str(tmp_path / "folder.json")])
    reset_accelerate()
    main(["eval", "--checkpoint", str(run), "--output", str(tmp_path / "shards.json"), "--batch-size", "5",
          *wds(tiny_shards)])
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("folder", "shards"))
    assert b["num_images"] == a["num_images"] == 36
    assert a["per_class"] == b["per_class"] and a["top1"] == b["top1"]
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)


def _tar(path: Path, samples: list[dict]) -> None:
    import webdataset

    with webdataset.TarWriter(str(path)) as writer:
        for sample in samples:
            writer.write(sample)


def test_bad_shards_are_one_line_before_training(tiny_shards, tmp_path, monkeypatch):
    from vitlab.data.shards import index_shards

    with pytest.raises(DataError, match=r"no WebDataset shards match '.*/nothing-\{0000\.\.0009\}\.tar'"):
        index_shards(tmp_path, "nothing-{0000..0009}.tar")
    with pytest.raises(DataError, match=r"no WebDataset shards match '.*/val-\*\.tar'; data.dataset=wds takes"):
        index_shards(tiny_shards, "val")
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    image = buffer.getvalue()
    _tar(tmp_path / "nocls-000000.tar", [{"__key__": "a", "png": image, "cls": b"0"}, {"__key__": "b", "png": image}])
    with pytest.raises(DataError, match=r"sample 'b' of shard '.*nocls-000000.tar' has no 'cls' \(an integer class\); "
                                        r"its files: \['png'\]"):
        index_shards(tmp_path, "nocls")
    _tar(tmp_path / "noimage-000000.tar", [{"__key__": "a", "txt": b"x", "cls": b"0"}])
    with pytest.raises(DataError, match=r"sample 'a' of shard '.*' has no image \(jpg, jpeg, png, webp\)"):
        index_shards(tmp_path, "noimage")
    # Listed by an index, a shard's samples are checked when they are read: still one line.
    from vitlab.data.shard_stream import ShardStream
    from vitlab.data.shards import write_index

    (tmp_path / "indexed").mkdir()
    _tar(tmp_path / "indexed/idx-000000.tar", [{"__key__": "a", "png": image, "cls": b"0"},
                                               {"__key__": "b", "png": image, "cls": b"7"}, {"__key__": "c", "png": image}])
    write_index([tmp_path / "indexed/idx-000000.tar"], [3], tmp_path / "indexed/idx.json")
    (tmp_path / "indexed/classes.txt").write_text("one\ntwo\n")
    index = index_shards(tmp_path / "indexed", "idx")
    assert index.labels is None and index.counts == [3]
    for segment, message in (((0, 0, 2), r"sample 'b' of shard '.*idx-000000.tar' has 'cls' 7, but there are 2 classes"),
                             ((0, 2, 3), r"sample 'c' of shard '.*idx-000000.tar' has no 'cls' \(an integer class\)")):
        with pytest.raises(DataError, match=message):
            list(ShardStream(index, [segment], None, 1, False, (8, 8)))
    run = tmp_path / "run"
    with pytest.raises(DataError, match=r"7 shard\(s\) for 8 partitions \(data.partitions, else processes x DataLoader "
                                        r"workers\); give each partition a shard of its own: lower data.num_workers"):
        train(load_config(None, tiny_overrides(tiny_shards, run, *wds(tiny_shards, "data.num_workers=8"))))
    with pytest.raises(ConfigError, match=r"data.in_memory=True is invalid; expected auto or false with "
                                          r"data.dataset=wds"):
        load_config(None, tiny_overrides(tiny_shards, run, *wds(tiny_shards, "data.in_memory=true")))
    monkeypatch.setitem(sys.modules, "webdataset", None)  # as if not installed
    with pytest.raises(DataError, match=r"^data.dataset=wds reads shards with the webdataset package: "
                                        r"pip install 'vitlab\[wds\]'$"):
        index_shards(tiny_shards, "train")


@pytest.mark.slow
def test_a_corrupt_image_in_a_shard_stops_the_run_in_one_line_naming_sample_and_shard(tmp_path):
    # Decided as for folders: stop, not skip. In a process of its own (see test_streaming's twin).
    root = make_imagefolder(tmp_path / "data", {"train": 8, "test": 2})
    good = (root / "train/class_0/0000.png").read_bytes()
    for split, n in (("train", 24), ("test", 6)):
        _tar(tmp_path / f"{split}-000000.tar", [{"__key__": f"{split}{i:03d}", "png": good, "cls": str(i % 3).encode()}
                                                for i in range(n // 2)])
        _tar(tmp_path / f"{split}-000001.tar", [{"__key__": f"{split}{i:03d}", "png": b"not a png" if i == 17 else good,
                                                 "cls": str(i % 3).encode()} for i in range(n // 2, n)])
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/cifar10_cpu_quick.yaml"),
                           *tiny_overrides(tmp_path, tmp_path / "run", *wds(tmp_path, "data.num_workers=2"),
                                           "train.batch_size=4")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: cannot read image 'train017' of shard '{tmp_path}/train-000001.tar'")


def _png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_shard_changed_at_its_old_size_is_listed_again_and_other_counts_than_listed_stop_in_one_line(tmp_path):
    # tar pads to 10 KiB records: a shard that lost a small sample kept its size, was listed from its stale
    # index, and gave short batches and KeyErrors in workers. A shard newer than its index is listed again;
    # a shard that yields fewer or more samples than its listing stops the run in one line.
    from vitlab.data.shard_stream import ShardStream
    from vitlab.data.shards import index_shards, write_index

    shard, index_file = tmp_path / "idx-000000.tar", tmp_path / "idx.json"
    samples = [{"__key__": f"k{i}", "png": _png(), "cls": b"0"} for i in range(7)]
    _tar(shard, samples[:6])
    write_index([shard], [6], index_file)
    (tmp_path / "classes.txt").write_text("one\n")
    size = shard.stat().st_size
    _tar(shard, samples[:5])  # one sample fewer, padded back to the size the index has
    with open(shard, "ab") as f:
        f.write(b"\0" * (size - shard.stat().st_size))
    assert shard.stat().st_size == size
    os.utime(index_file, ns=(shard.stat().st_mtime_ns - 10 ** 9,) * 2)  # written before the change
    listed = index_shards(tmp_path, "idx")
    assert listed.counts == [5] and listed.labels is not None  # read again, not trusted
    for kept, holds in ((samples[:5], 5), (samples, 7)):  # dated before its index (a copy that kept dates)
        _tar(shard, kept)
        os.utime(shard, ns=(index_file.stat().st_mtime_ns - 10 ** 9,) * 2)
        listed = index_shards(tmp_path, "idx")
        assert listed.counts == [6] and listed.labels is None
        message = (rf"shard '{shard}' holds {'5' if holds == 5 else 'more than 6'} samples, but it was listed with 6: "
                   rf"it changed after it was listed; restore it, or remove its index {index_file.name} so that the "
                   rf"shards are listed by reading them")
        with pytest.raises(DataError, match=message):
            list(ShardStream(listed, [(0, 0, 6)], None, 1, False, (8, 8)))


def test_an_image_under_another_name_in_an_indexed_shard_is_one_line(tmp_path):
    # 'k0.input.jpg' is the suffix 'input.jpg': no image. Without an index the listing says so; with one, a
    # bare next() raised StopIteration inside a generator (a 55-line RuntimeError). Now the same line.
    from vitlab.data.shard_stream import ShardStream
    from vitlab.data.shards import index_shards, write_index

    _tar(tmp_path / "odd-000000.tar", [{"__key__": "k0", "input.png": _png(), "cls": b"0"}])
    write_index([tmp_path / "odd-000000.tar"], [1], tmp_path / "odd.json")
    (tmp_path / "classes.txt").write_text("one\n")
    listed = index_shards(tmp_path, "odd")
    assert listed.labels is None
    with pytest.raises(DataError, match=r"^sample 'k0' of shard '.*odd-000000.tar' has no image \(jpg, jpeg, png, "
                                        r"webp\); its files: \['cls', 'input.png'\]$"):
        list(ShardStream(listed, [(0, 0, 1)], None, 1, False, (8, 8)))


def test_vitlab_shards_numbers_a_later_split_by_the_classes_written_and_keeps_class_names_as_they_are(tmp_path,
                                                                                                         capsys):
    # `--split test` after `--split train` replaced classes.txt with the test split's classes: a test split
    # without a class shifted every label. And a class folder 'bird ' came back from the shards as 'bird'.
    import shutil

    from vitlab.cli import main
    from vitlab.data.folder import index_imagefolder
    from vitlab.data.shards import index_shards

    src = make_imagefolder(tmp_path / "src", {"train": 2, "test": 2})
    (src / "train/class_1").rename(src / "train/bird ")
    (src / "test/class_1").rename(src / "test/bird ")
    shutil.rmtree(src / "test/class_0")  # the test split lacks the first class
    out = tmp_path / "shards"
    main(["shards", str(src), str(out), "--split", "train"])
    written = (out / "classes.txt").read_bytes()
    main(["shards", str(src), str(out), "--split", "test"])
    assert (out / "classes.txt").read_bytes() == written == b"bird \nclass_0\nclass_2\n"
    train_classes = index_imagefolder(src, "train").classes
    assert index_shards(out, "train").classes == train_classes == ["bird ", "class_0", "class_2"]
    test = index_shards(tmp_path, f"pipe:cat {out}/test-000000.tar", train_classes)  # every cls read
    folder = index_imagefolder(src, "test", train_classes)
    assert sorted(test.labels.tolist()) == sorted(folder.labels.tolist()) == [0, 0, 2, 2]
    (src / "test/class_3").mkdir()  # a class the written classes.txt does not have: one line, nothing written
    shutil.copy(next((src / "test/class_2").iterdir()), src / "test/class_3/x.png")
    (out / "test-000000.tar").unlink()
    (out / "test.json").unlink()
    with pytest.raises(SystemExit):
        main(["shards", str(src), str(out), "--split", "test"])
    assert "has class(es) ['class_3'] that the training split does not have" in capsys.readouterr().err
    assert not list(out.glob("test-*")) and (out / "classes.txt").read_bytes() == written
