"""The ImageNet-style transforms (``data.train_crop=rrc``) against their references: timm's evaluation
transform, pixel for pixel on real JPEG photographs, and torchvision's random resized crop boxes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as v1

from conftest import reset_accelerate, tiny_overrides
from vitlab.config import load_config
from vitlab.data.decode import open_image
from vitlab.data.transforms import center_crop_transform, rrc_train_transform
from vitlab.errors import ConfigError

PHOTO = Path(__import__("matplotlib").get_data_path()) / "sample_data" / "grace_hopper.jpg"  # 512 x 600, a photograph
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    """JPEGs (quality 90) of several sizes and shapes cut from a real photograph, and the photograph."""
    folder = tmp_path_factory.mktemp("photos")
    photo = Image.open(PHOTO).convert("RGB")
    files = [PHOTO]
    for i, (box, size) in enumerate([((0, 0, 512, 400), (500, 391)), ((50, 30, 450, 590), (300, 420)),
                                     ((100, 100, 400, 300), (333, 222)), ((0, 0, 512, 600), (97, 113))]):
        files.append(folder / f"photo_{i}.jpg")
        photo.crop(box).resize(size, Image.BICUBIC).save(files[-1], quality=90)
    return files


def _tinted_photos(root: Path, train: int, test: int) -> None:
    """An ImageFolder of JPEGs of the photograph at random sizes (40-89 px a side), class c tinted in channel c."""
    rng = np.random.default_rng(0)
    photo = Image.open(PHOTO).convert("RGB")
    for split, n in (("train", train), ("test", test)):
        for c in range(3):
            (root / split / f"class_{c}").mkdir(parents=True)
            for i in range(n):
                w, h = (int(v) for v in rng.integers(40, 90, 2))
                tinted = np.asarray(photo.resize((w, h)), dtype=np.float64) * 0.5
                tinted[..., c] += 120
                Image.fromarray(tinted.clip(0, 255).astype(np.uint8)).save(root / split / f"class_{c}" / f"{i}.jpg",
                                                                           quality=90)


@pytest.mark.parametrize("size,crop_pct", [(224, 0.875), (224, 1.0), (96, 0.9)])
def test_evaluation_pixels_equal_timms_create_transform_on_real_jpegs(photos, size, crop_pct):
    from timm.data import create_transform

    # Pixels (timm without normalization: mean 0, std 1) exactly; normalized (the batch step of
    # training and vitlab eval) to 1e-6 (torchvision's v1 and v2 Normalize round the float arithmetic
    # differently, 7e-7 at most here).
    from vitlab.data.transforms import ModelInput

    ours = center_crop_transform((size, size), crop_pct)
    for mean, std, exact in (((0.0,) * 3, (1.0,) * 3, True), (MEAN, STD, False)):
        timm_eval = create_transform(input_size=size, is_training=False, crop_pct=crop_pct, interpolation="bicubic",
                                     mean=mean, std=std)
        for path in photos:
            expected = timm_eval(Image.open(path).convert("RGB"))
            got = ours(open_image(path))  # how vitlab reads a streamed file: uint8
            assert got.shape == (3, size, size) and got.dtype == torch.uint8, path.name
            if exact:  # the same uint8 levels
                assert torch.equal(got.float(), (expected * 255).round()), path.name
            else:
                normalized = ModelInput(MEAN, STD)(got[None])[0]
                assert torch.allclose(normalized, expected, atol=1e-6, rtol=0), path.name


def test_random_resized_crop_boxes_are_distributed_as_torchvisions(monkeypatch):
    # The boxes our training transform cuts (recorded where it crops), against torchvision's own
    # RandomResizedCrop.get_params with timm's defaults: the same distribution of area and aspect ratio.
    from torchvision.transforms import v2

    boxes = []
    name = "make_params" if hasattr(v2.RandomResizedCrop, "make_params") else "_get_params"  # torchvision >= 0.21
    original = getattr(v2.RandomResizedCrop, name)

    def recording(self, *args, **kwargs):
        params = original(self, *args, **kwargs)
        boxes.append((params["height"], params["width"]))
        return params

    monkeypatch.setattr(v2.RandomResizedCrop, name, recording)
    image = torch.zeros(3, 300, 400, dtype=torch.uint8)
    transform = rrc_train_transform((32, 32), hflip=False)  # scale (0.08, 1), ratio (3/4, 4/3)
    torch.manual_seed(0)
    for _ in range(4000):
        transform(image)
    torch.manual_seed(1)
    reference = [v1.RandomResizedCrop.get_params(Image.new("RGB", (400, 300)), (0.08, 1.0), (3 / 4, 4 / 3))[2:]
                 for _ in range(4000)]

    def stats(hw):
        a = torch.tensor(hw, dtype=torch.float64)
        area, log_ratio = a[:, 0] * a[:, 1] / (300 * 400), (a[:, 1] / a[:, 0]).log()
        return torch.stack([area.quantile(torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)),
                            log_ratio.quantile(torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))])

    assert len(boxes) == 4000
    assert (stats(boxes) - stats(reference)).abs().max() < 0.03  # sampling noise of 4,000 draws is ~0.01


def test_imagenet_style_keys_are_checked_in_one_line():
    for bad, message in [("data.scale=[0.5,0.1]", "data.scale=[0.5, 0.1] is invalid"),
                         ("data.crop_pct=1.5", "data.crop_pct=1.5 is invalid"),
                         ("data.reprob=0.25", "0 with data.train_crop=pad")]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(None, [bad])


def test_an_imagenet_style_run_streams_random_crops_and_predict_sees_what_evaluation_saw(photos, tmp_path, capsys):
    # JPEGs of their own sizes, streamed and cropped at random in training; evaluation (in training and
    # in vitlab eval) and vitlab predict center-crop them alike.
    import vitlab
    from vitlab.cli import main
    from vitlab.data.transforms import create_transform
    from vitlab.training import train

    _tinted_photos(tmp_path / "data", train=8, test=4)
    run = tmp_path / "run"
    summary = train(load_config(None, tiny_overrides(
        tmp_path / "data", run, "data.train_crop=rrc", "data.scale=[0.35,1]", "data.reprob=0.25",
        "data.augment=trivialaugment", "data.in_memory=false", "data.loader=torch", "data.crop_pct=0.9",
        "train.batch_size=8")))
    reset_accelerate()
    assert "data: 36 images at their own sizes, streamed" in capsys.readouterr().out
    model = vitlab.load_model(run)
    assert model.pretrained_cfg["crop_pct"] == 0.9
    main(["eval", "--checkpoint", str(run), "--output", str(tmp_path / "m.json")])
    reset_accelerate()
    assert json.loads((tmp_path / "m.json").read_text())["top1"] == summary["test_top1"]
    files = sorted((tmp_path / "data" / "test" / "class_1").glob("*.jpg"))[:2]
    capsys.readouterr()
    main(["predict", "--checkpoint", str(run), "--topk", "1", *map(str, files)])
    printed = capsys.readouterr().out.splitlines()
    with torch.no_grad():
        probs = model(torch.stack([create_transform(model)(open_image(f)) for f in files])).softmax(-1)
    for line, p in zip(printed, probs):
        name = model.pretrained_cfg["label_names"][int(p.argmax())]
        assert line.endswith(f": {name} {p.max():.3f}")


def test_jpegs_decode_to_the_pixels_pil_gives_and_other_files_through_pil(photos, tmp_path):
    # libjpeg-turbo through simplejpeg, against PIL's own decode of the same file: the photograph, its
    # cuts, a progressive, a greyscale and a CMYK JPEG (which simplejpeg declines: PIL decodes it), a PNG.
    from vitlab.data.decode import decode_image, simplejpeg

    assert simplejpeg is not None  # a dependency: the fast path is what is tested here
    photo = Image.open(PHOTO)
    extra = {"progressive.jpg": (photo, dict(progressive=True, quality=85)), "grey.jpg": (photo.convert("L"), {}),
             "cmyk.jpg": (photo.convert("CMYK"), {}), "cut.png": (photo.crop((0, 0, 200, 100)), {})}
    files = list(photos)
    for name, (image, options) in extra.items():
        image.save(tmp_path / name, **options)
        files.append(tmp_path / name)
    for path in files:
        expected = torch.from_numpy(np.asarray(Image.open(path).convert("RGB"))).permute(2, 0, 1)
        got = decode_image(path.read_bytes(), str(path))
        assert got.dtype == torch.uint8 and torch.equal(got, expected), path.name
        resized = Image.open(path).convert("RGB").resize((40, 30), Image.BICUBIC)  # at a size: PIL's bicubic
        assert torch.equal(decode_image(path.read_bytes(), str(path), (30, 40)),
                           torch.from_numpy(np.asarray(resized).copy()).permute(2, 0, 1)), path.name
    from vitlab.errors import DataError

    for size in (None, (30, 40)):  # a broken file is one line naming it, at either size
        with pytest.raises(DataError, match=r"^cannot read image 'sample 7 of a shard': "):
            decode_image(b"\xff\xd8 not a JPEG", "'sample 7 of a shard'", size)


def test_random_erasing_erases_normalized_batches_as_timms_prefetcher_does():
    # ModelInput: timm's PrefetchLoader arithmetic, bit for bit, then its RandomErasing (mode 'pixel') in
    # training only.
    from timm.data.loader import PrefetchLoader

    from vitlab.data.transforms import ModelInput

    batch = torch.randint(0, 256, (16, 3, 24, 24), dtype=torch.uint8)
    reference = next(iter(PrefetchLoader([(batch, torch.zeros(16))], MEAN, STD, device=torch.device("cpu"))))[0]
    assert torch.equal(ModelInput(MEAN, STD)(batch), reference)
    erasing = ModelInput(MEAN, STD, reprob=1.0)
    assert torch.equal(erasing(batch), reference)  # evaluation: never erased
    torch.manual_seed(0)
    erased = erasing(batch, train=True)
    changed = (erased != reference).flatten(1).float().mean(1)
    assert (changed > 0.01).all() and (changed < 0.5).all()  # every image, a rectangle of 2-33% of it (timm's)


@pytest.mark.parametrize("spec", ["rand-m9-mstd0.5-inc1", "rand-m7-n3", "original-mstd0.5", "3a", "augmix-m5-w3"])
def test_timm_augment_strings_are_timms_own_transforms_with_draws_seeded_per_image(spec):
    # data.augment as timm writes it (DeiT: rand-m9-mstd0.5-inc1; DeiT III's 3-Augment: 3a). The ops are
    # timm's, on a PIL image, with timm's hparams; their Python and NumPy draws come from a seed drawn
    # from torch's generator, so an image's augmentation stays a function of (seed, epoch, image).
    import random

    from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform

    from vitlab.data.images import seeded_transform
    from vitlab.data.transforms import timm_augment_hparams, train_transform

    image = torch.from_numpy(np.array(Image.open(PHOTO).convert("RGB").resize((64, 64)))).permute(2, 0, 1)
    hparams = timm_augment_hparams((64, 64), CIFAR_MEAN)
    assert hparams["translate_const"] == int(64 * 0.45) and hparams["img_mean"] == (125, 123, 114)
    ours = train_transform((64, 64), crop_padding=0, hflip=False, augment=spec, mean=CIFAR_MEAN)
    factory = (rand_augment_transform if spec.startswith("rand") else
               augment_and_mix_transform if spec.startswith("augmix") else auto_augment_transform)
    theirs = factory(spec, dict(hparams))
    outputs = []
    for i in range(6):
        got = seeded_transform(ours, image, 0, 1, i)
        with torch.random.fork_rng(devices=[]):  # the seed the transform drew, then timm's transform under it
            from vitlab.seeding import process_seed

            torch.random.default_generator.manual_seed(process_seed(0, 0, 1, "samples", i))
            seed = int(torch.randint(0, 2 ** 31 - 1, ()))
        random.seed(seed), np.random.seed(seed)
        expected = torch.from_numpy(np.asarray(theirs(v1.functional.to_pil_image(image)))).permute(2, 0, 1)
        assert torch.equal(got, expected), (spec, i)
        assert torch.equal(seeded_transform(ours, image, 0, 1, i), got)  # the same draw again
        outputs.append(got)
    assert any(not torch.equal(a, outputs[0]) for a in outputs[1:])  # images draw differently
    state = (random.getstate(), np.random.get_state()[1].copy())
    seeded_transform(ours, image, 0, 2, 0)
    assert random.getstate() == state[0] and np.array_equal(np.random.get_state()[1], state[1])  # left as they were


CIFAR_MEAN = (0.4914, 0.4822, 0.4465)


def test_timms_increasing_posterize_at_magnitude_10_gives_the_black_image_not_pillows_error():
    # timm's PosterizeIncreasing keeps 0 bits at magnitude 10 (m9 plus noise reaches it); Pillow 11 refuses
    # 0 bits, older ones gave a black image: vitlab keeps the black image, so a run does not die.
    from vitlab.data.images import seeded_transform
    from vitlab.data.transforms import TimmAugment, timm_augment_hparams

    image = torch.from_numpy(np.array(Image.open(PHOTO).convert("RGB").resize((32, 32)))).permute(2, 0, 1)
    augment = TimmAugment("rand-m10-n1-mstd0-inc1", timm_augment_hparams((32, 32), CIFAR_MEAN))
    posterize = [op for op in augment.transform.ops if op.name == "PosterizeIncreasing"]
    assert len(posterize) == 1
    posterize[0].prob = 1.0
    black = posterize[0](v1.functional.to_pil_image(image))
    assert np.array(black).max() == 0
    outputs = [seeded_transform(augment, image, 0, 1, i) for i in range(40)]  # every op drawn, none fails
    assert sum(int(x.max() == 0) for x in outputs) >= 1


def test_color_jitter_is_torchvisions_with_brightness_contrast_and_saturation_of_the_key():
    # data.color_jitter (timm's --color-jitter, DeiT III's 0.3 with 3-Augment): torchvision's ColorJitter(cj, cj, cj),
    # after the augmentation, its draws seeded per image.
    from torchvision.transforms import v2

    from vitlab.data.images import seeded_transform
    from vitlab.data.transforms import rrc_train_transform, train_transform

    image = torch.from_numpy(np.array(Image.open(PHOTO).convert("RGB").resize((48, 40)))).permute(2, 0, 1)
    ours = train_transform((40, 48), crop_padding=0, hflip=False, color_jitter=0.4)
    reference = v2.ColorJitter(0.4, 0.4, 0.4)
    outputs = [seeded_transform(ours, image, 0, 1, i) for i in range(4)]
    assert all(torch.equal(o, seeded_transform(reference, image, 0, 1, i)) for i, o in enumerate(outputs))
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], image)
    assert isinstance(rrc_train_transform((32, 32), color_jitter=0.3).transforms[-2], v2.ColorJitter)


def test_simple_random_crop_is_deit3s_resize_then_reflect_padded_random_crop():
    # data.train_crop=src, DeiT III's "simple random crop" (its augment.py): Resize(img_size, bicubic) of the
    # shorter side, RandomCrop(img_size, padding=4, padding_mode='reflect'), a flip. Written here with
    # torchvision's v1 transforms on the same resized image and draws: the same crop.
    from vitlab.data.images import seeded_transform
    from vitlab.data.transforms import src_train_transform

    image = torch.from_numpy(np.array(Image.open(PHOTO).convert("RGB"))).permute(2, 0, 1)  # 512 wide, 600 high
    ours = src_train_transform((64, 64), hflip=True)
    # The resize is vitlab's one rule (torch's antialiased bicubic on uint8; DeiT III resizes PIL images, and
    # torchvision's v1 on tensors differs from both by a few levels): the crop, padding and flip are v1's.
    from torchvision.transforms import v2

    resize = v2.Resize(64, interpolation=v2.InterpolationMode.BICUBIC, antialias=True)
    reference = v1.Compose([v1.RandomCrop(64, padding=4, padding_mode="reflect"), v1.RandomHorizontalFlip()])
    resized = resize(image)
    assert tuple(resized.shape) == (3, 75, 64)  # the shorter side (the width, 512 of 600) to 64
    outputs = []
    for i in range(8):
        got = seeded_transform(ours, image, 0, 1, i)
        assert tuple(got.shape) == (3, 64, 64)
        assert torch.equal(got, seeded_transform(reference, resized, 0, 1, i)), i
        outputs.append(got)
    assert len({o.sum().item() for o in outputs}) > 4  # crops differ


def test_an_src_run_trains_on_files_at_their_own_sizes_and_evaluates_by_center_crop(tmp_path):
    from vitlab.training import train

    _tinted_photos(tmp_path / "data", train=4, test=2)
    summary = train(load_config(None, tiny_overrides(tmp_path / "data", tmp_path / "run", "data.train_crop=src",
                                                     "data.in_memory=false", "data.loader=torch", "train.epochs=1",
                                                     "train.batch_size=4")))
    reset_accelerate()
    assert summary["epochs_done"] == 1
    card = json.loads((tmp_path / "run/checkpoints/last/config.json").read_text())
    assert card["crop_pct"] == 0.875  # evaluated as the ImageNet-style runs are


@pytest.mark.parametrize("spec,why", [("rand-zz9", "Unknown RandAugment config section"), ("rand-m9x", "'9x'"),
                                      ("foo", "not a timm spec")])
def test_a_timm_spec_timm_cannot_read_is_one_line_when_the_config_is_read(spec, why):
    with pytest.raises(ConfigError, match=rf"^data.augment='{spec}' is invalid; expected one of none, .*{why}"):
        load_config(None, [f"data.augment={spec}"])
