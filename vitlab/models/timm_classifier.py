"""Any timm image classifier as a vitlab model: ``create_model('timm:resnet18', num_classes=10, img_size=32)``,
``model.name: timm:<name>`` in a config.

:class:`TimmClassifier` holds ``timm.create_model(name, pretrained=False, ...)`` and adds what vitlab's
training, checkpoints and inference need: the input size its images are prepared at (``img_size``; timm's
default input size of ``name`` unless given), ``save_pretrained`` / ``load_model``, and ``config.json``'s
arguments. Its state dict is timm's own, under timm's names (no wrapper prefix), so a vitlab checkpoint's
``model.safetensors`` is a timm weights file: ``timm.create_model(name, num_classes=...)`` loads it, and
``distill.teacher=timm:<name>`` with ``distill.teacher_file`` reads it as a teacher.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from .hub import HubMixin

__all__ = ["TimmClassifier", "TIMM_PREFIX", "timm_problem"]

TIMM_PREFIX = "timm:"


def timm_problem(name: str) -> str | None:
    """Why ``timm:<name>`` is not a timm model (one line, with timm's close names), or None if it is."""
    import difflib

    import timm

    if timm.is_model(name):
        return None
    close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(TIMM_PREFIX + c for c in close)}?" if close else \
        " (timm.list_models() lists them)"
    return f"timm has no model {name!r}{hint}"


class TimmClassifier(nn.Module, HubMixin):
    """timm's classifier ``name``, built without pretrained weights, with vitlab's model interface.

    Args:
        name: A timm model name (``timm.list_models()``), without the ``timm:`` prefix.
        num_classes: Classes of the head.
        img_size: The side (or ``(height, width)``) of the images it is given; None: timm's default input
            size of ``name``. Passed on to timm where the model takes it (its ViTs); a convnet takes any size.
        in_chans: Input channels.
        **kwargs: Any other argument of timm's model (``drop_rate``, ``drop_path_rate``, ...).

    Shapes: images ``(B, in_chans, H, W)`` → logits ``(B, num_classes)``.
    """

    def __init__(self, name: str, num_classes: int = 1000, img_size: int | tuple[int, int] | None = None,
                 in_chans: int = 3, **kwargs: Any) -> None:
        super().__init__()

        problem = timm_problem(name)
        if problem:
            raise ValueError(problem)
        self.model = _create(name, dict(num_classes=num_classes, in_chans=in_chans), img_size, kwargs)
        if img_size is None:
            img_size = tuple(self.model.pretrained_cfg["input_size"][1:])
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.in_chans = in_chans
        self.config: dict[str, Any] = dict(name=name, num_classes=num_classes, img_size=self.img_size,
                                           in_chans=in_chans, **kwargs)
        self.pretrained_cfg: dict[str, Any] = {"input_size": (in_chans, *self.img_size)}
        # timm's names in the state dict: drop the "model." of this wrapper on the way out, add it on the way in.
        self._register_state_dict_hook(_drop_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    @property
    def num_classes(self) -> int:
        return self.model.num_classes

    def forward(self, x: Tensor) -> Tensor:
        """``(B, C, H, W)`` images → ``(B, num_classes)`` logits."""
        return self.model(x)

    @property
    def distilled(self) -> bool:
        """Whether timm's model has a distillation token and head (DeiT's ``VisionTransformerDistilled``)."""
        return hasattr(self.model, "set_distilled_training")

    @torch.jit.ignore
    def set_distilled_training(self, enable: bool = True) -> None:
        """In training, return both heads' logits ``(head, head_dist)`` (distillation) instead of their
        average: timm's ``set_distilled_training``, as vitlab's distilled ViT."""
        self.model.set_distilled_training(enable)

    def get_classifier(self) -> nn.Module:
        """timm's model's head (timm's name)."""
        return self.model.get_classifier()

    def reset_classifier(self, num_classes: int) -> None:
        """A new head of ``num_classes``, initialised as timm initialises it."""
        self.model.reset_classifier(num_classes)
        self.config["num_classes"] = num_classes

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """timm's gradient checkpointing of the model's stages.

        Raises:
            ValueError: if ``enable`` and timm's model has none (``model.grad_checkpointing`` cannot hold).
        """
        try:
            self.model.set_grad_checkpointing(enable)
        except (AttributeError, AssertionError, NotImplementedError) as e:
            if enable:
                raise ValueError(f"timm's {self.config['name']!r} has no gradient checkpointing ({type(e).__name__}); "
                                 f"set model.grad_checkpointing=false") from None

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Callable[[str], tuple[int]]:
        """timm's layer groups of the model (its ``group_matcher``, stem first, head last) under this module's
        names: what ``optim.layer_decay`` (timm's ``param_groups_layer_decay``) ranks the parameters by.

        Raises:
            ValueError: if timm's model has no layer groups.
        """
        from timm.models import group_parameters

        if not hasattr(self.model, "group_matcher"):
            raise ValueError(f"timm's {self.config['name']!r} has no layer groups (group_matcher) to decay the "
                             f"learning rate by")
        layers = group_parameters(self.model, self.model.group_matcher(coarse=coarse), reverse=True)
        return lambda name: (layers[name.removeprefix("model.")],)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """timm's parameters kept out of weight decay (positional embeddings and tokens), under this module's names."""
        names = self.model.no_weight_decay() if hasattr(self.model, "no_weight_decay") else set()
        return {f"model.{n}" for n in names}


def _create(name: str, args: dict[str, Any], img_size: int | tuple[int, int] | None,
            kwargs: dict[str, Any]) -> nn.Module:
    """``timm.create_model(name, **args, img_size=img_size, **kwargs)``, without ``img_size`` for a model that
    takes any (a convnet).

    Raises:
        ValueError: one line naming every argument of ``kwargs`` that timm's model does not take (each found
            by building it without the ones before).
    """
    import inspect
    import re

    import timm

    sized = {} if img_size is None else {"img_size": img_size}
    extra, refused = dict(kwargs), []
    while True:
        try:
            model = timm.create_model(name, pretrained=False, **args, **sized, **extra)
        except TypeError as e:
            found = re.search(r"unexpected keyword argument '(\w+)'", str(e))
            key = found.group(1) if found else None
            if key == "img_size" and sized:
                sized = {}  # a convnet: any input size
                continue
            if key in extra:
                refused.append(key)
                del extra[key]
                continue
            if not refused:
                raise ValueError(f"timm's {name!r}: {e}") from None
            break  # another error once those are left out: name those
        if not refused:
            return model
        break
    from .vit import VisionTransformer

    keys = ", ".join(f"model.{k}" for k in refused)
    vit = set(refused) <= set(inspect.signature(VisionTransformer).parameters)
    raise ValueError(f"timm's {name!r} does not take {keys}" + (" (arguments of vitlab's ViT, which a config written "
                     "for one sets)" if vit else "") + "; leave them out of the config's model section and overrides")


def _drop_prefix(module: nn.Module, state: dict[str, Tensor], prefix: str, local_metadata: Any) -> None:
    inner = prefix + "model."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner):]] = state.pop(key)


def _add_prefix(state: dict[str, Tensor], prefix: str, local_metadata: Any, strict: bool, missing: list[str],
                unexpected: list[str], error_msgs: list[str]) -> None:
    inner = prefix + "model."
    for key in [k for k in state if k.startswith(prefix) and not k.startswith(inner)]:
        state[inner + key[len(prefix):]] = state.pop(key)
