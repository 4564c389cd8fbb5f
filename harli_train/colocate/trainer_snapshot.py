"""TrainerSnapshot: the trainer side as the decode thread reads it, replaced whole by the side's owner around
every launch and call (`TrainerWorker`), and what it says about the GPU now."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harli_train.colocate.micro_step_times import queue_left_s


@dataclass(frozen=True, slots=True)
class TrainerSnapshot:
    """The trainer side as of its last launch or call."""

    done: bool
    step: int
    total_steps: int
    last_loss: float
    tokens: float  # tokens trained, the launched part of the step in flight pro rata
    queue: tuple[str, ...]  # kinds of the micro-steps queued on the GPU, oldest first
    queue_end: Any  # the CUDA event the last of them records when it ends (None: nothing queued)
    launching_kind: str | None  # the micro-step being launched now (None: between launches)
    in_round: bool  # inside a launch round (its host work competes with decode's)
    launched_total: int
    oom_recoveries: int  # steps abandoned because the trainer ran out of memory, so far
    queue_ends: tuple[Any, ...] = ()  # the end event of each micro-step in ``queue``
    finish_at: float = 0.0  # host clock: when the queued micro-steps should be done (`MicroStepTimes`)
    ewma_s: float = 0.0  # one micro-step's running mean duration

    def on_gpu(self) -> tuple[str, ...]:
        """The kinds in ``queue`` whose end event has not been reached now (queried): ``queue`` is as of the
        last launch, so while the trainer launches nothing it still lists micro-steps that have ended."""
        if len(self.queue_ends) != len(self.queue):
            return self.queue
        return tuple(k for k, end in zip(self.queue, self.queue_ends, strict=True) if not end.query())

    def launching(self) -> bool:
        """A launch or launch round under way: more micro-steps may be queued before it ends."""
        return self.in_round or self.launching_kind is not None

    def queue_running(self) -> bool:
        """The last queued micro-step's end event has not been reached
        (queried now, not as of the snapshot)."""
        return self.queue_end is not None and not self.queue_end.query()

    def gpu_busy(self) -> bool:
        """Whether the trainer may have work on the GPU now: ``launching`` or ``queue_running``. On a CPU,
        where a micro-step runs while it launches, that is a round under way."""
        return self.launching() or self.queue_running()

    def gpu_left_s(self) -> float:
        """Estimated seconds until the trainer's queued micro-steps end on the GPU (`queue_left_s`): 0 when
        nothing is queued or the last one has ended (queried now); infinite while ``launching``, since more
        may be queued."""
        if self.launching():
            return math.inf
        if not self.queue_running():
            return 0.0
        return queue_left_s(self.finish_at, self.ewma_s)
