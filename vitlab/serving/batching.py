"""Dynamic batching: requests that arrive within a few milliseconds of each other share one forward pass.

Each image of a request is an item on a queue. One task takes the first item waiting, then any that follow within
``max_wait_ms`` (``max_batch_size`` at most), and runs them as one batch on a thread of its own (one forward pass at
a time; the event loop goes on taking requests meanwhile). With ``max_batch_size=1`` every image is a forward pass
of its own."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import Tensor

from .defaults import MAX_BATCH_SIZE, MAX_WAIT_MS

__all__ = ["DynamicBatcher"]


class DynamicBatcher:
    """Batches items of a kind (``"predict"``, ``"embed"``) for ``run(kind, images)`` -> one row an image."""

    def __init__(self, run: Callable[[str, Tensor], Tensor], max_batch_size: int = MAX_BATCH_SIZE,
                 max_wait_ms: float = MAX_WAIT_MS) -> None:
        self.run, self.max_batch_size, self.max_wait = run, max_batch_size, max_wait_ms / 1000
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="vitlab-forward")
        self.batches = 0  # forward passes run (for tests and the log)
        self.pending = 0  # images submitted and not yet answered (GET /health says it)

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Answer what is queued, then stop."""
        while self.queue is not None and not self.queue.empty():
            await asyncio.sleep(0.005)
        if self.task is not None:
            self.task.cancel()
        self.executor.shutdown(wait=True)

    async def submit(self, kind: str, images: Tensor) -> Tensor:
        """The rows ``(B, ...)`` of ``images`` uint8 ``(B, 3, H, W)``, each image batched with whatever else waits."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(len(images))]
        for image, future in zip(images, futures):
            self.queue.put_nowait((kind, image, future))
        self.pending += len(images)
        try:
            return torch.stack(await asyncio.gather(*futures))
        finally:
            self.pending -= len(images)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.max_wait
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self.queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            for kind in dict.fromkeys(k for k, _, _ in batch):
                items = [(image, future) for k, image, future in batch if k == kind]
                try:
                    rows = await loop.run_in_executor(self.executor, self.run, kind,
                                                      torch.stack([image for image, _ in items]))
                    self.batches += 1
                    for (_, future), row in zip(items, rows):
                        if not future.done():
                            future.set_result(row)
                except Exception as e:  # the batch's requests get the error; the server goes on
                    for _, future in items:
                        if not future.done():
                            future.set_exception(e)
