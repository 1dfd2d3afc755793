"""data.cache_dir (issue 51, 4): a split decoded into memory is kept on disk and read back by the next run,
the same pixels; a file changed on disk (its size or its modification time), another decode size or another
subset decodes anew."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.data import index_split
from vitlab.data.split import SplitIndex


def _no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("decoded an image the cache holds")
    monkeypatch.setattr(SplitIndex, "decode", refuse)


def test_a_decoded_split_is_read_back_from_the_cache_and_a_changed_file_decodes_anew(tiny_imagefolder, tmp_path,
                                                                                      monkeypatch):
    root = tmp_path / "data"
    shutil.copytree(tiny_imagefolder, root)
    cache = tmp_path / "cache"
    fresh = index_split("imagefolder", root, "train").load((24, 24), scaled=True, cache_dir=cache)
    assert len(list(cache.glob("*.safetensors"))) == 1
    with monkeypatch.context() as m:
        _no_decoding(m)
        again = index_split("imagefolder", root, "train").load((24, 24), scaled=True, cache_dir=cache)
    assert torch.equal(again.images, fresh.images) and torch.equal(again.labels, fresh.labels)
    assert [again.key(i) for i in range(3)] == [fresh.key(i) for i in range(3)]
    # Another size, another subset: their own entries.
    index_split("imagefolder", root, "train").load((16, 16), scaled=True, cache_dir=cache)
    index_split("imagefolder", root, "train").load((24, 24), subset=30, scaled=True, cache_dir=cache)
    assert len(list(cache.glob("*.safetensors"))) == 3
    # A file rewritten with other pixels (its size changes), then one only touched: decoded anew.
    first = sorted((root / "train" / "class_1").iterdir())[0]
    other = sorted((root / "train" / "class_2").iterdir())[0]
    first.write_bytes(other.read_bytes())
    changed = index_split("imagefolder", root, "train").load((24, 24), scaled=True, cache_dir=cache)
    at = [changed.key(i) for i in range(len(changed.labels))].index(f"class_1/{first.name}")
    assert not torch.equal(changed.images[at], fresh.images[at])
    stamp = os.stat(other)
    os.utime(other, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10 ** 9))
    count = len(list(cache.glob("*.safetensors")))
    index_split("imagefolder", root, "train").load((24, 24), scaled=True, cache_dir=cache)
    assert len(list(cache.glob("*.safetensors"))) == count + 1
    assert not list(cache.glob("*.tmp*"))  # written whole, then renamed into place


def test_a_second_run_reads_its_images_from_the_cache_and_trains_the_same(tiny_imagefolder, tmp_path, monkeypatch,
                                                                           capsys, on_cpu):
    from vitlab.training import train

    keys = ("data.cache_dir=" + str(tmp_path / "cache"), "data.in_memory=true", "train.epochs=1")
    first = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "a", *keys)))
    reset_accelerate()
    assert "kept the 96 decoded images" in capsys.readouterr().out
    with monkeypatch.context() as m:
        _no_decoding(m)
        second = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "b", *keys)))
    reset_accelerate()
    assert "read the 96 decoded images" in capsys.readouterr().out
    assert second["test_top1"] == first["test_top1"] and second["test_loss"] == first["test_loss"]
