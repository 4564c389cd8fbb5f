"""The controller's margin, learned from the prediction error it observes.

The budget a decode step is sized for is ``tpot * (1 - margin)``. A fixed margin either wastes SMs (the
predictor is better than the margin assumes) or lets violations through (it is worse). ``LearnedMargin``
keeps the last ``window`` ratios of measured to predicted (corrected) step latency and sets the margin so that
a step predicted at the budget runs within the objective at the ``quantile`` of those ratios:
``margin = 1 - 1 / ratio_q``, clamped to ``[floor, cap]``. Until ``warmup`` ratios are in, the starting
margin (the recipe's ``colocation.margin``) applies.
"""

from __future__ import annotations

import bisect
import math
from collections import deque


class LearnedMargin:
    """A margin from the observed prediction error; ``value`` is the margin in force."""

    def __init__(
        self,
        start: float,
        quantile: float = 0.995,
        window: int = 2000,
        warmup: int = 64,
        floor: float = 0.02,
        cap: float = 0.5,
    ) -> None:
        if not 0 <= start < 1 or not 0 < quantile < 1 or not 0 <= floor <= cap < 1:
            raise ValueError("LearnedMargin: need 0 <= start < 1, 0 < quantile < 1, 0 <= floor <= cap < 1")
        self.start, self.quantile, self.warmup, self.floor, self.cap = start, quantile, warmup, floor, cap
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self.value = start

    def observe(self, measured_s: float, predicted_s: float) -> float:
        """Fold one step's measured/predicted ratio in; returns the margin now in force."""
        if not (predicted_s > 0 and measured_s > 0 and math.isfinite(measured_s)):
            return self.value
        ratio = measured_s / predicted_s
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(ratio)
        bisect.insort(self._sorted, ratio)
        if len(self._sorted) >= self.warmup:
            q = self._sorted[min(int(self.quantile * len(self._sorted)), len(self._sorted) - 1)]
            self.value = min(max(1.0 - 1.0 / q, self.floor), self.cap)
        return self.value
