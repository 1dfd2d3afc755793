"""Decoding a photo only as large as its crop needs (issue 37, 1): libjpeg-turbo's DCT scaling, then the
box cut from the smaller image. Checked against the full decode and the same crop (torchvision's random
resized crop on the whole image, the same draws): PSNR >= 40 dB on a real photograph, upright for each of
the 8 EXIF orientations, and a run of such photos trains and evaluates on the same pixels it would have
had, to the rounding."""
from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2

from vitlab.data.decode import EncodedImage, decode_image, decode_region
from vitlab.data.transforms import RandomResizedCropDecode, center_crop_transform

simplejpeg = pytest.importorskip("simplejpeg")
RESIZE = dict(interpolation=v2.InterpolationMode.BICUBIC, antialias=True)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a.double() - b.double()) ** 2).mean().item()
    return 10 * math.log10(255 ** 2 / mse) if mse else math.inf


@pytest.fixture(scope="module")
def photo() -> bytes:
    """A real photograph (matplotlib's Grace Hopper, 512 x 600) at phone-camera size: 4x larger, with
    sensor-like noise, a quality-90 JPEG (4:2:0)."""
    img = Image.open(Path(matplotlib.get_data_path()) / "sample_data/grace_hopper.jpg").convert("RGB")
    img = img.resize((img.width * 4, img.height * 4), Image.BICUBIC)
    noisy = np.asarray(img).astype(np.float32) + np.random.default_rng(0).normal(0, 3, (img.height, img.width, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def test_random_resized_crops_decoded_at_scale_equal_the_full_decode_to_40_db(photo):
    full = decode_image(photo, "photo")
    crop = RandomResizedCropDecode((224, 224), scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), **RESIZE)
    reference = v2.RandomResizedCrop((224, 224), scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), **RESIZE)
    values = []
    for seed in range(30):
        torch.manual_seed(seed)
        want = reference(full)
        torch.manual_seed(seed)
        got = crop(EncodedImage(photo, "photo"))
        values.append(psnr(got, want))
        torch.manual_seed(seed)
        assert torch.equal(crop(full), want)  # a decoded image: torchvision's crop, the same draws
    assert min(values) >= 40, values
    assert np.median(values) >= 45, values


@pytest.mark.parametrize("orientation", range(1, 9))
def test_each_exif_orientation_is_cut_upright(photo, orientation):
    img = Image.open(io.BytesIO(photo)).resize((900, 620))  # stored landscape
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    img.save(out, "JPEG", quality=95, exif=exif.tobytes())
    data = out.getvalue()
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    box = (60.5, 100.25, 400.0, 300.0)  # top, left, height, width of the upright image
    sizes = []

    def region(height, width):
        sizes.append((height, width))
        return box

    got = decode_region(data, "tagged", region, (100, 75))
    assert sizes == [(upright.height, upright.width)]
    top, left, h, w = box
    want = torch.from_numpy(np.array(upright.resize((75, 100), Image.BICUBIC, box=(left, top, left + w, top + h)))
                            ).permute(2, 0, 1)
    assert got.shape == (3, 100, 75) and psnr(got, want) >= 40


def test_other_images_are_decoded_whole_and_cut_the_same_way(photo):
    img = Image.open(io.BytesIO(photo)).resize((300, 200))
    out = io.BytesIO()
    img.save(out, "PNG")
    got = decode_region(out.getvalue(), "png", lambda h, w: (10, 20, 150, 100), (64, 48))
    want = np.asarray(img.convert("RGB").resize((48, 64), Image.BICUBIC, box=(20, 10, 120, 160)))
    assert torch.equal(got, torch.from_numpy(want.copy()).permute(2, 0, 1))


def test_evaluation_center_crops_decoded_at_scale_equal_timms_to_40_db(photo):
    from timm.data import create_transform

    timm_eval = create_transform(224, is_training=False, crop_pct=0.875, interpolation="bicubic", mean=(0, 0, 0),
                                 std=(1, 1, 1))
    want = (timm_eval(Image.open(io.BytesIO(photo)).convert("RGB")) * 255).round().to(torch.uint8)
    ours = center_crop_transform((224, 224), 0.875)
    assert psnr(ours(EncodedImage(photo, "photo")), want) >= 40
    assert torch.equal(ours(decode_image(photo, "photo")), want)  # decoded whole: timm's pixels


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_a_streamed_run_of_photos_sees_the_full_decodes_pixels_to_40_db(photo, tmp_path, on_cpu, source):
    from accelerate import Accelerator

    from vitlab.config import load_config
    from vitlab.tasks.classification import image_classification_task

    big = Image.open(io.BytesIO(photo)).resize((1200, 1600))  # portrait, 2 MP
    for c in range(2):
        for split, n in (("train", 4), ("test", 2)):
            folder = tmp_path / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                big.rotate(90 * c + 10 * i, expand=False).save(folder / f"{i}.jpg", quality=90)
    data = ["data.dataset=imagefolder", f"data.root={tmp_path}"]
    if source == "shards":
        pytest.importorskip("webdataset")
        from vitlab.cli import main

        main(["shards", str(tmp_path), str(tmp_path / "shards"), "--shard-size", "4"])
        data = ["data.dataset=wds", f"data.root={tmp_path / 'shards'}"]
    batches = {}
    for scaled in ("true", "false"):
        cfg = load_config(None, ["model.name=vit_cifar_tiny_patch4_32", "model.img_size=224", "model.patch_size=16",
                                 "model.depth=1", *data,
                                 "data.train_crop=rrc", "data.in_memory=false", "data.num_workers=0",
                                 f"data.scaled_decode={scaled}", "train.batch_size=4", "train.output_dir=unused"])
        task = image_classification_task(cfg, Accelerator(cpu=True), 4, tmp_path / "run")
        loader = task.train_loader
        (loader if source == "shards" else loader.dataset).set_epoch(1)
        torch.manual_seed(0)
        train = next(iter(task.train_loader))[0]
        test = next(iter(task.eval_loaders["test"]))[0]
        batches[scaled] = train, test
    for on, off in zip(batches["true"], batches["false"]):
        assert on.shape == off.shape and psnr(on, off) >= 40 and not torch.equal(on, off)


@pytest.mark.parametrize("kind, size, draws", [("JPEG", (480, 360), 10), ("PNG", (640, 480), 5)])
def test_crops_that_do_not_scale_are_torchvisions_pixels(photo, kind, size, draws):
    """An ImageNet-sized JPEG (its crops too small to scale) and a PNG (nothing to scale): the random
    resized crop of the file equals torchvision's on its full decode, draw for draw."""
    encoded = io.BytesIO()
    Image.open(io.BytesIO(photo)).resize(size).save(encoded, kind, **({"quality": 90} if kind == "JPEG" else {}))
    full = decode_image(encoded.getvalue(), kind)
    crop = RandomResizedCropDecode((224, 224), **RESIZE)
    reference = v2.RandomResizedCrop((224, 224), **RESIZE)
    for seed in range(draws):
        torch.manual_seed(seed)
        want = reference(full)
        torch.manual_seed(seed)
        assert torch.equal(crop(EncodedImage(encoded.getvalue(), kind)), want)
