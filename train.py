"""Train a ViT on CIFAR-10: ``python train.py --config configs/vit_cifar10.yaml [key.sub=value ...]``.

Foundation stage: builds the model from the config and runs one batch forward and backward.
"""
from __future__ import annotations

import argparse

import torch
import yaml

import vitlab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    model_cfg = dict(cfg["model"])
    model = vitlab.create_model(model_cfg.pop("name"), **model_cfg)
    x = torch.randn(8, 3, *model.patch_embed.img_size)
    loss = model(x).logsumexp(-1).mean()
    loss.backward()
    n = sum(p.numel() for p in model.parameters())
    print(f"built {cfg['model']['name']} ({n / 1e6:.2f}M params); one batch: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
