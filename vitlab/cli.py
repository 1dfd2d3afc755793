"""The ``vitlab`` command."""
from __future__ import annotations

import argparse

from .registry import create_model, list_models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vitlab", description="Vision Transformers on one attention core.")
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="list the model presets with their sizes")
    models.add_argument("pattern", nargs="?", default="*")
    args = parser.parse_args(argv)
    if args.command == "models":
        for name in list_models(args.pattern):
            model = create_model(name)
            params = sum(p.numel() for p in model.parameters())
            print(f"{name:28s} {params / 1e6:8.2f}M params  img {model.patch_embed.img_size[0]:3d}  "
                  f"tokens {model.pos_embed.shape[1]:3d}")


if __name__ == "__main__":
    main()
