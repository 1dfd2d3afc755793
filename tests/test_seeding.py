"""Random streams: each consumer of randomness in a training epoch draws its own numbers."""
from __future__ import annotations

import numpy as np
import torch

from vitlab.data.corpus import WindowLoader
from vitlab.data.images import DeviceImageLoader, ImageData
from vitlab.seeding import process_seed, seed_process


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.corrcoef(a.double().numpy(), b.double().numpy())[0, 1])


def test_each_stream_has_its_own_seed_for_every_process_and_epoch():
    seeds = {process_seed(0, rank, epoch, stream, index) for rank in (0, 1) for epoch in (1, 2)
             for stream in ("global", "augment", "windows", "samples") for index in (None, 0, 1)}
    assert len(seeds) == 48  # index 0 is not "no index" (as a trailing 0 of a SeedSequence's entropy would be)
    # Images of one epoch: 100,000 per-image seeds, no two equal, as uniform as 32-bit draws.
    seeds = [process_seed(0, 0, 1, "samples", i) for i in range(100_000)]
    assert len(set(seeds)) == 100_000 and all(0 <= s < 2 ** 32 for s in seeds)
    high = torch.tensor([s >> 16 for s in seeds], dtype=torch.float64)
    assert abs(high.mean().item() / 2 ** 16 - 0.5) < 0.005 and abs(_correlation(high[:-1], high[1:])) < 0.02
    assert process_seed(3, 1, 2) == process_seed(3, 1, 2, "global")  # a pure function of its arguments


def test_device_loader_augmentation_does_not_draw_what_dropout_draws():
    # After seed_process (what the loop does at each epoch), dropout and drop path draw from torch's
    # global generator; the device loader's crops, flips and RandAugment from its own generator, seeded
    # for the global batch (the same on every process, so that an image's augmentation does not depend
    # on the number of processes).
    data = ImageData(torch.zeros(64, 3, 8, 8, dtype=torch.uint8), torch.zeros(64, dtype=torch.long), [])
    loader = DeviceImageLoader(data, 16, "cpu", seed=0, num_processes=2, process_index=1)
    loader.set_epoch(3)
    next(iter(loader))
    assert loader._generator.initial_seed() == process_seed(0, 0, 3, "augment", 0)  # batch 0's, any process
    augment_draws = torch.rand(10_000, generator=torch.Generator().manual_seed(loader._generator.initial_seed()))
    for process in (0, 1):
        seed_process(0, process, 3)
        global_draws = torch.rand(10_000)  # dropout's first draws on that process and epoch
        assert not torch.equal(augment_draws, global_draws)
        assert abs(_correlation(augment_draws, global_draws)) < 0.05


def test_language_model_windows_do_not_draw_what_process_0_dropout_draws():
    tokens = torch.arange(100_000) % 50
    loader = WindowLoader(tokens, 8, 4096, "cpu", steps=1, seed=0)
    loader.set_epoch(1)
    starts = next(iter(loader))[0][:, 0]  # tokens[start] = start % 50 for these tokens: use the windows' starts
    seed_process(0, 0, 1)
    same_stream = torch.randint(0, 100_000 - 8, (4096,))  # what the global generator (dropout) draws
    assert not torch.equal(starts, same_stream % 50)
    g = torch.Generator().manual_seed(process_seed(0, 0, 1, "windows"))
    assert torch.equal(starts, torch.randint(0, 100_000 - 8, (4096,), generator=g) % 50)


def test_no_two_images_of_an_epoch_draw_the_same_augmentation():
    # What an image's transform draws: torch's CPU generator seeded with its per-image seed (the
    # generator keeps only the low 32 bits of a seed). 200,000 images of an epoch, first draws all distinct.
    g = torch.Generator()
    first = [torch.randint(0, 2 ** 62, (1,), generator=g.manual_seed(process_seed(0, 0, 1, "samples", i))).item()
             for i in range(200_000)]
    assert len(set(first)) == 200_000
