"""Stopping on a scheduler's signal: catch it, agree across processes, stop after an optimizer step.

SLURM and Kubernetes send SIGTERM some time before they kill a job (SLURM's ``--signal`` can send
another, SIGUSR1 say, earlier). :class:`StopSignals` turns each of ``train.stop_signals`` into a flag
and nothing else, so a signal can never interrupt a step or a checkpoint half-way; a second signal
only sets the flag again. The loop asks :meth:`StopSignals.agreed` after each optimizer step: one
all-reduce (MAX) of the flag over the processes, on the CPU (gloo), so the GPU's queue is not waited
for and every process stops after the same step even when only one of them got the signal.
"""
from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import signal
import threading
from types import FrameType
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["StopSignals", "ignore_in_workers", "elastic_restart_advice"]


def _parse(names: str) -> list[signal.Signals]:
    return [signal.Signals[n.strip()] for n in names.split(",") if n.strip()]


def ignore_in_workers(loader: Any, names: str) -> None:
    """Make the worker processes of ``loader`` (a ``DataLoader``; anything else is left alone) ignore
    the signals ``names``. SLURM signals every process of a job step and a terminal its whole process
    group; a worker killed by the stop signal (torch's workers die on SIGTERM) would take the main
    process down with it before it could write its checkpoint. The main process ends its workers."""
    if getattr(loader, "num_workers", 0) and _parse(names):
        context = getattr(loader, "multiprocessing_context", None) or multiprocessing.get_context()
        loader.worker_init_fn = functools.partial(_ignore_then, names, _main_exiting(context.get_start_method()),
                                                  loader.worker_init_fn)


@functools.cache
def _main_exiting(start_method: str) -> Any:
    """An event the main process sets when it exits. At exit, multiprocessing ends daemonic children
    (DataLoader workers still alive after an error, a corrupt image met by a worker) with SIGTERM and
    waits for them: a worker that ignored it would make the process hang there. This atexit handler
    runs before multiprocessing's (registered earlier, when multiprocessing was imported). One for each
    way of starting workers: an event made for fork cannot go to a worker started by forkserver or spawn."""
    event = multiprocessing.get_context(start_method).Event()
    atexit.register(event.set)
    return event


def _ignore_then(names: str, main_exiting: Any, worker_init_fn: Callable[[int], None] | None,
                 worker_id: int) -> None:
    """In a worker: the stop signals are the main process's to act on, unless it is exiting."""
    def handler(signum: int, frame: FrameType | None) -> None:
        if main_exiting.is_set():
            os._exit(0)

    for sig in _parse(names):
        signal.signal(sig, handler)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


class StopSignals:
    """A context manager that catches ``names`` (e.g. ``"SIGTERM,SIGUSR1"``) while training runs and
    restores the previous handlers on exit. Outside the main thread (where Python cannot catch
    signals) it catches nothing."""

    def __init__(self, names: str, num_processes: int = 1) -> None:
        self.signals = _parse(names)
        self.received: str | None = None  # the name of the first signal caught
        self._previous: dict[signal.Signals, Any] = {}
        self._group = None
        if num_processes > 1 and self.signals:
            # NCCL would put the flag on the GPU and make reading it wait for the queue: a CPU group.
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._distributed = num_processes > 1 and bool(self.signals)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._catch)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self) -> bool:
        """Whether any process caught a signal; every process gets the same answer (a collective:
        call it at the same point on every process)."""
        if not self._distributed:
            return self.received is not None
        flag = torch.tensor([self.received is not None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


def elastic_restart_advice() -> str:
    """One line for a worker that torchrun may restart (``--max-restarts`` > 0) through the agent's
    shared rendezvous store, '' otherwise. With that store, workers restarted after a ``kill -9`` failed
    to reconnect (they read a peer's address from the attempt before: 2 of 7 restarts with torch 2.14
    here, 2 of 2 with the static ``--master_port`` rendezvous and torch 2.15); a fresh store per round
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with a c10d rendezvous) restarted every time."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts <= 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    return (f"torchrun --max-restarts {restarts} shares its agent's rendezvous store with the workers, and restarted "
            f"workers may then fail to reconnect; launch as TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone "
            f"(one machine) or --rdzv-backend c10d --rdzv-endpoint HOST:PORT (several) --max-restarts {restarts} ...")
