"""How long the trainer's micro-steps take, and when those it has queued on the GPU should be done.

`TrainerSide` sizes each launch round by these estimates: a micro-step of a kind is expected to take the
median of that kind's recent durations, a launch to cost the median of the recent launches' host time, and
the queue to end at the running estimate `finish_at` (each queued micro-step starting when the one before it
ends, or when it was launched). Called from the one thread that owns the `TrainerSide`.
"""

from __future__ import annotations

import time
from collections import deque


def _median(values: deque[float]) -> float:
    return sorted(values)[len(values) // 2]


def queue_left_s(finish_at: float, ewma_s: float) -> float:
    """Seconds until a queue estimated to end at ``finish_at`` (host clock) ends, for a queue not yet seen to
    have ended: one running late still counts a quarter micro-step (``ewma_s``) until retired."""
    ahead = finish_at - time.perf_counter()
    return ahead if ahead > 0 else 0.25 * ewma_s


class MicroStepTimes:
    """Durations of retired micro-steps (by kind and overall), host seconds a launch, the queue's end."""

    def __init__(self, estimates: dict[str, float] | None = None) -> None:
        self.ewma_s = 0.0  # one micro-step's duration, any kind
        # Recent durations per kind; ``estimates`` (seconds per kind, measured beside no decode:
        # `trainer_warmup.time_micro_steps`) stand in until the run has timed its own.
        self.by_kind: dict[str, deque[float]] = {
            k: deque([v], maxlen=5) for k, v in (estimates or {}).items()
        }
        self._recent: deque[float] = deque(maxlen=9)  # recent durations of any kind
        self._host_recent: deque[float] = deque(maxlen=9)
        self.finish_at = 0.0  # host clock: when the queued micro-steps should be done (GPU)

    @property
    def timed(self) -> bool:
        """Whether any kind has a duration (measured, or an estimate given at the start)."""
        return bool(self.by_kind)

    def observe(self, seconds: float, kind: str) -> float:
        """Fold in one retired micro-step of ``kind``; returns the median of the recent ones of any kind
        (one stalled micro-step must not move it much)."""
        self.ewma_s = seconds if self.ewma_s == 0 else self.ewma_s + 0.2 * (seconds - self.ewma_s)
        self.by_kind.setdefault(kind, deque(maxlen=5)).append(seconds)
        self._recent.append(seconds)
        return _median(self._recent)

    def expected_s(self, kind: str) -> float:
        """Expected duration of a micro-step of ``kind``: the median of its recent ones; before any, the
        largest median of the kinds timed so far (a kind not yet timed, such as the step boundary's, is not
        assumed short), else the running mean (0 before any micro-step)."""
        recent = self.by_kind.get(kind)
        if recent:
            return _median(recent)
        known = self.medians()
        return max(known.values()) if known else self.ewma_s

    def medians(self) -> dict[str, float]:
        """Each timed kind's median of its recent durations."""
        return {k: _median(v) for k, v in self.by_kind.items() if v}

    def host_s(self) -> float:
        """Host time one launch takes (median of the recent ones)."""
        return _median(self._host_recent) if self._host_recent else 0.0

    def launched(self, t0: float, host: float, cost: float) -> None:
        """A micro-step expected to take ``cost`` on the GPU was launched at ``t0`` in ``host`` seconds:
        its kernels start once the queue ahead is done, and none ends before its launch has."""
        self._host_recent.append(host)
        self.finish_at = max(max(self.finish_at, t0) + cost, t0 + host)

    def queued_s(self, queued: bool) -> float:
        """GPU work still to run of what is queued (``queued``: anything is), in seconds (`queue_left_s`)."""
        return queue_left_s(self.finish_at, self.ewma_s) if queued else 0.0
