"""Repeated augmentation (``data.aug_repeats``, DeiT's RASampler, timm's RepeatAugSampler): each process
reads exactly what timm's sampler gives its rank, the epoch length is timm's, the copies of an image get
independent augmentations, and a run resumes bit for bit and on another number of processes the same
global batches."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from timm.data.distributed_sampler import RepeatAugSampler as TimmRepeatAugSampler

from conftest import reset_accelerate, tiny_overrides, train_until_signal
from vitlab.config import load_config
from vitlab.data.images import ImageData, TensorImageDataset
from vitlab.data.repeat import RepeatAugSampler
from vitlab.errors import ConfigError
from vitlab.training import train


@pytest.mark.parametrize("n, repeats, batch", [(1000, 3, 48), (300, 2, 32), (100, 3, 12)])
def test_each_process_reads_what_timms_sampler_gives_its_rank(n, repeats, batch):
    # timm shuffles with torch.Generator().manual_seed(epoch); give vitlab's order the same permutation.
    epoch = 4
    if n < 256 and len(TimmRepeatAugSampler(range(n), num_replicas=1, rank=0)) == 0:
        import timm

        pytest.skip(f"timm {timm.__version__}'s RepeatAugSampler selects no sample of fewer than 256 (newer timm "
                    f"selects all of them, as vitlab)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))
    sampler = RepeatAugSampler(n, repeats, seed=0, batch_size=batch)
    order = sampler.order(perm, batch)
    assert len(order) == len(sampler) == (n // 256 * 256 if n >= 256 else n) // batch * batch
    for processes in (1, repeats):
        share = batch // processes
        for rank in range(processes):
            theirs = TimmRepeatAugSampler(range(n), num_replicas=processes, rank=rank, num_repeats=repeats)
            theirs.set_epoch(epoch)
            timm_rank = list(theirs)
            # Accelerate's split_batches: process `rank` takes its slice of each global batch.
            mine = [order[s + rank * share:s + (rank + 1) * share] for s in range(0, len(order), batch)]
            if processes == 1:  # one process: the same batches, in another order within each
                theirs = [sorted(timm_rank[s:s + batch]) for s in range(0, len(order), batch)]
                assert [sorted(int(j) % n for j in part) for part in mine] == theirs
                continue
            mine = [int(j) % n for part in mine for j in part]
            assert mine == timm_rank[:len(mine)] and len(mine) == len(order) // processes


def test_the_copies_of_an_image_get_independent_augmentations():
    sampler = RepeatAugSampler(512, 3, seed=7)
    sampler.set_epoch(2)
    ids = list(sampler)
    assert len(ids) == len(set(ids)) == 512  # every (image, copy) once
    images = [j % 512 for j in ids]
    counts = torch.bincount(torch.tensor(images), minlength=512)
    assert counts.max() == 3 and (counts > 0).sum() == 171  # ceil(512 / 3) images, in threes
    again = RepeatAugSampler(512, 3, seed=7)
    again.set_epoch(2)
    assert list(again) == ids and ids != list(RepeatAugSampler(512, 3, seed=8))
    data = ImageData(torch.randint(0, 256, (512, 3, 8, 8), dtype=torch.uint8), torch.zeros(512, dtype=torch.long),
                     ["a"])
    flips = TensorImageDataset(data, lambda x: x + torch.randint(0, 1000, ()), seed=0)
    first, second = flips[ids[0]][0], flips[ids[0] + 512][0]  # the same image, copies 0 and 1
    assert not torch.equal(first, second)
    assert torch.equal(flips[ids[0] % 512][0], flips[ids[0] % 512][0])
    # iterated as a sequence (a user's `for image, label in dataset`), the data set is its images once each: the
    # copies are indices past its end, which only the sampler asks for (it iterated forever)
    assert len(list(TensorImageDataset(data))) == 512 and len(list(iter(flips))) == 512


def test_a_repeated_run_resumes_bit_identical_and_is_refused_where_it_cannot_hold(
        tiny_imagefolder, tmp_path, monkeypatch, on_cpu):
    keys = ("data.aug_repeats=3", "data.augment=randaugment", "train.epochs=2")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_config(None, tiny_overrides(tiny_imagefolder, whole, *keys)))
    reset_accelerate()
    train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "plain", *keys[1:])))
    reset_accelerate()
    cfg = load_config(None, tiny_overrides(tiny_imagefolder, parts, *keys))
    train_until_signal(monkeypatch, cfg, 7)
    train(cfg)
    a = load_file(str(whole / "checkpoints/last/model.safetensors"))
    b = load_file(str(parts / "checkpoints/last/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = load_file(str(tmp_path / "plain/checkpoints/last/model.safetensors"))
    assert not torch.equal(a["head.weight"], plain["head.weight"])  # the repeats changed what it trained on
    with pytest.raises(ConfigError, match=r"^data.aug_repeats=3 is invalid; expected 1 .* data.loader=gpu"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "x", "data.aug_repeats=3", "data.loader=gpu"))
    with pytest.raises(ConfigError, match=r"^data.aug_repeats=0 is invalid"):
        load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "x", "data.aug_repeats=0"))


def test_every_epoch_reaches_the_sampler_inside_accelerates_shards_of_two_processes():
    # Accelerate before 1.7 passed set_epoch to a sampler under a BatchSampler but not under its
    # BatchSamplerShard (several processes): repeated augmentation read epoch 0's order every epoch
    # (process 0 saw 85 of 300 images in 3 epochs). make test-lowest (accelerate 1.1.0) runs this.
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from vitlab.training import set_epoch

    n, batch = 300, 32
    data = ImageData(torch.zeros(n, 3, 4, 4, dtype=torch.uint8), torch.arange(n) % 3, ["a", "b", "c"])
    sampler = RepeatAugSampler(n, 3, seed=0, batch_size=batch)
    loader = DataLoader(TensorImageDataset(data, lambda x: x, seed=0), batch_size=batch, sampler=sampler, drop_last=True)
    seen, first, orders = set(), set(), []
    for rank in (0, 1):
        shard = prepare_data_loader(loader, num_processes=2, process_index=rank, split_batches=True,
                                    put_on_device=False)
        for epoch in (1, 2, 3):
            set_epoch(shard, epoch)
            assert sampler.epoch == epoch
            order = list(shard.batch_sampler)
            orders.append(order)
            if rank == 0:
                seen |= {j % n for part in order for j in part}
                first = first or set(seen)
    assert orders[0] != orders[1] != orders[2] and orders[0] != orders[3]  # epochs differ; the ranks' shares differ
    assert len(seen) > 1.5 * len(first)  # 3 epochs see more images than one (the frozen order: the same 85)
