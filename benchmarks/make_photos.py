"""A folder of ImageNet-sized JPEGs cut from real photographs, for ``bench_data.py --root`` and a
streamed training run of natural images at ImageNet sizes.

The photographs: the nine colour photographs scikit-image ships (astronaut, chelsea the cat, coffee,
the Hubble deep field, an IHC micrograph, a motorcycle, a retina, a rocket) and matplotlib's Grace
Hopper. Each image is a random cut of one of them (an area of 30-100%, an aspect ratio in [3/4, 4/3],
flipped half the time), resized (bicubic) to a shorter side drawn from 300-500 px, and saved as a
JPEG of quality 90 (4:2:0 chroma, as cameras and ImageNet's files): ``OUT/{train,test}/<photo>/*.jpg``.
A class is the photograph an image was cut from; test images are new cuts of the same photographs, so
accuracy on them measures the pipeline, not generalisation.

    pip install scikit-image
    python benchmarks/make_photos.py --out /tmp/photos --train 150 --test 40

With ``--upscale DIR`` (an ImageFolder: CIFAR-10's real photographs), each of the first ``--train`` /
``--test`` images of a class is instead resized (bicubic) to a shorter side of 300-500 px and an aspect
ratio in [3/4, 4/3] and saved the same way: a labelled set of real photographs with ImageNet's file sizes
and shapes, whose detail is CIFAR-10's (32 px).

    python benchmarks/make_photos.py --upscale ../shared/data/cifar10 --out /tmp/cifar_big --train 500 --test 100

With ``--phone``, phone-camera photos instead: each cut resized (bicubic) to 12 megapixels, 4032 x 3024,
with sensor-like noise (normal, sigma 3 levels, so that the files carry a camera's detail: about 1.6 MB
each at quality 90, where a smooth upscale, ``--noise 0``, compresses to a fraction), and every third one
a portrait shot as phones store it: the pixels landscape, an EXIF orientation tag 6 turning them upright.

    python benchmarks/make_photos.py --phone --out /tmp/phone --train 22 --test 0   # 198 photos
"""
from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

from PIL import Image

PHOTOS = {"astronaut": "astronaut.png", "chelsea": "chelsea.png", "coffee": "coffee.png",
          "hubble": "hubble_deep_field.jpg", "ihc": "ihc.png", "motorcycle": "motorcycle_left.png",
          "retina": "retina.jpg", "rocket": "rocket.jpg"}


def sources() -> dict[str, Image.Image]:
    import matplotlib
    import skimage

    folder = Path(skimage.__file__).parent / "data"
    photos = {name: Image.open(folder / file).convert("RGB") for name, file in PHOTOS.items()}
    photos["grace_hopper"] = Image.open(Path(matplotlib.get_data_path()) / "sample_data/grace_hopper.jpg").convert("RGB")
    return photos


def cut(photo: Image.Image, rng: random.Random) -> Image.Image:
    w, h = photo.size
    for _ in range(100):
        area = rng.uniform(0.3, 1.0) * w * h
        ratio = rng.uniform(3 / 4, 4 / 3)
        cw, ch = round((area * ratio) ** 0.5), round((area / ratio) ** 0.5)
        if cw <= w and ch <= h:
            break
    else:
        cw, ch = min(w, h), min(w, h)
    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
    shorter = rng.randint(300, 500)
    scale = shorter / min(cw, ch)
    img = photo.resize((round(cw * scale), round(ch * scale)), Image.BICUBIC, box=(x, y, x + cw, y + ch))
    return img.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else img


def phone(photo: Image.Image, rng: random.Random, index: int, noise: float = 3.0) -> tuple[Image.Image, bytes]:
    """A 12-megapixel phone photo of a cut of ``photo`` (with normal noise of ``noise`` levels), and the EXIF
    it is saved with (orientation 6, a portrait, for every third)."""
    import numpy as np

    img = cut(photo, rng).resize((4032, 3024), Image.BICUBIC)
    if noise:
        grain = np.random.default_rng(rng.randrange(2 ** 32)).normal(0, noise, (3024, 4032, 3))
        img = Image.fromarray(np.clip(np.asarray(img) + grain, 0, 255).astype(np.uint8))
    exif = Image.Exif()
    if index % 3 == 2:
        exif[0x0112] = 6  # shot in portrait: stored landscape, turned upright by the viewer
    return img, exif.tobytes()


def upscaled(folder: Path, split: str, count: int) -> dict[str, list[Image.Image]]:
    return {c.name: [Image.open(f).convert("RGB") for f in sorted(c.iterdir())[:count]]
            for c in sorted((folder / split).iterdir()) if c.is_dir()}


def resize_to(photo: Image.Image, rng: random.Random) -> Image.Image:
    shorter, ratio = rng.randint(300, 500), rng.uniform(3 / 4, 4 / 3)
    size = (round(shorter * ratio), shorter) if ratio >= 1 else (shorter, round(shorter / ratio))
    return photo.resize(size, Image.BICUBIC)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=150, help="images a photograph in train/")
    parser.add_argument("--test", type=int, default=40, help="images a photograph in test/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--upscale", help="an ImageFolder whose images are upscaled instead (see above)")
    parser.add_argument("--phone", action="store_true", help="12-megapixel phone photos (see above)")
    parser.add_argument("--noise", type=float, default=3.0, help="--phone: the sensor-like noise, in levels "
                                                                  "(0: smooth upscales, light files)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    total = 0
    if args.upscale:
        for split, count in (("train", args.train), ("test", args.test)):
            for name, photos in upscaled(Path(args.upscale), split, count).items():
                folder = Path(args.out) / split / name
                folder.mkdir(parents=True, exist_ok=True)
                for i, photo in enumerate(photos):
                    resize_to(photo, rng).save(folder / f"{i:05d}.jpg", quality=90)
                    total += 1
    for name, photo in ({} if args.upscale else sources()).items():
        for split, count in (("train", args.train), ("test", args.test)):
            folder = Path(args.out) / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                if args.phone:
                    img, exif = phone(photo, rng, i, args.noise)
                    img.save(folder / f"{i:05d}.jpg", quality=90, exif=exif)
                else:
                    cut(photo, rng).save(folder / f"{i:05d}.jpg", quality=90)
                total += 1
    size = sum(f.stat().st_size for f in Path(args.out).rglob("*.jpg"))
    print(f"wrote {total} JPEGs, {size / total / 1024:.0f} KiB each on average, into {args.out}"
          f" ({os.cpu_count()} cores here)")


if __name__ == "__main__":
    main()
