"""What each ``vitlab`` command does, its arguments parsed (:mod:`vitlab.cli`): ``eval``, ``calibrate``,
``predict``, ``embed``, ``inspect``, ``serve``, ``attention``, ``translate``, ``sample``, ``export``, ``models``,
``shards``. Thin: each calls the library."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import ConfigError

__all__ = ["COMMANDS"]


def _end_processes() -> None:
    """Under torchrun, wait until every process is done (process 0 writes the files) and close the process
    group before the command returns: a process that left with the group open could abort in gloo's teardown
    while another still wrote ("terminate called without an active exception", about 1 run in 10 of a
    2-process vitlab eval)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _eval(args: argparse.Namespace) -> None:
    if args.unknown_images:
        from .unknown import evaluate_unknown

        evaluate_unknown(args.checkpoint, args.unknown_images, args.split, tuple(args.overrides),
                         use_ema=not args.no_ema, batch_size=args.batch_size, k=args.unknown_k, output=args.output)
        return _end_processes()
    from .evaluation import evaluate_checkpoint

    evaluate_checkpoint(args.checkpoint, args.split, tuple(args.overrides), use_ema=not args.no_ema,
                        batch_size=args.batch_size, output=args.output, record=args.record,
                        predictions=args.predictions, adjust_logits=args.adjust_logits, tta=args.tta, knn=args.knn)
    _end_processes()


def _calibrate(args: argparse.Namespace) -> None:
    if args.unknown:
        from .unknown import calibrate_unknown

        calibrate_unknown(args.checkpoint, args.unknown, args.keep, tuple(args.overrides), use_ema=not args.no_ema,
                          batch_size=args.batch_size, k=args.unknown_k)
        return _end_processes()
    from .evaluation import calibrate_checkpoint

    calibrate_checkpoint(args.checkpoint, "val", tuple(args.overrides), use_ema=not args.no_ema,
                         batch_size=args.batch_size, objective=args.objective)
    _end_processes()


def _translate(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .errors import CheckpointError
    from .data.text import load_tokenizer
    from .models import RNNSeq2Seq, Seq2SeqTransformer
    from .tasks.seq2seq import translate

    model = load_model(args.checkpoint)
    if not isinstance(model, (Seq2SeqTransformer, RNNSeq2Seq)) or model.pretrained_cfg.get("tokenizer") is None:
        raise CheckpointError(f"{args.checkpoint!r} is not a translation model with a tokenizer; `vitlab translate` "
                              f"needs a run trained with data.dataset=parallel")
    tokenizer = load_tokenizer(model.pretrained_cfg["tokenizer"])
    if args.attention:
        _alignment_figure(model, tokenizer, args)
    for line in translate(model, tokenizer, args.sentences, beam_size=args.beam_size):
        print(line)


def _alignment_figure(model: object, tokenizer: object, args: argparse.Namespace) -> None:
    """``translate --attention``: the sentence's cross-attention, drawn before anything is printed."""
    from .tasks.seq2seq import alignment
    from .visualize import plot_alignment, save_figure

    layers = len(model.transformer.decoder_layers) if hasattr(model, "transformer") else 1
    if not -layers <= args.layer < layers:
        raise ConfigError(f"--layer {args.layer} is out of range: the decoder has {layers} attention layer(s) "
                          f"(0..{layers - 1}, or -1 for the last)")
    if len(args.sentences) != 1:
        raise ConfigError(f"--attention draws one sentence's alignment; got {len(args.sentences)} sentences")
    weights, source, target = alignment(model, tokenizer, args.sentences[0], args.beam_size, args.layer)
    what = (f"decoder layer {args.layer % layers}, mean over its heads" if hasattr(model, "transformer")
            else f"{model.config['score']} attention")
    print(f"wrote {save_figure(plot_alignment(weights, source, target, what), args.attention)}", file=sys.stderr)


def _sample(args: argparse.Namespace) -> None:
    import torch

    from .checkpoint import load_model
    from .data.corpus import load_lm_tokenizer
    from .errors import CheckpointError

    model = load_model(args.checkpoint)
    if model.pretrained_cfg.get("task") != "lm" or model.pretrained_cfg.get("tokenizer") is None:
        raise CheckpointError(f"{args.checkpoint!r} is not a language model; `vitlab sample` needs a run trained with "
                              f"task: lm")
    tokenizer = load_lm_tokenizer(model.pretrained_cfg["tokenizer"])
    prompt = tokenizer.encode_text(args.prompt) if args.prompt else [0]
    if args.attention:
        _attention_pattern(model, tokenizer, prompt, args)
    generator = torch.Generator().manual_seed(args.seed)
    out = model.generate(torch.tensor([prompt]), args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, generator=generator)
    print(tokenizer.decode_ids(out[0, 0 if args.prompt else 1:].tolist()))


def _attention_pattern(model: object, tokenizer: object, prompt: list[int], args: argparse.Namespace) -> None:
    """``sample --attention``: the causal attention over the prompt of one block (mean over its heads)."""
    import torch

    from .visualize import plot_alignment, save_figure

    blocks = len(model.blocks)
    if not -blocks <= args.layer < blocks:
        raise ConfigError(f"--layer {args.layer} is out of range: the model has {blocks} blocks (0..{blocks - 1}, "
                          f"or -1 for the last)")
    if not args.prompt or len(prompt) > model.block_size:
        raise ConfigError(f"--attention draws the attention over the prompt: give --prompt with 1 to "
                          f"{model.block_size} tokens")
    weights = model.get_attention_maps(torch.tensor([prompt]))[args.layer][0].mean(0)
    tokens = [tokenizer.decode_ids([i]).replace(" ", "\u2423").replace("\n", "\\n") for i in prompt]  # ␣ for a space
    fig = plot_alignment(weights, tokens, tokens, f"block {args.layer % blocks}, mean over its heads (rows: queries)")
    print(f"wrote {save_figure(fig, args.attention)}", file=sys.stderr)


def _inputs(given: list[str]) -> tuple[list[str], list[str]]:
    """predict's and embed's inputs: image files, folders and globs, and ``data.*=`` keys (a data set)."""
    keys = [g for g in given if g.startswith("data.") and "=" in g]
    return [g for g in given if g not in keys], keys


def _predict(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .prediction import predict_images

    images, data = _inputs(args.images)
    predict_images(load_model(args.checkpoint), images, args.output, args.batch_size, args.num_workers, args.topk,
                   tta=args.tta, data=data, split=args.split, precision=args.precision,
                   max_pixels=args.max_image_pixels, unknown=args.unknown, unknown_label=args.unknown_label)
    _end_processes()


def _embed(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .prediction import embed_images

    images, data = _inputs(args.images)
    embed_images(load_model(args.checkpoint), images, args.output, args.batch_size, args.num_workers, data=data,
                 split=args.split, precision=args.precision, max_pixels=args.max_image_pixels)
    _end_processes()


def _inspect(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .inspection import inspect_data
    from .inspection.duplicates import DUPLICATE_THRESHOLD

    threshold = DUPLICATE_THRESHOLD if args.duplicate_threshold is None else args.duplicate_threshold
    inspect_data(load_model(args.checkpoint), args.data, args.output, splits=[s for s in args.splits.split(",") if s],
                 knn=args.knn, folds=args.folds, seed=args.seed, duplicate_threshold=threshold,
                 write_clean_to=args.write_clean, other_classes=args.other_classes, batch_size=args.batch_size,
                 num_workers=args.num_workers, precision=args.precision, grid=args.grid)


def _serve(args: argparse.Namespace) -> None:
    from .serving import serve

    serve(args.checkpoint, args.host, args.port, max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms,
          max_upload_mb=args.max_upload_mb, max_image_pixels=args.max_image_pixels, api_key_env=args.api_key_env,
          cors_origins=tuple(args.cors_origin),
          device=args.device, precision=args.precision, unknown=args.unknown, unknown_label=args.unknown_label)


def _attention(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .data.decode import open_image
    from .data.transforms import decode_size, decode_upright
    from .errors import CheckpointError
    from .models import VisionTransformer
    from .visualize import plot_attention, plot_attention_grid, save_figure

    model = load_model(args.checkpoint)
    if not isinstance(model, VisionTransformer):
        raise CheckpointError(f"{args.checkpoint!r} holds a {type(model).__name__}, not a ViT; `vitlab "
                              f"attention` draws a ViT's attention over images (translations: `vitlab translate "
                              f"--attention`)")
    blocks, heads = len(model.blocks), model.blocks[0].attn.num_heads
    if not -blocks <= args.block < blocks:
        raise ConfigError(f"--block {args.block} is out of range: the model has {blocks} blocks (0..{blocks - 1}, "
                          f"or -1 for the last)")
    head: int | str = args.head if args.head == "mean" else _int_or_fail(args.head, "--head", "a head index or mean")
    if head != "mean" and not -heads <= head < heads:
        raise ConfigError(f"--head {head} is out of range: each block has {heads} heads (0..{heads - 1}, or mean)")
    if not 0 <= args.discard_ratio < 1:
        raise ConfigError(f"--discard-ratio {args.discard_ratio} must be in [0, 1): the share of each row's weights "
                          f"to zero")
    if args.columns < 0:
        raise ConfigError(f"--columns {args.columns} must be >= 0 (0: one row an image)")
    if args.grid and len(args.images) != 1:
        raise ConfigError(f"--grid draws every block x head of one image; got {len(args.images)} images")
    # All read before anything is written, decoded as training decoded its files.
    images = [open_image(path, decode_size(model), decode_upright(model)) for path in args.images]
    if args.grid:
        fig = plot_attention_grid(model, images[0])
    else:
        # The true class, where a file lies in a folder named after one of the model's classes (ImageFolder).
        classes = set(model.pretrained_cfg.get("label_names") or [])
        truth = [Path(p).parent.name if Path(p).parent.name in classes else None for p in args.images]
        fig = plot_attention(model, images, titles=[Path(p).name for p in args.images], method=args.method,
                             block=args.block, head=head, head_fusion=args.head_fusion,
                             discard_ratio=args.discard_ratio, true_labels=truth, columns=args.columns)
    print(f"wrote {save_figure(fig, args.output)}")


def _export(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .export import export_model

    result = export_model(load_model(args.checkpoint), args.output, args.format, check=not args.no_check,
                          with_preprocess=args.with_preprocess, quantize=args.quantize)
    checked = (f"; on a batch of another size it differs from the eager model by at most {result['max_abs_diff']:.2e}"
               if "max_abs_diff" in result else "")
    what = (", uint8 (batch, H, W, 3) -> probabilities" if args.with_preprocess else "") + \
        (", int8 weights" if args.quantize else "")
    print(f"wrote {result['output']} ({args.format}{what}; inputs {', '.join(result['inputs'])}, outputs "
          f"{', '.join(result['outputs'])}, dynamic batch){checked}")
    if "unknown" in result:
        print(result["unknown"])


def _int_or_fail(value: str, flag: str, expected: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not {expected}") from None


def _models(args: argparse.Namespace) -> None:
    from .models import create_model, list_models

    for name in list_models(args.pattern):
        if name.startswith("gpt_"):
            model = create_model(name, vocab_size=65)
            detail = f"context {model.block_size}, width {model.embed_dim}, {len(model.blocks)} layers (65 characters)"
        elif name.startswith("rnn_"):
            model = create_model(name, src_vocab_size=8000, tgt_vocab_size=8000, share_embeddings=True)
            detail = f"GRU {model.config['hidden_dim']}, {model.config['score']} attention (with a shared 8k vocabulary)"
        elif name.startswith("transformer_"):
            model = create_model(name, src_vocab_size=8000, tgt_vocab_size=8000, share_embeddings=True)
            detail = f"d_model {model.d_model}, {len(model.transformer.encoder_layers)}+" \
                     f"{len(model.transformer.decoder_layers)} layers (with a shared 8k vocabulary)"
        else:
            model = create_model(name)
            detail = f"img {model.patch_embed.img_size[0]:3d}  tokens {model.pos_embed.shape[1]:3d}"
        params = sum(p.numel() for p in model.parameters())
        print(f"{name:28s} {params / 1e6:8.2f}M params  {detail}")


def _shards(args: argparse.Namespace) -> None:
    from .data.convert import convert_to_shards

    if args.max_size is not None and args.max_size < 1:
        raise ConfigError(f"--max-size {args.max_size}: give the longest side to write, in px (>= 1), or leave it out "
                          f"to keep every image as stored")
    written = convert_to_shards(args.src, args.out, [s for s in args.split.split(",") if s], args.shard_size,
                                seed=args.seed, image_key=args.image_key, label_key=args.label_key,
                                max_size=args.max_size or 0, quality=args.quality)
    for split, paths in written.items():
        print(f"{split}: {len(paths)} shard(s), {paths[0].name} .. {paths[-1].name}")
    print(f"wrote {args.out}/classes.txt; train on it: data.dataset=wds data.root={args.out}")


# The command of each name (``vitlab <name>``; ``train`` is :func:`vitlab.cli.train_main`).
def _tune(args: argparse.Namespace) -> None:
    from .tuning import tune

    tune(args.config, args.space, args.trials, study=args.study, storage=args.storage, pruner=args.pruner,
         metric=args.metric, timeout_minutes=args.timeout, overrides=args.overrides, seed=args.seed,
         base_first=args.base_first, devices=args.devices, _worker=args.worker)


COMMANDS = {"eval": _eval, "calibrate": _calibrate, "predict": _predict, "embed": _embed, "inspect": _inspect,
            "serve": _serve, "attention": _attention, "translate": _translate, "sample": _sample, "export": _export,
            "models": _models, "shards": _shards, "tune": _tune}
