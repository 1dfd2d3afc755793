"""Progress that reaches the user wherever the output goes: a tqdm bar on a terminal; elsewhere (a log
file, a pipe, a cluster job's output) one plain line at least every ``interval`` seconds, since a bar's
carriage returns make a log file unreadable and tqdm stays silent there."""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterable, Iterator

from tqdm.auto import tqdm

__all__ = ["Progress"]


class Progress:
    """Count ``total`` units of work under a description.

    Args:
        iterable: What to iterate (optional: else call :meth:`update`).
        total: The units of work.
        desc: What is being done (``"decoding 50,000 images"``, ``"epoch 3/7"``).
        initial: Units already done (a resumed epoch).
        enabled: Whether this process shows progress; default: the main process only (``RANK`` 0, as
            torchrun and ``accelerate launch`` set it).
        interval: Seconds between plain lines where the output is not a terminal.
        unit: The unit's name in plain lines.
    """

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: int, desc: str, initial: int = 0,
                 enabled: bool | None = None, interval: float = 30.0, unit: str = "") -> None:
        if enabled is None:
            enabled = os.environ.get("RANK", "0") == "0"
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n, self.enabled, self.interval = initial, enabled, interval
        self.postfix: dict[str, Any] = {}
        self.terminal = enabled and sys.stdout.isatty()
        self.started = self.last_line = time.time()
        self.bar = (tqdm(total=total, desc=desc, initial=initial, leave=False, dynamic_ncols=True, file=sys.stdout)
                    if self.terminal else None)

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None, "Progress(iterable=...) to iterate"
        for item in self.iterable:
            yield item
            self.update()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled:
            now = time.time()
            if now - self.last_line >= self.interval:
                self.last_line = now
                print(self.line(now), flush=True)

    def set_postfix(self, **values: Any) -> None:
        """Values shown beside the count (the loss, the learning rate)."""
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def line(self, now: float | None = None) -> str:
        """The plain progress line: ``desc: n/total unit (p%) | elapsed s | key value ...``."""
        unit = f" {self.unit}" if self.unit else ""
        done = f"{self.n:,}/{self.total:,}{unit} ({100 * self.n / max(self.total, 1):.0f}%)"
        extra = "".join(f" | {k} {v}" for k, v in self.postfix.items())
        return f"{self.desc}: {done} | {(now if now is not None else time.time()) - self.started:.0f} s{extra}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
