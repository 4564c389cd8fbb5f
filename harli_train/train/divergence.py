"""Stopping a run whose loss or gradient norm stopped being a finite number.

Once a step's loss or gradient norm is inf or nan, its optimizer update has written inf/nan into the adapter
and the optimizer moments; every later step inherits them. The trainer checks each step as it counts it
(`check_step`, on values it reads back from the GPU anyway) and stops with `TrainingDiverged` before anything
of that step is logged, checkpointed or saved as the adapter, so the newest checkpoint on disk stays the last
finite state.
"""

from __future__ import annotations

import math
from pathlib import Path

from harli_train.train.checkpoint import list_checkpoints


class TrainingDiverged(RuntimeError):
    """The run stopped at `step` because `what` (the loss or the gradient norm) was `value`, not finite;
    `checkpoint` is the newest checkpoint left on disk (None: none was written)."""

    def __init__(self, step: int, what: str, value: float, checkpoint: Path | None):
        self.step, self.what, self.value, self.checkpoint = step, what, value, checkpoint
        kept = f"the last checkpoint, {checkpoint}, is kept" if checkpoint else "no checkpoint was written"
        super().__init__(
            f"training diverged at step {step}: the {what} is {value}; stopped without saving it ({kept}); "
            "a lower train.lr usually helps"
        )


def check_step(step: int, loss: float, grad_norm: float, run_dir: Path) -> None:
    """Raise TrainingDiverged when optimizer step `step` (1-based) of the run in `run_dir` had a non-finite
    loss or gradient norm (the loss is named first when both are)."""
    for what, value in (("loss", loss), ("gradient norm", grad_norm)):
        if not math.isfinite(value):
            found = list_checkpoints(run_dir)
            raise TrainingDiverged(step, what, value, found[-1] if found else None)
