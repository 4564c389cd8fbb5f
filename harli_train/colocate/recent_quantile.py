"""RecentQuantile: an upper quantile of the last few observations, kept as they arrive."""

from __future__ import annotations

import bisect
from collections import deque


class RecentQuantile:
    """The ``quantile`` of the last ``window`` values added; ``value`` is None until ``min_samples`` are in.

    ``add`` keeps the window sorted as it goes (a bisection and a list insert and delete: about a microsecond
    at 512 values), so ``value`` is a field read.
    """

    __slots__ = ("quantile", "min_samples", "_values", "_sorted", "_value")

    def __init__(self, quantile: float, window: int, min_samples: int) -> None:
        if not 0.0 <= quantile <= 1.0 or window < 1 or not 1 <= min_samples <= window:
            raise ValueError(
                f"need 0 <= quantile <= 1 and 1 <= min_samples <= window, "
                f"got {quantile}, {min_samples}, {window}"
            )
        self.quantile, self.min_samples = quantile, min_samples
        self._values: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self._value: float | None = None

    def add(self, x: float) -> None:
        values, ordered = self._values, self._sorted
        if len(values) == values.maxlen:
            del ordered[bisect.bisect_left(ordered, values[0])]
        values.append(x)
        bisect.insort(ordered, x)
        if len(ordered) >= self.min_samples:
            self._value = ordered[min(int(self.quantile * len(ordered)), len(ordered) - 1)]

    @property
    def value(self) -> float | None:
        return self._value

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        self._values.clear()
        self._sorted.clear()
        self._value = None
