"""Images of none of CIFAR-10's classes that exist offline, for ``vitlab eval --unknown-images`` (issue 74, "far
from the data"): four folders of ``--count`` 32-px PNGs each,

- ``noise``: uniform random pixels;
- ``flat``: one random colour an image;
- ``digits``: scikit-learn's 8 x 8 handwritten digits (1,797, cycled), enlarged (bicubic) and shown light on dark;
- ``photos``: random cuts (30-100% of the side) of photographs with no CIFAR-10 class in them: scikit-image's
  coffee cup, retina, Hubble deep field, immunohistochemistry micrograph and astronaut (a person), and
  matplotlib's Grace Hopper, resized (bicubic, antialiased) to 32 px.

    pip install scikit-image
    python benchmarks/make_unknown_images.py --out /tmp/unknown --count 250
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def photographs() -> list[np.ndarray]:
    import matplotlib.cbook
    import skimage.data as data

    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
        hopper = np.asarray(Image.open(f).convert("RGB"))
    return [data.coffee(), data.retina(), data.hubble_deep_field(), data.immunohistochemistry(), data.astronaut(),
            hopper]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--count", type=int, default=250, help="images a folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    from sklearn.datasets import load_digits

    digits = load_digits().images  # (1797, 8, 8), 0-16
    photos = photographs()
    for group in ("noise", "flat", "digits", "photos"):
        (args.out / group).mkdir(parents=True, exist_ok=True)
    for i in range(args.count):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(args.out / "noise" / f"{i:04d}.png")
        flat = np.full((32, 32, 3), rng.integers(0, 256, 3), np.uint8)
        Image.fromarray(flat).save(args.out / "flat" / f"{i:04d}.png")
        digit = Image.fromarray((digits[i % len(digits)] * 255 / 16).astype(np.uint8)).resize((32, 32), Image.BICUBIC)
        digit.convert("RGB").save(args.out / "digits" / f"{i:04d}.png")
        photo = photos[i % len(photos)]
        side = int(min(photo.shape[:2]) * rng.uniform(0.3, 1.0))
        top, left = rng.integers(0, photo.shape[0] - side + 1), rng.integers(0, photo.shape[1] - side + 1)
        cut = Image.fromarray(photo[top:top + side, left:left + side])
        cut.resize((32, 32), Image.BICUBIC, reducing_gap=None).save(args.out / "photos" / f"{i:04d}.png")
    print(f"{4 * args.count} images in {args.out}/{{noise,flat,digits,photos}}")


if __name__ == "__main__":
    main()
