"""An exported file's unknown score, rated as ``vitlab eval --unknown-images`` rates the model's: onnxruntime runs a
``vitlab export --with-preprocess`` file on uint8 images (a folder of class folders of known images, one of unknown
images), and prints the AUROC of its ``unknown_score`` output, and at the threshold of its metadata the known images
kept and the unknown ones rejected (issue 74).

    vitlab export --checkpoint /tmp/osr/run0 --output /tmp/exp/run0_vim.onnx --with-preprocess
    python benchmarks/unknown_exported.py /tmp/exp/run0_vim.onnx /tmp/osr/split0/test /tmp/osr/unknown0
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from vitlab.data import read_image
from vitlab.inference.open_set import auroc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="an ONNX file of vitlab export --with-preprocess, calibrated for unknown images")
    parser.add_argument("known", help="a folder of class folders of images of the model's classes")
    parser.add_argument("unknown", help="a folder of folders of images of none of them")
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()
    import onnxruntime

    session = onnxruntime.InferenceSession(args.file, providers=["CPUExecutionProvider"])
    rule = json.loads(session.get_modelmeta().custom_metadata_map["vitlab.unknown"])

    def scores(root: str) -> torch.Tensor:
        files = sorted(Path(root).glob("*/*.png"))
        out = [session.run(["unknown_score"], {"images": np.stack([read_image(f).permute(1, 2, 0).numpy()
                                                                    for f in files[i:i + args.batch]])})[0]
               for i in range(0, len(files), args.batch)]
        return torch.from_numpy(np.concatenate(out))

    start = time.perf_counter()
    known, unknown = scores(args.known), scores(args.unknown)
    print(f"{rule}: {len(known)} known, {len(unknown)} unknown images; AUROC {100 * auroc(known, unknown):.2f}; "
          f"known kept {100 * (known >= rule['threshold']).double().mean():.2f}%, unknown rejected "
          f"{100 * (unknown < rule['threshold']).double().mean():.2f}% ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
