"""StepPlan: where the next engine step runs and what the trainer does meanwhile, and its constructors.

A plan's trainer work goes *beside* the step (launched before it on a stream of its own, ``horizon_s`` of
work queued), *after* it (time slicing: filling ``horizon_s`` of slack on the same stream once the step is
done) or not at all (paused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harli_train.colocate.controller import Decision
from harli_train.colocate.sm import Partition

BESIDE, AFTER, NONE = "beside", "after", "none"
# With nothing to decode the loop comes back every few ms; keeping the trainer's queue that short means
# little of its work is still running on decode's SMs when the next request arrives.
IDLE_HORIZON_S = 5e-3


@dataclass(slots=True)
class StepPlan:
    """Where the next engine step runs and what the trainer may do meanwhile."""

    partition: Partition  # the step runs on partition.infer_stream
    train: str  # BESIDE, AFTER or NONE
    train_stream: Any
    train_sms: int
    horizon_s: float  # BESIDE: trainer work to keep queued; AFTER: slack to fill after the step
    predicted_s: float | None
    reason: str
    decision: Decision | None = None
    isolated: bool = False  # the trainer's SMs are disjoint from decode's (a green-context rung)
    train_from_sm: int = 0  # isolated: the trainer's rung gives it SMs [train_from_sm, total)
    strict: bool = True  # the horizon is a hard limit (an objective is at stake), not a pacing hint
    transient: bool = False  # a one-step detour (a prefill): backwards it strands wait, never restart
    prefill_tokens: int | None = None  # the prefill budget of the step (None: the engine's default)
    mixed_raw_s: float | None = None  # a mixed step: the uncorrected prediction, for the online correction
    corun: bool = True  # the prediction assumes the trainer beside the step
    beside_backward: bool = False  # a co-run mixed step sized with a trainer backward on the GPU
    max_queued: int = 0  # micro-steps the trainer may keep queued on the GPU (0: the runtime's cap)
    # The step starts on the GPU once the trainer's queued work has ended (its stream waits for the queue's
    # end event), so it may be launched while that work still runs: a paused trainer's hand-off.
    after_trainer: bool = False

    @property
    def paused(self) -> bool:
        return self.train == NONE


def paused(
    part: Partition, reason: str, predicted: float | None = None, d: Decision | None = None
) -> StepPlan:
    """The step on ``part`` with the trainer held back (what it has queued still runs)."""
    return StepPlan(part, NONE, part.train_stream, 0, 0.0, predicted, reason, d)


def beside(
    decode: Partition,
    trainer: Partition,
    horizon: float,
    predicted: float | None,
    reason: str,
    d: Decision | None = None,
    strict: bool = True,
    transient: bool = False,
) -> StepPlan:
    """The step on ``decode``'s SMs, the trainer on ``trainer``'s rung (SMs disjoint from decode's)."""
    return StepPlan(
        decode,
        BESIDE,
        trainer.train_stream,
        trainer.train_sms,
        horizon,
        predicted,
        reason,
        d,
        isolated=True,
        train_from_sm=trainer.infer_sms,
        strict=strict,
        transient=transient,
    )


def after(part: Partition, total_sms: int, slack_s: float, d: Decision) -> StepPlan:
    """Time slicing: the step on ``part``, then the trainer on the same stream for ``slack_s``."""
    return StepPlan(part, AFTER, part.train_stream, total_sms, slack_s, d.predicted_s, d.reason, d)


def whole_gpu(
    part: Partition, total_sms: int, horizon: float, reason: str, strict: bool = True, max_queued: int = 0
) -> StepPlan:
    """The trainer on an ordinary stream over the whole GPU (no partition); ``max_queued`` as StepPlan's."""
    return StepPlan(
        part,
        BESIDE,
        part.train_stream,
        total_sms,
        horizon,
        None,
        reason,
        strict=strict,
        max_queued=max_queued,
    )


class Ewma:
    """Running estimate of a latency, for what no predictor models."""

    def __init__(self, initial: float, alpha: float = 0.2) -> None:
        self.value, self.alpha = initial, alpha

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)
