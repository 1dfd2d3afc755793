"""A model on disk, and on the Hugging Face Hub: ``config.json`` + ``model.safetensors``.

Every vitlab model class mixes in :class:`HubMixin` (``huggingface_hub.PyTorchModelHubMixin``), so it
has ``save_pretrained(dir)``, ``Model.from_pretrained(dir_or_repo_id)`` and ``push_to_hub(repo_id)``.
A ``save_pretrained`` directory has the layout of a training checkpoint's model files::

    config.json        {"architecture": "VisionTransformer", "model_args": {...}, + what inference needs:
                        "classes", "mean", "std" for an image model; "task" for a text model}
    model.safetensors  the weights (tied weights stored once)
    tokenizer.json     a text model's tokenizer, when it has one
    README.md          the model card

so ``vitlab.load_model`` (:mod:`.registry`, which knows the classes by their ``"architecture"``) reads run
directories, checkpoint directories and ``save_pretrained`` directories alike. Nothing is unpickled. This
module knows no model class: the models import it, never the other way.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from huggingface_hub import PyTorchModelHubMixin, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..errors import CheckpointError
from .calibrated import CALIBRATED, calibration_of, open_set_file, open_set_name, still_fitted, weights_digest, \
    weights_name
from .jsonfile import CONFIG_NAME, WEIGHTS_NAME, read_json, strict_json, write_json

__all__ = ["HubMixin", "CONFIG_NAME", "WEIGHTS_NAME", "TOKENIZER_NAME", "read_json", "write_json",
           "strict_json", "load_tensors", "weights_for_saving", "load_weights", "write_model_files", "load_model_dir",
           "resolve_checkpoint", "OLD_SUFFIX", "image_input_size"]

TOKENIZER_NAME = "tokenizer.json"
OLD_SUFFIX = ".old"  # a directory being replaced (vitlab.checkpoint.replace_dir); still a good checkpoint

_MODEL_CARD = """---
{{ card_data }}
---

# A vitlab {{ architecture }}

Saved with vitlab's `save_pretrained` (Hugging Face `PyTorchModelHubMixin`):
`config.json` rebuilds the model, `model.safetensors` holds its weights.

```python
import vitlab

model = vitlab.load_model("path/to/this/folder")  # or vitlab.models.{{ architecture }}.from_pretrained("user/repo")
```
{% if training %}
## Training

Trained by vitlab on `{{ training.dataset }}` for {{ training.epochs }} epochs ({{ training.steps }} optimizer
steps) in {{ "%.0f" | format(training.wall_time) }} s of wall time:

    {{ training.command }}

{% if training.evaluation %}| evaluated after epoch {{ training.evaluation.epoch }} | value |
|---|---|
{% for name, value in training.evaluation.items() if name != "epoch" %}| {{ name }} | {{ "%.4f" | format(value) }} |
{% endfor %}{% endif %}
{% endif %}{% if evaluations %}
## Evaluations (`vitlab eval`)

| split | metric | value | command |
|---|---|---|---|
{% for e in evaluations %}{% for name, value in e.metrics.items() %}| {{ e.split }} | {{ name }} | {{ "%.4f" | format(value) if value is float else value }} | `{{ e.command }}` |
{% endfor %}{% endfor %}
{% endif %}"""


def load_tensors(path: Path) -> dict[str, Tensor]:
    """A safetensors file's tensors; a missing or corrupt file raises :class:`CheckpointError`."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing; the checkpoint is incomplete")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: {e}") from None


def weights_for_saving(model: nn.Module) -> dict[str, Tensor]:
    """The state dict under plain names (without a ``torch.compile`` wrapper), each tied weight once
    (safetensors refuses shared storage; :func:`load_weights` ties them again)."""
    model = getattr(model, "_orig_mod", model)
    state, seen = {}, set()
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        state[k] = v.detach().contiguous()
    return state


def load_weights(model: nn.Module, path: Path, only: set[str] | None = None) -> None:
    """Load a safetensors state dict written by :func:`write_model_files` into ``model`` (tied weights included);
    any missing or unexpected name raises :class:`CheckpointError`. ``only``: the file holds these names alone
    (a LoRA run's adapters and head, :func:`trained_names`); the rest of the model keeps its weights."""
    model = getattr(model, "_orig_mod", model)
    try:
        missing, unexpected = model.load_state_dict(load_tensors(path), strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"weights in {str(path)!r} do not fit the model: {str(e).splitlines()[0]}") from None
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - {
        name for name, p in model.named_parameters()}  # second names of shared parameters
    if only is not None:
        tied |= set(model.state_dict()) - only
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"weights in {str(path)!r} do not fit the model: missing "
                              f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")


def resolve_checkpoint(path: str | Path, which: str = "best") -> Path:
    """A checkpoint directory from a run directory (its ``which`` checkpoint) or a checkpoint directory.

    Raises:
        CheckpointError: if there is no checkpoint there.
    """
    path = Path(path)
    candidates = [path, path / "checkpoints" / which, path / "checkpoints" / "last"]
    for c in candidates:
        for d in (c, c.with_name(c.name + OLD_SUFFIX)):
            if (d / "config.json").is_file():
                return d
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    below = sorted(str(p.parent.relative_to(path)) for p in path.glob("**/checkpoints") if p.is_dir()
                   and len(p.relative_to(path).parts) <= 3)
    found = f"; runs below it: {', '.join(below[:10])}{' ...' if len(below) > 10 else ''}" if below else ""
    raise CheckpointError(f"no checkpoint in {str(path)!r}: expected a run directory (checkpoints/{which}/ or "
                          f"checkpoints/last/), or a checkpoint or save_pretrained directory with config.json and "
                          f"model.safetensors{found}")


def _model_args(model: nn.Module) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in model.config.items()}


def write_model_files(model: nn.Module, directory: Path, meta: dict[str, Any], preset: str | None = None,
                      ema: nn.Module | None = None) -> None:
    """Write ``model.safetensors`` (and ``ema.safetensors``) and ``config.json`` into ``directory``.

    ``meta`` adds what inference needs besides the architecture (class names and normalization for
    an image model; the task for a text model).
    """
    keep = trained_names(model) if meta.get("lora") else None  # a LoRA run: its adapters and head alone
    for net, name in ((model, WEIGHTS_NAME), (ema, "ema.safetensors")):
        if net is not None:
            weights = weights_for_saving(net)
            save_file({k: v for k, v in weights.items() if keep is None or k in keep}, str(directory / name))
    model = getattr(model, "_orig_mod", model)
    write_json(directory / CONFIG_NAME, {"architecture": type(model).__name__, "preset": preset,
                                         "model_args": _model_args(model), "has_ema": ema is not None, **meta})


def trained_names(model: nn.Module) -> set[str]:
    """The names of the parameters ``model`` trains (``requires_grad``): what a LoRA checkpoint holds."""
    model = getattr(model, "_orig_mod", model)
    return {name for name, p in model.named_parameters() if p.requires_grad}


def image_input_size(model: nn.Module) -> tuple[int, int, int] | None:
    """``(channels, height, width)`` of the images an image model takes (a ViT's patch embedding's, a timm
    classifier's ``in_chans`` and ``img_size``); None for a text model."""
    model = getattr(model, "_orig_mod", model)
    source = getattr(model, "patch_embed", model)
    if not hasattr(source, "img_size"):
        return None
    return (source.in_chans, *source.img_size)


def _meta_of(model: nn.Module) -> dict[str, Any]:
    """What a loaded or trained model's ``pretrained_cfg`` says beyond the architecture, as ``config.json`` keys."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    meta = {}
    if cfg.get("label_names") is not None:
        meta["classes"] = list(cfg["label_names"])
    for key in ("mean", "std", "task", "decode_size", "crop_pct", "exif_transpose", "temperature", "multi_label",
                "thresholds", "training", "evaluations"):
        if cfg.get(key) is not None:
            meta[key] = list(cfg[key]) if isinstance(cfg[key], tuple) else cfg[key]
    if cfg.get("unknown"):  # vitlab calibrate --unknown's rule; its statistics, if any, copied beside the weights
        meta["unknown"] = {**cfg["unknown"], **({"state": open_set_name(WEIGHTS_NAME)} if "state" in cfg["unknown"]
                                                else {})}
    return meta


def load_model_dir(cls: type[nn.Module], directory: Path, meta: dict[str, Any], use_ema: bool = False,
                   map_location: str | torch.device = "cpu",
                   before_weights: Callable[[nn.Module], set[str]] | None = None, **overrides: Any) -> nn.Module:
    """Build ``cls`` from ``config.json``'s ``meta`` (arguments overridden by ``overrides``), load the
    weights of ``directory`` and set ``model.pretrained_cfg``; returns the model in eval mode.

    ``pretrained_cfg`` says what the model expects: for an image model ``input_size`` and, when the
    model was trained or saved with them, ``mean``, ``std`` and ``label_names``; for a text model
    the ``task`` and the ``tokenizer`` file beside the weights. ``before_weights(model)``: what to do to the
    built model before its weights load (a LoRA checkpoint's base and adapters), returning the names the file
    holds alone (:func:`load_weights`'s ``only``).
    """
    config_file = directory / CONFIG_NAME
    if meta.get("architecture") != cls.__name__ or "model_args" not in meta:
        found = meta.get("architecture") if "model_args" in meta else "no vitlab model"
        raise CheckpointError(f"{str(config_file)!r} describes {found}, not a {cls.__name__}; "
                              f"load it with vitlab.load_model")
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in {**meta["model_args"], **overrides}.items()}
    try:
        model = cls(**args)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{str(config_file)!r} holds invalid model arguments: {e}") from None
    weights = directory / weights_name(meta, use_ema)
    if meta.get("lora") and before_weights is None:
        raise CheckpointError(f"{str(directory)!r} holds LoRA adapters on a base model: load it with vitlab.load_model")
    load_weights(model, weights, only=before_weights(model) if before_weights is not None else None)
    input_size = image_input_size(model)
    if input_size is not None:  # an image model
        cfg: dict[str, Any] = {"input_size": input_size}
        cfg.update({k: tuple(meta[k]) for k in ("mean", "std") if k in meta})
        if "classes" in meta:
            cfg["label_names"] = list(meta["classes"])
        if meta.get("decode_size"):  # training stored its images at this size, then resized them to input_size
            cfg["decode_size"] = meta["decode_size"]
        if meta.get("crop_pct"):  # trained on random resized crops: evaluated on a center crop of this share
            cfg["crop_pct"] = meta["crop_pct"]
        if meta.get("exif_transpose") is False:  # trained on photos as stored, not turned upright
            cfg["exif_transpose"] = False
        fitted = still_fitted(calibration_of(meta, weights.name), model, weights)  # vitlab calibrate's, on these
        if fitted.get("weights_sha256"):
            cfg["calibrated_on"] = fitted["weights_sha256"]  # save_pretrained keeps it only for the same weights
        if fitted.get("temperature"):  # probabilities are softmax(logits / temperature)
            cfg["temperature"] = float(fitted["temperature"])
        if fitted.get("unknown"):  # vitlab calibrate --unknown: a score and its threshold (open_set.stored_rule)
            cfg["unknown"] = dict(fitted["unknown"])
        if meta.get("lora"):  # LoRA adapters on a base model (vitlab.models.lora.merge_lora folds them in)
            cfg["lora"] = dict(meta["lora"])
        if meta.get("multi_label"):  # several classes an image: a sigmoid a class, not a softmax
            cfg["multi_label"] = True
            if fitted.get("thresholds") is not None:  # chosen on the validation split (vitlab calibrate)
                cfg["thresholds"] = [float(t) for t in fitted["thresholds"]]
    else:  # a text model: the task and the tokenizer saved beside the weights
        tokenizer = directory / TOKENIZER_NAME
        cfg = {"task": meta.get("task"), "tokenizer": str(tokenizer) if tokenizer.is_file() else None}
    # What the run measured (training) and what vitlab eval --record added (evaluations): for the model card.
    cfg.update({k: meta[k] for k in ("training", "evaluations") if k in meta})
    model.pretrained_cfg = {**cfg, "checkpoint": str(directory)}
    return model.to(map_location).eval()


class HubMixin(PyTorchModelHubMixin, library_name="vitlab", tags=["vitlab"], model_card_template=_MODEL_CARD):
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` for vitlab models (Hugging Face
    ``PyTorchModelHubMixin``), in vitlab's format: the model's current arguments (``model.config``,
    which follows ``set_input_size`` and ``reset_classifier``), its ``pretrained_cfg`` and its tokenizer.

    ``from_pretrained`` loads strictly (a missing or unexpected weight is an error) and returns the
    model in eval mode; keyword arguments override model arguments (e.g. ``drop_path_rate=0.1``).
    """

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> Any:
        self._open_set_source()  # one line, before the directory is made, if the unknown rule's file is gone
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _open_set_source(self) -> Path | None:
        """The file of what ``vitlab calibrate --unknown`` fitted on these weights (a feature score's), if any."""
        cfg = getattr(self, "pretrained_cfg", None) or {}
        return open_set_file(cfg["checkpoint"], cfg["unknown"]) if (cfg.get("unknown") or {}).get("state") else None

    def _save_pretrained(self, save_directory: Path) -> None:
        from .lora import merged_copy  # LoRA adapters folded into a copy: a plain model any reader loads

        source, target = self._open_set_source(), save_directory / open_set_name(WEIGHTS_NAME)
        merged, meta = merged_copy(self), _meta_of(self)
        calibrated_on = (getattr(self, "pretrained_cfg", None) or {}).get("calibrated_on")
        now = weights_digest(self) if calibrated_on is not None else None
        if calibrated_on is not None and calibrated_on != now:  # changed since, in Python
            dropped = [k for k in CALIBRATED if meta.pop(k, None) is not None]
            print(f"{save_directory}: written without the {', '.join(dropped)} vitlab calibrate fitted on these "
                  f"weights before they changed (they do not hold for the new ones)", file=sys.stderr)
            source = None
        elif calibrated_on is not None:
            meta["weights_sha256"] = now if merged is self else weights_digest(merged)  # the copy's (LoRA merged)
        write_model_files(merged, save_directory, meta)
        if source is not None and source.resolve() != target.resolve():
            shutil.copyfile(source, target)
        cfg = getattr(self, "pretrained_cfg", None) or {}
        tokenizer = cfg.get("tokenizer")
        if tokenizer and Path(tokenizer).resolve() != (save_directory / TOKENIZER_NAME).resolve():
            shutil.copyfile(tokenizer, save_directory / TOKENIZER_NAME)

    def generate_model_card(self, *args: Any, **kwargs: Any):  # noqa: ANN201 (huggingface_hub's ModelCard)
        """The card: how to load the model, and what its run measured (``pretrained_cfg``'s ``training``
        record and the ``vitlab eval --record`` results) when it came from a vitlab run."""
        cfg = getattr(self, "pretrained_cfg", None) or {}
        return super().generate_model_card(*args, architecture=type(self).__name__, training=cfg.get("training"),
                                           evaluations=cfg.get("evaluations"), **kwargs)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: str | None, cache_dir: str | Path | None,
                         force_download: bool, local_files_only: bool, token: str | bool | None,
                         config: dict[str, Any] | None = None, map_location: str | torch.device = "cpu",
                         proxies: dict | None = None, resume_download: bool | None = None,
                         **overrides: Any) -> nn.Module:
        # proxies / resume_download: passed by huggingface_hub < 1.0 (deprecated there, gone since); taken
        # here so that they never become model arguments.
        if os.path.isdir(model_id):
            directory = Path(model_id)
        else:
            download = dict(repo_id=model_id, revision=revision, cache_dir=cache_dir, force_download=force_download,
                            token=token, local_files_only=local_files_only)
            directory = Path(hf_hub_download(filename=WEIGHTS_NAME, **download)).parent
            for optional in (TOKENIZER_NAME, open_set_name(WEIGHTS_NAME)):
                try:
                    hf_hub_download(filename=optional, **download)
                except EntryNotFoundError:
                    pass  # an image model; a text model saved without its tokenizer; no feature score calibrated
        if config is None:
            raise CheckpointError(f"{model_id!r} has no {CONFIG_NAME}; it was not written by save_pretrained")
        return load_model_dir(cls, directory, config, map_location=map_location, **overrides)
