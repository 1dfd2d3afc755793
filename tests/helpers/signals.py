"""A signal at a chosen optimizer step, as a scheduler would send it, wherever the step falls in time:
for in-process tests (conftest's ``signal_at_step``) and for one process under torchrun
(``dist_train.py --sigterm-at-step RANK STEP``)."""
from __future__ import annotations

import os
from typing import Callable

from vitlab import training


def signalling_step(step: int, signum: int = 15) -> Callable:
    """``training.Loop.step``, sending this process ``signum`` as optimizer step ``step`` (1-based, counted
    over the run) begins: the loop is to finish that step, then stop."""
    original = training.Loop.step

    def step_after_a_signal(self, group):
        if self.state["global_step"] + 1 == step:
            os.kill(os.getpid(), signum)
        original(self, group)

    return step_after_a_signal
