"""LaunchGate: how much trainer work one launch round may queue for a plan, micro-step by micro-step.

A round starts with a time budget (`budget`) and launches micro-steps while `allows` says the next one fits,
spending each one's expected duration from the budget. One rule per way the trainer shares the GPU:

- **Time slicing** (``plan.train == AFTER``): the micro-steps run on decode's stream after its step, in the
  slack the objective leaves (``plan.horizon_s`` less what is queued). Under an objective (``plan.strict``)
  the slack is a hard limit and a micro-step fits only by a measured estimate: before any micro-step has been
  timed none does, since one that overran would hold the next decode step past the objective. With nothing at
  stake (between requests) the first micro-step always goes.
- **Beside decode on a GPU**: keep the decode step covered, plus about one micro-step queued past it, plus the
  host time the next launch takes, so that the trainer's SMs do not run dry while it is still launching; and
  never more than the plan's cap (``plan.max_queued``), else ``max_in_flight``, micro-steps queued. A queue
  grown too long fills the stream's hardware queue: the trainer's launches then block in the driver, and
  decode's submissions with them.
- **CPU stand-ins** (every launch runs synchronously and is timed directly): about the horizon's worth, at
  least one micro-step.
"""

from __future__ import annotations

import logging

from harli_train.colocate.micro_step_times import MicroStepTimes
from harli_train.colocate.policy import AFTER, BESIDE, StepPlan

log = logging.getLogger(__name__)


class LaunchGate:
    """The launch budget of a round and the test each further micro-step must pass."""

    def __init__(self, times: MicroStepTimes, max_in_flight: int = 2) -> None:
        self.times = times
        self.max_in_flight = max_in_flight  # micro-steps queued on the GPU at most beside decode
        self._starved = 0  # time-sliced decode steps in a row whose slack the next micro-step did not fit

    def budget(self, plan: StepPlan, sync: bool, queued_s: float) -> float:
        """Seconds of trainer work a round for ``plan`` may launch, ``queued_s`` being already queued."""
        if sync:
            return plan.horizon_s
        if plan.train == BESIDE:
            return plan.horizon_s + self.times.ewma_s + self.times.host_s() - queued_s
        return plan.horizon_s - queued_s

    def allows(
        self, plan: StepPlan, sync: bool, budget: float, cost: float, launched: int, kind: str, queued: int
    ) -> bool:
        """Whether a micro-step of ``kind`` expected to take ``cost`` seconds may launch, with ``budget``
        seconds of the round left, ``launched`` micro-steps launched in it and ``queued`` on the GPU."""
        if plan.train == AFTER:
            if cost <= budget and (self.times.timed or not plan.strict):
                return True
            if not launched and not plan.strict:
                return True
            self._note_starved(kind, cost, budget)
            return False
        if sync:
            return not launched or cost <= budget
        return budget > 0 and queued < (plan.max_queued or self.max_in_flight)

    def fed(self) -> None:
        """A time-sliced decode step's slack took a micro-step."""
        self._starved = 0

    def _note_starved(self, kind: str, cost: float, budget: float) -> None:
        """Count a decode step whose slack the next micro-step did not fit; warn once that has gone on for
        long. Its estimate is refreshed where the trainer runs
        with no objective at stake (between requests)."""
        self._starved += 1
        if self._starved == 500:
            log.warning(
                "the trainer's next micro-step (%s, ~%.1f ms) has not fitted the slack decode leaves "
                "(%.1f ms) for 500 steps: lower train.layers_per_microstep",
                kind,
                cost * 1e3,
                budget * 1e3,
            )
