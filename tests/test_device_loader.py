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


@pytest.mark.parametrize("crop", [(), ("data.train_crop=rrc", "data.decode_size=40", "data.scale=[0.3,1.0]")],
                         ids=["pad", "rrc"])
def test_training_with_the_device_loader_learns(tiny_imagefolder, tmp_path, crop):
    from conftest import tiny_overrides
    from vitlab.config import load_config
    from vitlab.training import train

    summary = train(load_config(None, tiny_overrides(tiny_imagefolder, tmp_path / "run", "data.loader=gpu",
                                                     "train.epochs=3", *crop)))
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
    for key in ("data.augment=autoaugment", "data.augment=trivialaugment", "data.train_crop=src"):
        with pytest.raises(ConfigError, match="data.loader=torch"):
            load_config(None, ["data.loader=gpu", key])
    load_config(None, ["data.loader=gpu", "data.train_crop=rrc"])  # random resized crops: when asked
    with pytest.raises(ConfigError, match=r"^data.loader=gpu holds .* data.train_crop=rrc streams the images to crop "
                                          r"each at its own size: set data.decode_size"):
        resolve_loader("gpu", "none", cpu, streamed=True, train_crop="rrc")


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


# Random resized crops in the device loader (data.loader=gpu with data.train_crop=rrc): a batch's boxes drawn at
# once from the loader's generator, so their distribution (not each box) is torchvision's; the crop of a box is.

@pytest.mark.parametrize("shape, scale, ratio", [((40, 36), (0.08, 1.0), (3 / 4, 4 / 3)),
                                                 ((32, 32), (0.05, 0.4), (0.2, 5.0))])  # many tries fail: fallback
def test_a_batchs_boxes_are_distributed_as_torchvisions_over_10000_draws(shape, scale, ratio):
    from scipy.stats import ks_2samp
    from torchvision.transforms import v2

    from vitlab.data.batch_views import rrc_boxes

    n = 10_000
    ours = rrc_boxes(torch.rand(n, 22, generator=torch.Generator().manual_seed(0)), *shape, scale, ratio)
    reference = v2.RandomResizedCrop(8, scale=scale, ratio=ratio)
    torch.manual_seed(0)
    theirs = torch.tensor([list(reference.make_params([torch.zeros(3, *shape)]).values())[:4] for _ in range(n)])
    assert ours.shape == (n, 4) and ours.dtype == torch.long
    top, left, h, w = ours.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= shape[0]).all() and (left + w <= shape[1]).all()
    for column in range(4):  # top, left, height, width
        assert ks_2samp(ours[:, column].numpy(), theirs[:, column].numpy()).pvalue > 1e-3, column
    area = (h * w).double() / (shape[0] * shape[1])
    their_area = (theirs[:, 2] * theirs[:, 3]).double() / (shape[0] * shape[1])
    assert abs(area.mean() - their_area.mean()) < 0.01 and ks_2samp(area.numpy(), their_area.numpy()).pvalue > 1e-3
    whole = lambda boxes: ((boxes[:, 2] == shape[0]) & (boxes[:, 3] == shape[1])).double().mean()
    assert abs(whole(ours) - whole(theirs)) < 0.01  # the fallback (the central crop) as often


def test_the_crop_of_a_box_is_torchvisions_resized_crop_to_a_level():
    from torchvision.transforms.v2 import functional as TF

    from vitlab.data.batch_views import resized_crops, rrc_boxes

    images = torch.randint(0, 256, (64, 3, 40, 36), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    boxes = rrc_boxes(torch.rand(64, 22, generator=torch.Generator().manual_seed(2)), 40, 36, (0.08, 1.0),
                      (3 / 4, 4 / 3))
    ours = resized_crops(images, boxes, (24, 24), uint8=True)
    theirs = torch.stack([TF.resized_crop(image, *box.tolist(), [24, 24], interpolation=TF.InterpolationMode.BICUBIC,
                                          antialias=True) for image, box in zip(images, boxes)])
    differ = (ours.int() - theirs.int()).abs()
    # torch's uint8 kernel's fixed-point weights: 0.5% of the pixels a level apart here, one pixel two; made in one
    # pass and rounded once (no uint8 between the two resizes) a fifth differ, by up to 18 levels on this noise
    assert differ.max() <= 2 and (differ > 0).float().mean() < 0.01


def test_the_device_loaders_random_resized_crops_are_elastic_resumable_and_vary():
    data = _data()
    args = dict(seed=5, train_crop="rrc", size=(6, 6), scale=(0.3, 1.0), augment="randaugment")
    everything = list(DeviceImageLoader(data, 16, "cpu", **args).batches_from(0))
    for start in (0, 2):
        whole = list(DeviceImageLoader(data, 16, "cpu", **args).batches_from(start))
        assert whole[0][0].shape == (16, 3, 6, 6) and whole[0][0].dtype == torch.uint8
        assert all(torch.equal(a[0], b[0]) for a, b in zip(whole, everything[start:], strict=True))  # resumed as whole
        for processes in (2, 4):
            parts = [list(DeviceImageLoader(data, 16, "cpu", num_processes=processes, process_index=r,
                                            **args).batches_from(start)) for r in range(processes)]
            for step, (images, labels) in enumerate(whole):
                assert torch.equal(torch.cat([p[step][1] for p in parts]), labels)
                assert torch.equal(torch.cat([p[step][0] for p in parts]), images), (processes, step)
    other = DeviceImageLoader(data, 16, "cpu", **args)
    other.set_epoch(1)
    first, second = next(iter(DeviceImageLoader(data, 16, "cpu", **args))), next(iter(other))
    assert not torch.equal(first[0], second[0])
    resized = DeviceImageLoader(data, 16, "cpu", seed=5, size=(6, 6), crop_padding=0, hflip=False)
    assert not torch.equal(first[0], next(iter(resized))[0])  # crops, not the whole image made small


def test_evaluation_of_an_rrc_run_on_the_device_loader_sees_the_dataloaders_images(tiny_imagefolder):
    # An rrc run is evaluated on the center crop of crop_pct (timm's, through PIL): the device loader's evaluation
    # images are the DataLoader's, pixel for pixel
    from vitlab.config import load_config
    from vitlab.data.images import TensorImageDataset
    from vitlab.inference.view import eval_dataset
    from vitlab.tasks.image_data import device_eval_data, index_splits

    cfg = load_config(None, ["data.dataset=imagefolder", f"data.root={tiny_imagefolder}", "data.train_crop=rrc",
                             "data.crop_pct=0.8", "data.decode_size=40"])
    _, test_index = index_splits(cfg.data, seed=0)
    test = test_index.load((40, 40), in_memory=True)
    view = eval_dataset(test, (32, 32), 0.8)
    assert isinstance(view, TensorImageDataset)
    expected = torch.stack([view[i][0] for i in range(len(view))])
    got = torch.cat([x for x, _ in DeviceImageLoader(device_eval_data(test, (32, 32), 0.8), 10, "cpu", train=False)])
    assert torch.equal(got, expected) and got.shape == (36, 3, 32, 32)
