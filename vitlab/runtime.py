"""Where code runs: the accelerator, the device, the precision and the process group, for training, evaluation
and prediction alike.

- :func:`create_accelerator`: an ``Accelerator`` that also works for several processes on a machine without
  GPUs, and refuses more processes than a machine has GPUs;
- :func:`cpu_requested`: ``ACCELERATE_USE_CPU`` (``accelerate launch --cpu``) keeps the processes on the CPU, the
  GPUs hidden before any process group starts;
- :func:`default_device` and :func:`autocast_dtype`: the device and precision a trained model runs at;
- :func:`processes`, :func:`listed_once`, :func:`gather_uneven`: this process in its group, a listing made
  once and shared, tensors of uneven lengths gathered in process order;
- :func:`bare_model`: the module under ``torch.compile``'s and DDP's wrappers.

Knows no model, data set or task: the rooms above import it.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from .errors import ConfigError, DataError

__all__ = ["create_accelerator", "cpu_requested", "default_device", "autocast_dtype", "PRECISIONS", "processes",
           "listed_once", "gather_uneven", "bare_model"]


def create_accelerator(mixed_precision: str = "no", **kwargs: Any) -> Accelerator:
    """An ``Accelerator`` that also works for several processes on a machine without GPUs: there
    Accelerate's gloo (multi-CPU) path needs ``cpu=True``, otherwise each process would silently
    work alone. ``ACCELERATE_USE_CPU=1`` (what ``accelerate launch --cpu`` sets) keeps every process
    on the CPU on a machine with GPUs too.

    Raises:
        ConfigError: before any process group starts, if more processes were started on this machine
            than it has GPUs (NCCL needs a GPU of its own for each process).
    """
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    on_cpu = cpu_requested()
    gpus = torch.cuda.device_count()
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if launched and not on_cpu and 0 < gpus < local_processes:
        raise ConfigError(f"{local_processes} processes were started on this machine, which has {gpus} GPU(s): each "
                          f"process needs a GPU of its own; start {gpus} (torchrun --nproc_per_node {gpus}, accelerate "
                          f"launch --num_processes {gpus}), or run them on the CPU with ACCELERATE_USE_CPU=1 "
                          f"(accelerate launch --cpu)")
    return Accelerator(cpu=launched and not gpus, mixed_precision=mixed_precision, **kwargs)


def cpu_requested() -> bool:
    """Whether ``ACCELERATE_USE_CPU`` (what ``accelerate launch --cpu`` sets) keeps this process on the CPU, on a
    machine with GPUs too; a process so launched beside others then hides the GPUs (:func:`_hide_gpus`)."""
    on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if on_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _hide_gpus()
    return on_cpu


def _hide_gpus() -> None:
    """Hide the GPUs from this process, as ``CUDA_VISIBLE_DEVICES=`` would: processes launched to run on
    the CPU must not reach a GPU. Accelerate's ``wait_for_everyone`` passes the local rank to
    ``torch.distributed.barrier(device_ids=...)`` also for gloo, and torch then names ``cuda:<rank>``
    wherever CUDA is available: on a machine with one GPU the process of rank 1 failed (seen on an H100).
    Takes effect only before anything in the process asked CUDA for its devices (say so if too late)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if torch.cuda.is_initialized():
        raise ConfigError("ACCELERATE_USE_CPU is set but CUDA was initialised before the Accelerator was created; "
                          "start the processes with CUDA_VISIBLE_DEVICES= as well")


def default_device() -> torch.device:
    """The device training and eval would take: this process's GPU (``LOCAL_RANK``) where CUDA is, unless
    ``ACCELERATE_USE_CPU`` (``accelerate launch --cpu``) keeps the processes on the CPU; else the CPU."""
    if not cpu_requested() and torch.cuda.is_available():  # the GPUs hidden first where the launch keeps the CPU
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


PRECISIONS = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(model: nn.Module, precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (``train.mixed_precision``'s names), or for ``'run'`` the one the
    checkpoint's training recorded, as eval runs it (a checkpoint without a record: bf16 on a GPU, float32 on
    the CPU); None: float32.

    Raises:
        ConfigError: one line, for another name.
    """
    if precision == "run":
        recorded = ((getattr(model, "pretrained_cfg", None) or {}).get("training") or {}).get("mixed_precision")
        precision = recorded or ("bf16" if device.type == "cuda" else "no")
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision}: give run (the checkpoint's training precision, as eval uses), "
                          f"{', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def processes() -> tuple[int, int, Any]:
    """This process's rank, the number of processes and ``torch.distributed`` when launched by torchrun or
    ``accelerate launch`` (the group started through Accelerate: gloo on CPUs, NCCL on GPUs); else
    ``(0, 1, None)``."""
    import torch.distributed as dist

    cpu_requested()  # accelerate launch --cpu: the GPUs hidden before the group starts, as in training
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        PartialState()  # joins the group the launcher set up
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size(), dist
    return 0, 1, None


def listed_once(list_split: Callable[[], Any], num_processes: int) -> Any:
    """``list_split()`` run by process 0 alone, its listing (or its one-line error) given to every process:
    shards without an index are read through to list them (about 2 minutes for ImageNet-1k), a streamed
    Hub split's label column is read; once a run, not once a process."""
    if num_processes == 1 or not torch.distributed.is_initialized():
        return list_split()
    box: list[Any] = [None]
    if torch.distributed.get_rank() == 0:
        try:
            box = [list_split()]
        except (DataError, ConfigError) as e:
            box = [e]
        except Exception as e:  # the others must not wait for a listing that never comes
            torch.distributed.broadcast_object_list([DataError(f"process 0 could not list the data: {e}")], src=0)
            raise
    torch.distributed.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def gather_uneven(accelerator: Accelerator, x: Tensor) -> Tensor:
    """Concatenate every process's ``x`` (first dimensions may differ) in process order."""
    if accelerator.num_processes == 1:
        return x
    sizes = accelerator.gather(torch.tensor([len(x)], device=x.device)).tolist()
    padded = accelerator.gather(accelerator.pad_across_processes(x, dim=0))
    longest = max(sizes)
    return torch.cat([padded[i * longest:i * longest + n] for i, n in enumerate(sizes)])


def bare_model(model: nn.Module, accelerator: Accelerator) -> nn.Module:
    """The module under ``torch.compile``'s and DDP's wrappers (the same parameters), the wrappers left as
    they are. Training compiles after ``accelerator.prepare``: ``compile(DDP(model))``, which Accelerate's
    ``unwrap_model`` would mend by writing the bare module into the compiled wrapper, so that the steps
    after it run without DDP's gradient all-reduce. So the compiled wrapper is looked under first."""
    return accelerator.unwrap_model(getattr(model, "_orig_mod", model))
