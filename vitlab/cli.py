"""The ``vitlab`` command line: ``train`` (as ``train.py``), and the arguments of ``eval``, ``calibrate``, ``predict``,
``embed``, ``inspect``, ``serve``, ``attention``, ``translate``, ``sample``, ``export``, ``shards`` and ``models``,
whose work is in :mod:`vitlab.commands`. User errors print one line and exit non-zero."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

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
        from .training.resume import refuse_task_change

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
            refuse_task_change(checkpoint, args.overrides, args.resume)
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


def _image_job_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments ``vitlab predict`` and ``embed`` share: how the images are read and run, and which."""
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers reading the images")
    p.add_argument("--split", default="", help="with data.* keys: the split to read (default data.test_split)")
    p.add_argument("--precision", choices=("run", "no", "bf16", "fp16"), default="run",
                   help="autocast: run (default), the checkpoint's training precision, as eval runs it (bf16 on a "
                        "GPU, float32 on the CPU for a checkpoint that records none); no: float32")
    p.add_argument("--max-image-pixels", type=int, default=0, metavar="N",
                   help="an image file whose header gives more pixels (width x height) is not decoded: its row says "
                        "so (a small PNG can decode to gigabytes); 0 (default): no limit but PIL's own")
    p.add_argument("images", nargs="+", metavar="INPUT", help="image files, folders (their images, below them too) "
                   "and globs; or data.* keys naming a data set as training does (data.dataset=hf data.root=...)")


def _unknown_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments ``vitlab predict`` and ``serve`` share: whether an image is answered ``unknown``."""
    p.add_argument("--unknown", choices=("auto", "on", "off"), default="auto",
                   help="answer --unknown-label for an image whose open-set score is below the threshold vitlab "
                        "calibrate --unknown kept with the weights: auto (default) where one was kept; on: refuse a "
                        "model without one; off: never")
    p.add_argument("--unknown-label", default="unknown", help="the name such an image is given (default unknown)")


def _predict_parsers(sub: Any) -> None:
    """``vitlab predict`` and ``vitlab embed``."""
    pr = sub.add_parser("predict", help="the top-k classes of image files, folders and globs: printed, or a row an "
                                        "image in a .csv, .jsonl or .parquet file (a stopped job continues where it "
                                        "stopped)")
    pr.add_argument("--checkpoint", required=True)
    pr.add_argument("--topk", type=int, default=5)
    pr.add_argument("--output", help="write the rows to this .csv, .jsonl or .parquet file instead of printing them")
    pr.add_argument("--tta", choices=("none", "flip", "crops"), default="none",
                    help="test-time augmentation: flip, the mean of each image's probabilities and its mirror's; "
                         "crops, of its five crops (corners and center of a view 1/0.875 larger)")
    _unknown_arguments(pr)
    _image_job_arguments(pr)
    em = sub.add_parser("embed", help="the pooled pre-logits features of image files, folders and globs into a "
                                      ".parquet, .jsonl or .npy file (a stopped job continues where it stopped)")
    em.add_argument("--checkpoint", required=True)
    em.add_argument("--output", required=True, help="FILE.parquet or .jsonl (a row an image), or FILE.npy (an array; "
                                                    "the paths in FILE.paths.txt)")
    _image_job_arguments(em)


def _inspect_parser(sub: Any) -> None:
    """``vitlab inspect``."""
    ins = sub.add_parser("inspect", help="find wrong labels, near-duplicates within a split and between splits "
                                         "(leaks), outliers and the class balance of a data set (cleanlab on a "
                                         "checkpoint's features; pip install 'vitlab[inspect]')")
    ins.add_argument("--checkpoint", required=True, help="whose pooled features to use: a run, a self-supervised "
                                                         "run, a pretrained or save_pretrained directory")
    ins.add_argument("--output", required=True, help="the folder to write issues.csv, the picture grids and the "
                                                     "features into (reused by the next inspection)")
    ins.add_argument("--knn", type=int, default=0, metavar="K",
                     help="out-of-sample probabilities from the votes of the K nearest other images of the split "
                          "(cosine, DINO's weights); the default, with K = 20")
    ins.add_argument("--folds", type=int, default=0, metavar="K",
                     help="out-of-sample probabilities from K cross-fitted linear heads on the features (each image's "
                          "from the head fitted on the other folds)")
    ins.add_argument("--seed", type=int, default=0, help="--folds: how the images are dealt to the folds")
    ins.add_argument("--splits", default="", help="the splits to inspect, comma-separated (default: data.train_split "
                                                  "and data.test_split); leaks are looked for between each pair")
    ins.add_argument("--duplicate-threshold", type=float, default=None, metavar="R",
                     help="near-duplicates: the correlation of the aligned 32 x 32 thumbnails at or above which two "
                          "images are reported (default 0.90)")
    ins.add_argument("--write-clean", metavar="FILE.csv", help="also write the first split's images without those "
                                                               "flagged, as a list data.dataset=csv reads")
    ins.add_argument("--other-classes", action="store_true", help="the checkpoint was trained on other classes "
                                                                  "than the data's (a pretrained backbone): use its "
                                                                  "features alone")
    ins.add_argument("--grid", type=int, default=16, help="images in each kind's picture grid (0: none)")
    ins.add_argument("--batch-size", type=int, default=64)
    ins.add_argument("--num-workers", type=int, default=2, help="DataLoader workers reading the images")
    ins.add_argument("--precision", choices=("run", "no", "bf16", "fp16"), default="run",
                     help="autocast of the features' forward pass, as vitlab embed's")
    ins.add_argument("data", nargs="+", metavar="data.key=value", help="the data set, as training names it "
                                                                       "(data.dataset=csv data.root=DIR ...)")


def _serve_parser(sub: Any) -> None:
    """``vitlab serve``."""
    from .serving import defaults as d

    se = sub.add_parser("serve", help="serve a classifier over HTTP: an API with dynamic batching and a page to try "
                                      "it (pip install 'vitlab[serve]')")
    se.add_argument("--checkpoint", required=True)
    se.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only; "
                                                        "0.0.0.0: every interface)")
    se.add_argument("--port", type=int, default=8000)
    se.add_argument("--max-batch-size", type=int, default=d.MAX_BATCH_SIZE,
                    help=f"images a forward pass at most (1: no batching; default {d.MAX_BATCH_SIZE})")
    se.add_argument("--max-wait-ms", type=float, default=d.MAX_WAIT_MS,
                    help=f"how long a forward pass waits for more images to batch (default {d.MAX_WAIT_MS:g} ms)")
    se.add_argument("--max-upload-mb", type=float, default=d.MAX_UPLOAD_MB,
                    help=f"a larger request is refused (413; default {d.MAX_UPLOAD_MB:g})")
    se.add_argument("--max-image-pixels", type=int, default=d.MAX_IMAGE_PIXELS, metavar="N",
                    help="an image whose header gives more pixels (width x height) is refused (413) before it is "
                         f"decoded, and the requests in flight decode at most N pixels at once (default "
                         f"{d.MAX_IMAGE_PIXELS:,})")
    se.add_argument("--api-key-env", metavar="VAR", help="every route but /health asks for the key in this "
                                                         "environment variable (Authorization: Bearer <key>)")
    se.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="an origin whose pages may call the API (repeat for more; none by default)")
    se.add_argument("--device", help="cuda, cpu (default: a GPU if there is one)")
    se.add_argument("--precision", choices=("run", "no", "bf16", "fp16"), default="run",
                    help="autocast, as vitlab predict's (run: the checkpoint's training precision)")
    _unknown_arguments(se)


def _eval_parsers(sub: Any) -> None:
    """``vitlab eval`` and ``vitlab calibrate``."""
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
    ev.add_argument("--unknown-images", nargs="+", metavar="PATH",
                    help="images of none of the run's classes (files, folders, globs, or data.* keys naming a data "
                         "set: data.dataset=csv data.root=DIR, its data.test_split): how well each score (maximum "
                         "softmax, maximum logit, energy, k-NN, Mahalanobis) tells them from the split's, as AUROC "
                         "and FPR at 95%% TPR")
    ev.add_argument("--unknown-k", type=int, default=50, help="--unknown-images: the k-NN score's neighbour (50)")
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
    ca.add_argument("--unknown", metavar="SCORE", nargs="?", const="vim",
                    choices=("msp", "max_logit", "energy", "knn", "mahalanobis", "relative_mahalanobis", "vim"),
                    help="instead of the temperature: the threshold of this open-set score (vim when none is named; "
                         "msp, max_logit, energy, knn, mahalanobis, relative_mahalanobis) that keeps --keep of the "
                         "validation images; predict and serve answer 'unknown' below it")
    ca.add_argument("--keep", type=float, default=0.95, help="--unknown: the share of known images kept (0.95)")
    ca.add_argument("--unknown-k", type=int, default=50, help="--unknown knn: the neighbour whose distance is the "
                                                               "score (50)")
    ca.add_argument("overrides", nargs="*", metavar="key.sub=value", help="e.g. data.root=...")


def _attention_parser(sub: Any) -> None:
    """``vitlab attention``."""
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


def _text_parsers(sub: Any) -> None:
    """``vitlab translate`` and ``vitlab sample``."""
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


def _tune_parser(sub: Any) -> None:
    """``vitlab tune``."""
    tu = sub.add_parser("tune", help="search a config's hyperparameters with Optuna on its validation split: each "
                                     "trial a run in STUDY/trial_NNNN/; the same command continues a stopped study")
    tu.add_argument("--config", required=True, help="the base config (it must hold out validation data)")
    tu.add_argument("--space", required=True, help="a YAML of config keys: {low, high, log, step} or [choices]")
    tu.add_argument("--trials", type=int, required=True, help="trials in all, those run before counted")
    tu.add_argument("--study", help="the study's directory, its trials' runs and its results (default "
                                    "runs/tune_<config name>)")
    tu.add_argument("--storage", help="where the study is kept: an Optuna database URL (postgresql://...) or "
                                      "journal:PATH (default: a SQLite file in the study's directory)")
    tu.add_argument("--pruner", default="median", help="median, hyperband or none (default median)")
    tu.add_argument("--metric", help="the validation metric chosen on (default train.best_metric, else val_top1)")
    tu.add_argument("--timeout", type=float, help="minutes after which no trial is started")
    tu.add_argument("--seed", type=int, default=0, help="the TPE sampler's seed (each trial's draw seeded by it "
                    "and the trial's number: processes sharing a study draw different values)")
    tu.add_argument("--base-first", action="store_true", help="the first trial is the base config's own values of "
                    "the space's keys (each must lie in the space): the best is then never below the base recipe")
    tu.add_argument("--devices", help="'all' or GPU numbers (0,1): one trial a GPU at once, each GPU's trials in a "
                    "process of its own sharing the study")
    tu.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a process --devices started
    tu.add_argument("overrides", nargs="*", help="key=value for every trial")


def _tool_parsers(sub: Any) -> None:
    """``vitlab export``, ``vitlab shards`` and ``vitlab models``."""
    ex = sub.add_parser("export", help="export a model for deployment: ONNX or a torch.export program (.pt2), "
                                       "dynamic batch size, checked against the eager model")
    ex.add_argument("--checkpoint", required=True, help="run, checkpoint or save_pretrained directory")
    ex.add_argument("--format", choices=("onnx", "torch-export"), default="onnx")
    ex.add_argument("--output", required=True, help="the file to write (model.onnx, model.pt2)")
    ex.add_argument("--no-check", action="store_true", help="do not run the exported file against the eager model")
    ex.add_argument("--with-preprocess", action="store_true",
                    help="an image classifier's file takes uint8 RGB images (batch, H, W, 3) at the training size and "
                         "returns probabilities (normalization and temperature inside; label names, thresholds in "
                         "its metadata)")
    ex.add_argument("--quantize", choices=("int8",), help="ONNX: onnxruntime's dynamic int8 quantization of the "
                                                          "matrix products' weights (norms and adds kept in float)")
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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # same arguments as train.py
        return train_main(argv[1:])
    parser = argparse.ArgumentParser(prog="vitlab", description="Vision Transformers on one attention core.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train (same arguments as train.py: --config FILE [--resume DIR] [key=value ...])")
    for add in (_eval_parsers, _predict_parsers, _inspect_parser, _serve_parser, _attention_parser, _text_parsers,
                _tune_parser, _tool_parsers):
        add(sub)
    args = parser.parse_args(argv)
    from .commands import COMMANDS

    run_command(lambda: COMMANDS[args.command](args))


if __name__ == "__main__":
    main()
