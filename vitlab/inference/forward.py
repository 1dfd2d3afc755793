"""The forward passes of a trained model over many images: what a model gives (:func:`pooled_features`, and
logits through :func:`~vitlab.inference.tta.tta_logits`), over a loader on every process and gathered in the
loader's order (:func:`gathered`: evaluation in training, ``vitlab eval``, ``calibrate``, k-NN), and in cache-sized
chunks side by side on a CPU (:class:`ChunkedForward`: ``vitlab predict`` and ``embed``)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from ..runtime import gather_uneven

__all__ = ["feature_model", "pooled_features", "gathered", "ChunkedForward", "cpu_chunk", "CPU_ACTIVATION_BUDGET"]


def feature_model(model: nn.Module) -> nn.Module:
    """The network whose pooled features ``model`` is worth: a self-supervised model's backbone (MAE's encoder,
    DINO's teacher: :meth:`backbone`, carrying the model's ``pretrained_cfg``), else ``model`` itself."""
    inner = getattr(model, "module", model)  # under DDP
    return inner.backbone() if callable(getattr(inner, "backbone", None)) else model


def pooled_features(model: nn.Module, images: Tensor) -> Tensor:
    """The pooled pre-logits features ``(b, E)`` of a vitlab ViT or a timm classifier (``forward_features``, then
    ``forward_head(pre_logits=True)``, timm's API; a distilled model's class token)."""
    inner = getattr(model, "module", model)  # under DDP
    inner = inner if hasattr(inner, "forward_head") else inner.model  # TimmClassifier holds timm's model
    pooled = inner.forward_head(inner.forward_features(images), pre_logits=True)
    return pooled[0] if isinstance(pooled, tuple) else pooled


def logits_and_features(model: nn.Module, images: Tensor) -> tuple[Tensor, Tensor]:
    """The logits ``(b, K)`` and the pooled pre-logits features ``(b, E)`` of ``images`` from one pass through the
    blocks (``forward_features`` once, then ``forward_head`` with and without ``pre_logits``: timm's API, whose
    ``forward`` is the two composed)."""
    inner = getattr(model, "module", model)
    inner = inner if hasattr(inner, "forward_head") else inner.model
    tokens = inner.forward_features(images)
    pooled = inner.forward_head(tokens, pre_logits=True)
    return inner.forward_head(tokens), pooled[0] if isinstance(pooled, tuple) else pooled


@torch.no_grad()
def gathered(model: nn.Module, loader: Any, accelerator: Accelerator, compute: Callable[[nn.Module, Tensor], Tensor],
             model_input: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``compute(model, images)`` (float32 ``(b, ...)``, under the accelerator's autocast, the model in eval mode) of
    every batch of ``loader`` and the labels, concatenated over the processes in the loader's order, on the CPU.
    ``loader`` is prepared by ``accelerator`` (the samples it repeated to even out the processes are dropped) or
    shards itself exactly (``exact_shards``: gathered unevenly); ``model_input`` makes its batches the model's
    input. Multi-hot labels come back as uint8."""
    was_training = model.training
    model.eval()
    outputs, labels_all = [], []
    exact = getattr(loader, "exact_shards", False)
    for images, labels in loader:
        if model_input is not None:
            images = model_input(images)
        with accelerator.autocast():
            out = compute(model, images)
        labels = labels.to(torch.uint8) if labels.dtype == torch.bool else labels  # multi-hot, gathered as bytes
        if not exact:
            out, labels = accelerator.gather_for_metrics((out, labels))
        outputs.append(out)
        labels_all.append(labels)
    model.train(was_training)
    out, labels = torch.cat(outputs), torch.cat(labels_all)
    if exact:
        out, labels = gather_uneven(accelerator, out), gather_uneven(accelerator, labels)
    return out.cpu(), labels.cpu()


# On a CPU the forward pass runs over chunks of a batch whose widest layer output fits this many bytes (or the
# weights' size, where larger: each chunk reads them again): a whole batch at once spills the caches
# (benchmarks/RESULTS.md, "The forward pass in cache-sized chunks"). The rows do not depend on it.
CPU_ACTIVATION_BUDGET = 2 * 2**20


def _cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, as ``os.process_cpu_count``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_chunk(model: nn.Module, input_size: tuple[int, int, int]) -> int:
    """How many images of ``input_size`` ``(C, H, W)`` a chunk of the CPU forward pass holds: the budget
    (:data:`CPU_ACTIVATION_BUDGET`, or the weights' bytes if more) over the float32 bytes of one image's widest
    linear or convolution output (measured on one blank image), at least 1."""
    widest = 0

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal widest
        if isinstance(output, torch.Tensor):
            widest = max(widest, output[0].numel())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, *input_size, device=next(model.parameters()).device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    budget = max(CPU_ACTIVATION_BUDGET, sum(p.numel() * p.element_size() for p in model.parameters()))
    return max(1, budget // (4 * max(widest, 1)))


class ChunkedForward:
    """The forward pass of a batch on a CPU: over chunks of ``chunk`` images (:func:`cpu_chunk`), side by side in as
    many Python threads as torch had threads (at most the CPUs), each chunk on one of torch's threads. Torch's own
    threads split every operation and wait for each other at its end, spinning: whenever a DataLoader worker took
    a core, every operation waited for it. ``chunk`` 0: the batch whole (a GPU). Each runs under autocast to
    ``dtype`` on ``device`` (None: float32), entered in the thread that runs it (autocast and no_grad are a
    thread's own). Call :meth:`close` at the end: it gives torch its threads back."""

    def __init__(self, chunk: int, device: torch.device, dtype: torch.dtype | None = None) -> None:
        self.chunk, self.threads, self.pool = chunk, torch.get_num_threads(), None
        self.device, self.dtype = device, dtype
        if chunk and self.threads > 1:
            self.pool = ThreadPoolExecutor(min(self.threads, _cpus()))
            torch.set_num_threads(1)

    def __call__(self, forward: Callable[[Tensor], Tensor], images: Tensor) -> Tensor:
        def one(chunk: Tensor) -> Tensor:
            with torch.no_grad(), torch.autocast(self.device.type, self.dtype or torch.float32,
                                                 enabled=self.dtype is not None):
                return forward(chunk)

        if not self.chunk:
            return one(images)
        chunks = images.split(self.chunk)
        return torch.cat(list(self.pool.map(one, chunks) if self.pool is not None else map(one, chunks)))

    def close(self) -> None:
        torch.set_num_threads(self.threads)
        if self.pool is not None:
            self.pool.shutdown()
