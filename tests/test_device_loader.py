"""The device-resident loader (data.loader=gpu): same augmentation as the CPU path, exact shards."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vitlab.data.images import DeviceImageLoader, ImageData


def _data(n: int = 64) -> ImageData:
    g = torch.Generator().manual_seed(0)
    return ImageData(torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(n), [])


def test_every_image_is_a_padded_crop_of_its_source_possibly_flipped():
    # The CPU path's RandomCrop(padding=2) + RandomHorizontalFlip can produce exactly these images.
    data = _data()
    loader = DeviceImageLoader(data, 16, "cpu", crop_padding=2, hflip=True, seed=1)
    offsets, flips = set(), set()
    for images, labels in loader:
        for img, label in zip(images, labels):
            padded = F.pad(data.images[label], (2, 2, 2, 2))
            matches = [(dy, dx, f) for dy in range(5) for dx in range(5) for f in (False, True)
                       if torch.equal(img, (lambda c: c.flip(-1) if f else c)(padded[:, dy:dy + 8, dx:dx + 8]))]
            assert matches, f"image {label} is no crop of its source"
            offsets.add(matches[0][:2])
            flips.add(matches[0][2])
    assert len(offsets) > 10 and flips == {False, True}  # really random


def test_shuffling_is_seeded_by_epoch_and_covers_each_image_once():
    loader = DeviceImageLoader(_data(), 16, "cpu", seed=3)
    loader.set_epoch(1)
    first = torch.cat([y for _, y in loader])
    again = torch.cat([y for _, y in loader])
    loader.set_epoch(2)
    other = torch.cat([y for _, y in loader])
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert sorted(first.tolist()) == list(range(64))


def test_the_global_batches_and_their_augmentation_are_the_same_on_any_number_of_processes():
    # Elastic: crops, flips and RandAugment are drawn for the global batch, each process taking its part's;
    # a run continued on other processes augments each image as the run would have.
    data = _data()
    args = dict(crop_padding=2, hflip=True, seed=5, augment="randaugment")
    for start in (0, 2):
        whole = list(DeviceImageLoader(data, 16, "cpu", **args).batches_from(start))
        for processes in (2, 4):
            parts = [list(DeviceImageLoader(data, 16, "cpu", num_processes=processes, process_index=r,
                                            **args).batches_from(start)) for r in range(processes)]
            for step, (images, labels) in enumerate(whole):
                assert torch.equal(torch.cat([p[step][1] for p in parts]), labels)
                assert torch.equal(torch.cat([p[step][0] for p in parts]), images), (processes, step)
    plain = torch.cat([x for x, _ in DeviceImageLoader(data, 16, "cpu", seed=5, crop_padding=0, hflip=False)])
    assert not torch.equal(torch.cat([x for x, _ in DeviceImageLoader(data, 16, "cpu", **args)]), plain)


def test_evaluation_shards_are_exact_across_processes():
    data = _data(61)  # not a multiple of the batch or of the processes
    parts = [torch.cat([y for _, y in DeviceImageLoader(data, 16, "cpu", train=False, num_processes=3,
                                                        process_index=r)]) for r in range(3)]
    assert sorted(torch.cat(parts).tolist()) == list(range(61))  # every image exactly once
    images, _ = next(iter(DeviceImageLoader(data, 16, "cpu", train=False)))
    assert torch.equal(images, data.images[:16])  # no augmentation in evaluation


def test_training_with_the_device_loader_learns(tiny_imagefolder, tmp_path):
    from conftest import tiny_overrides
    from vitlab.config import load_config
    from vitlab.training import train

    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "data.loader=gpu",
                                                     "train.epochs=3")))
    assert summary["test_top1"] >= 0.9


def test_checkpoints_of_a_compiled_model_load_into_a_plain_one(tmp_path):
    import vitlab
    from vitlab import checkpoint as ckpt

    model = vitlab.create_model("vit_cifar_tiny_patch4_32")
    compiled = torch.compile(model)
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    ckpt.write_model_files(compiled, tmp_path, {"classes": list("abcdefghij"), "mean": [0.5] * 3, "std": [0.5] * 3},
                           "vit_cifar_tiny_patch4_32")
    loaded = vitlab.load_model(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    again = torch.compile(vitlab.create_model("vit_cifar_tiny_patch4_32"))
    ckpt.load_weights(again, tmp_path / "model.safetensors")  # and into a compiled one
    assert torch.equal(again._orig_mod.pos_embed, model.pos_embed)


def test_rand_augment_is_torchvisions_randaugment_per_image(monkeypatch):
    # The reference: torchvision's v2.RandAugment on one image at a time, its own random draws forced to
    # the op and sign that image drew in the batch version (every op occurs in a batch of 256 over 2 rounds).
    from torchvision.transforms import v2

    from vitlab.data.images import rand_augment

    x = torch.randint(0, 256, (256, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = rand_augment(x, num_ops=2, magnitude=9, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)  # the draws rand_augment made, round by round
    ops, negative = [], []
    for _ in range(2):
        ops.append(torch.randint(14, (256,), generator=g))
        negative.append(torch.rand(256, generator=g) <= 0.5)
    names = list(v2.RandAugment._AUGMENTATION_SPACE)
    assert len(names) == 14 and set(torch.cat(ops).tolist()) == set(range(14))
    reference = v2.RandAugment(num_ops=2, magnitude=9)
    rand = torch.rand
    for i in range(256):
        rounds = iter(range(2))

        def draw_op(space):  # torchvision draws the op of a round, then (signed ops only) its sign
            draw_op.round = next(rounds)
            name = names[int(ops[draw_op.round][i])]
            return name, space[name]

        monkeypatch.setattr(reference, "_get_random_item", draw_op)
        monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(0.0 if negative[draw_op.round][i] else 1.0))
        expected = reference(x[i])
        monkeypatch.setattr(torch, "rand", rand)
        assert torch.equal(out[i], expected), (i, [names[int(ops[r][i])] for r in range(2)])
    assert (out != x).flatten(1).any(1).float().mean() > 0.8  # most images changed


def test_device_loader_runs_randaugment_after_crop_and_flip():
    data = _data()
    plain = DeviceImageLoader(data, 16, "cpu", crop_padding=0, hflip=False)
    augmented = DeviceImageLoader(data, 16, "cpu", crop_padding=0, hflip=False,
                                  augment="randaugment", randaugment_ops=2, randaugment_magnitude=9)
    (a, labels_a), (b, labels_b) = next(iter(plain)), next(iter(augmented))
    assert torch.equal(labels_a, labels_b)  # the same images, in the same order
    assert not torch.equal(a, b) and b.min() >= 0 and b.max() <= 255
    evaluation = DeviceImageLoader(data, 16, "cpu", train=False, augment="randaugment")
    assert torch.equal(next(iter(evaluation))[0], data.images[:16])  # evaluation is never augmented


def test_loader_auto_is_the_device_loader_on_cuda_only():
    from vitlab.config import load_config
    from vitlab.errors import ConfigError
    from vitlab.tasks.image_data import resolve_loader

    assert load_config(None, []).data.loader == "auto"
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_loader("auto", "randaugment", cuda) == "gpu"
    assert resolve_loader("auto", "none", cpu) == "torch"
    assert resolve_loader("auto", "autoaugment", cuda) == "torch"  # only the DataLoader has AutoAugment
    assert resolve_loader("auto", "trivialaugment", cuda) == "torch"  # and TrivialAugment
    assert resolve_loader("auto", "rand-m9-mstd0.5-inc1", cuda) == "torch"  # timm's augmentations
    assert resolve_loader("auto", "randaugment", cuda, color_jitter=0.3) == "torch"  # and color jitter
    assert resolve_loader("auto", "none", cuda, train_crop="rrc") == "torch"  # and random resized crops
    assert resolve_loader("auto", "none", cuda, streamed=True) == "torch"  # and streamed images
    assert resolve_loader("gpu", "none", cpu) == "gpu" and resolve_loader("torch", "none", cuda) == "torch"
    load_config(None, ["data.loader=gpu", "data.augment=randaugment"])
    for key in ("data.augment=autoaugment", "data.augment=trivialaugment", "data.train_crop=rrc"):
        with pytest.raises(ConfigError, match="data.loader=torch"):
            load_config(None, ["data.loader=gpu", key])


@pytest.mark.parametrize("size", [(32, 32), (24, 40)])
def test_geometric_randaugment_ops_as_pixel_maps_equal_torchvisions_ops(size):
    # The device path moves pixels by a map torchvision computed once (no host copy per call on a GPU);
    # the reference is torchvision's op itself on the same uint8 batch, at every magnitude bin and sign.
    from torchvision.transforms import v2

    from vitlab.data.images import _GEOMETRIC, _move_pixels, _pixel_map

    reference = v2.RandAugment()
    x = torch.randint(0, 256, (4, 3, *size), dtype=torch.uint8)
    space = reference._AUGMENTATION_SPACE
    checked = 0
    for name in _GEOMETRIC:
        magnitudes = space[name][0](reference.num_magnitude_bins, *size)
        for m in magnitudes.tolist():
            for sign in (1.0, -1.0):
                expected = reference._apply_image_or_video_transform(x, name, sign * m, interpolation=reference.interpolation,
                                                                     fill=reference._fill)
                assert torch.equal(_move_pixels(x, _pixel_map(name, sign * m, *size, x.device)), expected), (name, m, sign)
                checked += 1
    assert checked == 5 * 31 * 2


def test_sharpness_without_the_host_copy_equals_torchvisions_at_every_magnitude():
    from torchvision.transforms.v2 import functional as TF

    from vitlab.data.images import _sharpen

    x = torch.randint(0, 256, (4, 3, 32, 24), dtype=torch.uint8)
    for m in torch.linspace(0.0, 0.9, 31).tolist():  # torchvision's magnitude bins, both signs
        for factor in (1.0 + m, 1.0 - m):
            assert torch.equal(_sharpen(x, factor), TF.adjust_sharpness(x, factor)), factor
