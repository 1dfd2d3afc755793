"""The ``vitlab`` command: ``train``, ``eval``, ``predict``, ``attention``, ``translate``, ``sample``, ``export``,
``models``. Thin: each parses its arguments and calls the library; user errors print one line and exit
non-zero."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from .errors import ConfigError, VitlabError

__all__ = ["main", "train_main", "run_command"]


def run_command(fn: Callable[[], None]) -> None:
    """Run ``fn``; print a user error as one line and exit 2 (config) or 1 (other), no traceback.

    Output is line-buffered, so progress and epoch lines reach a file or a pipe (``nohup``, ``tee``,
    a cluster job log) as they are printed."""
    sys.stdout.reconfigure(line_buffering=True)
    try:
        fn()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except VitlabError as e:
        print(f"error: {_own_message(e)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def _own_message(error: Exception) -> str:
    """An error's own one line. One raised in a DataLoader worker (a corrupt image met while streaming)
    comes back re-raised with the worker's traceback in its message; its last line is the original."""
    message = str(error)
    if "Original Traceback" in message:
        last = message.strip().splitlines()[-1]
        message = last.split(": ", 1)[1] if last.startswith(type(error).__module__) else last
    return message


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
    from .evaluation import evaluate_checkpoint

    evaluate_checkpoint(args.checkpoint, args.split, tuple(args.overrides), use_ema=not args.no_ema,
                        batch_size=args.batch_size, output=args.output, record=args.record,
                        predictions=args.predictions, adjust_logits=args.adjust_logits, tta=args.tta, knn=args.knn)
    _end_processes()


def _calibrate(args: argparse.Namespace) -> None:
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
                   tta=args.tta, data=data, split=args.split, precision=args.precision)
    _end_processes()


def _embed(args: argparse.Namespace) -> None:
    from .checkpoint import load_model
    from .prediction import embed_images

    images, data = _inputs(args.images)
    embed_images(load_model(args.checkpoint), images, args.output, args.batch_size, args.num_workers, data=data,
                 split=args.split, precision=args.precision)
    _end_processes()


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

    result = export_model(load_model(args.checkpoint), args.output, args.format, check=not args.no_check)
    checked = (f"; on a batch of another size it differs from the eager model by at most {result['max_abs_diff']:.2e}"
               if "max_abs_diff" in result else "")
    print(f"wrote {result['output']} ({args.format}; inputs {', '.join(result['inputs'])}, dynamic batch){checked}")


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


def train_main(argv: list[str] | None = None) -> None:
    """``train.py`` / ``vitlab train``: ``--config FILE [--resume RUN_DIR] [key.sub=value ...]``."""
    parser = argparse.ArgumentParser(prog="train.py", description="Train a ViT on images or a text Transformer (task: seq2seq) with Accelerate.")
    parser.add_argument("--config", help="YAML config (optional with --resume: the run's own config is used)")
    parser.add_argument("--resume", metavar="RUN_DIR|auto",
                        help="continue the run in RUN_DIR from its last checkpoint (its config, changed by any "
                             "key=value); auto: continue train.output_dir's run if it has the same config, else start "
                             "(train.resume=auto, the default)")
    parser.add_argument("--json", action="store_true", help="print the run's summary (also in RUN_DIR/summary.json) "
                                                            "as one JSON line at the end")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="e.g. train.epochs=5 optim.lr=1e-3")
    args = parser.parse_args(argv)

    def run() -> None:
        from accelerate import PartialState

        from .config import load_config
        from .training import interrupted_message, resolve_resume, summary_of, train

        if args.resume == "auto":
            args.resume, args.overrides = None, [*args.overrides, "train.resume=auto"]
            if args.config is None:
                raise ConfigError("--resume auto continues train.output_dir of a config: pass --config as well")
        if args.config is None and args.resume is None:
            raise ConfigError("pass --config configs/<name>.yaml (or --resume <run dir>)")
        if args.resume is not None and not Path(args.resume).is_dir():
            raise ConfigError(f"--resume {args.resume}: no such run or checkpoint directory")
        recorded = args.resume is not None and args.config is None
        if recorded:
            _, checkpoint = resolve_resume(args.resume)  # the config the checkpoint was trained with
            args.config = str(checkpoint / "run_config.yaml")
        cfg = load_config(args.config, args.overrides, recorded=recorded)
        try:
            summary = train(cfg, resume=args.resume)
        except KeyboardInterrupt:
            if PartialState().is_main_process:
                print(interrupted_message(cfg.train.output_dir), file=sys.stderr)
            sys.exit(130)
        if args.json and PartialState().is_main_process:
            from .models.hub import strict_json

            print(json.dumps(strict_json(summary_of(summary)), allow_nan=False))

    run_command(run)


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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # same arguments as train.py
        return train_main(argv[1:])
    parser = argparse.ArgumentParser(prog="vitlab", description="Vision Transformers on one attention core.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train (same arguments as train.py: --config FILE [--resume DIR] [key=value ...])")
    ev = sub.add_parser("eval", help="evaluate a checkpoint: top-1/top-5, loss, per-class accuracy, confusion matrix "
                                     "(ViT); exact match or sacreBLEU (text)")
    ev.add_argument("--checkpoint", required=True, help="run directory (its best checkpoint) or checkpoint directory")
    ev.add_argument("--output", help="write the metrics as JSON here (keys top1, top5, loss, per_class; "
                                     "exact_match / bleu for a text model; loss, perplexity (, bpc) for a language "
                                     "model)")
    ev.add_argument("--split", choices=("test", "val", "train"), default="test",
                    help="test; val: the validation examples the run held out (same seed and indices); train: "
                         "the examples it trained on (a language model has only train and val: test means val)")
    ev.add_argument("--batch-size", type=int, default=256)
    ev.add_argument("--predictions", help="an image classifier's: write every image's name, class, predicted class and "
                                          "class probabilities to this .csv file, in the split's order")
    ev.add_argument("--adjust-logits", type=float, metavar="TAU",
                    help="an image classifier's: subtract TAU x log(its training class frequencies) from its logits "
                         "(post-hoc logit adjustment, Menon et al. 2021; 1 = the balanced error's rule)")
    ev.add_argument("--knn", type=int, default=0, metavar="K",
                    help="an image classifier's: also the top-1 of the vote of the K nearest training images by the "
                         "pooled features (DINO's weighted k-NN: cosine similarity, temperature 0.07; K = 20 is DINO's)")
    ev.add_argument("--tta", choices=("none", "flip", "crops"), default="none",
                    help="an image classifier's test-time augmentation: flip, the mean of each image's probabilities "
                         "and its mirror's; crops, of its five crops (corners and center of a view 1/0.875 larger)")
    ev.add_argument("--no-ema", action="store_true", help="evaluate the raw weights even if the run kept an EMA")
    ev.add_argument("--record", action="store_true", help="add the result to the checkpoint's config.json: the model "
                                                          "card save_pretrained writes lists it")
    ev.add_argument("overrides", nargs="*", metavar="key.sub=value", help="e.g. data.root=... data.test_subset=1000")
    ca = sub.add_parser("calibrate", help="fit a classifier's temperature on its validation split (temperature "
                                          "scaling) and keep it with the model: eval and predict use it")
    ca.add_argument("--checkpoint", required=True, help="run directory (its best checkpoint) or checkpoint directory")
    ca.add_argument("--batch-size", type=int, default=256)
    ca.add_argument("--no-ema", action="store_true", help="calibrate the raw weights even if the run kept an EMA")
    ca.add_argument("--objective", choices=("nll", "ece"), default="nll",
                    help="the temperature of the least validation loss (nll, Guo et al. 2017) or of the least "
                         "calibration error (ece, Mukhoti et al. 2020)")
    ca.add_argument("overrides", nargs="*", metavar="key.sub=value", help="e.g. data.root=...")
    pr = sub.add_parser("predict", help="the top-k classes of image files, folders and globs: printed, or a row an "
                                        "image in a .csv, .jsonl or .parquet file (a stopped job continues where it "
                                        "stopped)")
    pr.add_argument("--checkpoint", required=True)
    pr.add_argument("--topk", type=int, default=5)
    pr.add_argument("--output", help="write the rows to this .csv, .jsonl or .parquet file instead of printing them")
    pr.add_argument("--batch-size", type=int, default=64)
    pr.add_argument("--num-workers", type=int, default=2, help="DataLoader workers reading the images")
    pr.add_argument("--tta", choices=("none", "flip", "crops"), default="none",
                    help="test-time augmentation: flip, the mean of each image's probabilities and its mirror's; "
                         "crops, of its five crops (corners and center of a view 1/0.875 larger)")
    pr.add_argument("--split", default="", help="with data.* keys: the split to read (default data.test_split)")
    pr.add_argument("--precision", choices=("run", "no", "bf16", "fp16"), default="run",
                    help="autocast: run (default), the checkpoint's training precision, as eval runs it (bf16 on a "
                         "GPU, float32 on the CPU for a checkpoint that records none); no: float32")
    pr.add_argument("images", nargs="+", metavar="INPUT", help="image files, folders (their images, below them too) "
                    "and globs; or data.* keys naming a data set as training does (data.dataset=hf data.root=...)")
    em = sub.add_parser("embed", help="the pooled pre-logits features of image files, folders and globs into a "
                                      ".parquet, .jsonl or .npy file (a stopped job continues where it stopped)")
    em.add_argument("--checkpoint", required=True)
    em.add_argument("--output", required=True, help="FILE.parquet or .jsonl (a row an image), or FILE.npy (an array; "
                                                    "the paths in FILE.paths.txt)")
    em.add_argument("--batch-size", type=int, default=64)
    em.add_argument("--num-workers", type=int, default=2, help="DataLoader workers reading the images")
    em.add_argument("--split", default="", help="with data.* keys: the split to read (default data.test_split)")
    em.add_argument("--precision", choices=("run", "no", "bf16", "fp16"), default="run",
                    help="autocast: run (default), the checkpoint's training precision, as eval runs it (bf16 on a "
                         "GPU, float32 on the CPU for a checkpoint that records none); no: float32")
    em.add_argument("images", nargs="+", metavar="INPUT", help="image files, folders (their images, below them too) "
                    "and globs; or data.* keys naming a data set as training does (data.dataset=hf data.root=...)")
    at = sub.add_parser("attention", help="draw where a ViT looks: attention rollout or one block/head over images")
    at.add_argument("--checkpoint", required=True)
    at.add_argument("--output", required=True, help="the figure (.png, .pdf, .svg)")
    at.add_argument("--method", choices=("rollout", "block"), default="rollout")
    at.add_argument("--block", type=int, default=-1, help="--method block: the block (default the last)")
    at.add_argument("--head", default="mean", help="--method block: a head index or mean (default)")
    at.add_argument("--head-fusion", choices=("mean", "max", "min"), default="mean", help="rollout: fuse heads so")
    at.add_argument("--discard-ratio", type=float, default=0.0,
                    help="rollout: zero this share of each row's lowest weights (never the CLS column), in [0, 1)")
    at.add_argument("--grid", action="store_true", help="every block x head for one image")
    at.add_argument("--columns", type=int, default=0,
                    help="a compact grid of this many images a row, each above its map (0: a row an image)")
    at.add_argument("images", nargs="+")
    tr = sub.add_parser("translate", help="translate sentences with a trained text model")
    tr.add_argument("--checkpoint", required=True)
    tr.add_argument("--beam-size", type=int, default=4)
    tr.add_argument("--attention", metavar="PNG", help="also draw the sentence's alignment (cross-attention: "
                                                       "source x generated subwords) into this file")
    tr.add_argument("--layer", type=int, default=-1, help="--attention: the decoder layer (default the last)")
    tr.add_argument("sentences", nargs="+")
    sa = sub.add_parser("sample", help="print text sampled from a trained language model (task: lm)")
    sa.add_argument("--checkpoint", required=True)
    sa.add_argument("--prompt", default="", help="text to continue (default: the first token of the vocabulary)")
    sa.add_argument("--max-new-tokens", type=int, default=500)
    sa.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    sa.add_argument("--top-k", type=int, default=None)
    sa.add_argument("--top-p", type=float, default=None)
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--attention", metavar="PNG", help="also draw the causal attention over the prompt into this file")
    sa.add_argument("--layer", type=int, default=-1, help="--attention: the block (default the last)")
    ex = sub.add_parser("export", help="export a model for deployment: ONNX or a torch.export program (.pt2), "
                                       "dynamic batch size, checked against the eager model")
    ex.add_argument("--checkpoint", required=True, help="run, checkpoint or save_pretrained directory")
    ex.add_argument("--format", choices=("onnx", "torch-export"), default="onnx")
    ex.add_argument("--output", required=True, help="the file to write (model.onnx, model.pt2)")
    ex.add_argument("--no-check", action="store_true", help="do not run the exported file against the eager model")
    sh = sub.add_parser("shards", help="write an ImageFolder or a Hugging Face data set as WebDataset shards "
                                       "(data.dataset=wds streams them)")
    sh.add_argument("src", help="an ImageFolder root (SRC/<split>/<class>/<image>), a save_to_disk directory, a "
                                "folder of parquet files or a Hub id")
    sh.add_argument("out", help="the folder to write <split>-000000.tar ... and classes.txt into")
    sh.add_argument("--split", default="train,test", help="the splits, comma-separated (default train,test; the "
                                                          "first one's classes number them all)")
    sh.add_argument("--shard-size", type=int, default=1000, help="samples a shard (default 1000)")
    sh.add_argument("--seed", type=int, default=0, help="the shuffle of each split's samples before writing")
    sh.add_argument("--image-key", default="", help="Hugging Face data: the image column ('' = found by name)")
    sh.add_argument("--label-key", default="", help="Hugging Face data: the label column ('' = found by name)")
    sh.add_argument("--max-size", type=int, help="write the images at most this many px on their longer side "
                                                 "(upright, bicubic, as JPEGs): a data set prepared once at a "
                                                 "training resolution; smaller ones keep their bytes")
    sh.add_argument("--quality", type=int, default=90, help="--max-size: the JPEG quality (default 90)")
    mo = sub.add_parser("models", help="list the model presets with their sizes")
    mo.add_argument("pattern", nargs="?", default="*")
    args = parser.parse_args(argv)
    command = {"eval": _eval, "calibrate": _calibrate, "predict": _predict, "embed": _embed, "attention": _attention,
               "translate": _translate,
               "sample": _sample, "export": _export, "models": _models, "shards": _shards}[args.command]
    run_command(lambda: command(args))


if __name__ == "__main__":
    main()
