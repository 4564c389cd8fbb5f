"""NeighbourExcess: how much more a decode step overruns its prediction beside one kind of trainer
micro-step than beside the trainer in general.

The co-run model and the online correction size a decode step for "a trainer beside it", whatever the trainer
runs then. A kind of micro-step that slows decode more than the others (the loss micro-step, on the H100:
docs/design.md) puts a step planned while it is on the GPU over the objective when the step's prediction sat
at the budget, and the learned margin, a quantile over every step, dilutes a tail that few steps have.

``NeighbourExcess`` keeps, for each kind, the ``quantile`` of the last ``window`` ratios of co-run decode
steps planned while that kind was on the GPU, and the same quantile over the last ``overall_window`` co-run
decode steps whatever was there. A step planned beside the kinds ``K`` is sized for its prediction times
``factor(K)``: the largest ``q_kind / q_all`` over ``K`` (a kind counts once ``min_samples`` of its steps are
in), never below 1. A ratio is the step's measured latency over its prediction without that factor, so the
factor measures only what the online correction left.
"""

from __future__ import annotations

from typing import Any

from harli_train.colocate.recent_quantile import RecentQuantile


class NeighbourExcess:
    """Per kind of trainer micro-step on the GPU, the excess of decode's measured / predicted tail beside
    it."""

    __slots__ = ("quantile", "window", "min_samples", "_kinds", "_all", "sized")

    def __init__(
        self, quantile: float = 0.95, window: int = 64, min_samples: int = 16, overall_window: int = 512
    ) -> None:
        if not 0.0 < quantile < 1.0 or not 1 <= min_samples <= min(window, overall_window):
            raise ValueError(
                "NeighbourExcess: need 0 < quantile < 1 and 1 <= min_samples <= both windows, got "
                f"{quantile}, {min_samples}, {window}, {overall_window}"
            )
        self.quantile, self.window, self.min_samples = quantile, window, min_samples
        self._kinds: dict[str, RecentQuantile] = {}
        self._all = RecentQuantile(quantile, overall_window, min_samples)
        self.sized = 0  # decode steps whose prediction a factor above 1 raised

    def size_step(self, kinds: tuple[str, ...]) -> float:
        """``factor(kinds)`` for a decode step being sized now; counts it in ``sized`` when above 1."""
        out = self.factor(kinds)
        if out > 1.0:
            self.sized += 1
        return out

    def factor(self, kinds: tuple[str, ...]) -> float:
        """What a co-run decode step planned while ``kinds`` are on the GPU multiplies its prediction by
        (no side effect)."""
        base = self._all.value
        if not kinds or base is None:
            return 1.0
        out = 1.0
        for kind in kinds:
            recent = self._kinds.get(kind)
            value = recent.value if recent is not None else None
            if value is not None and value > out * base:
                out = value / base
        return out

    def observe(self, kinds: tuple[str, ...], ratio: float) -> None:
        """Fold a co-run decode step's measured / predicted (without the factor) in, planned beside
        ``kinds``."""
        if not ratio > 0.0:
            return
        self._all.add(ratio)
        for kind in set(kinds):
            recent = self._kinds.get(kind)
            if recent is None:
                recent = self._kinds[kind] = RecentQuantile(self.quantile, self.window, self.min_samples)
            recent.add(ratio)

    def summary(self) -> dict[str, Any]:
        """The quantile over all co-run decode steps, each kind's (with its step count and its factor now),
        and how many decode steps a factor above 1 sized."""
        base = self._all.value
        return {
            "quantile": self.quantile,
            "all": base,
            "kinds": {
                kind: {
                    "steps": len(recent),
                    "value": recent.value,
                    "factor": self.factor((kind,)),
                }
                for kind, recent in sorted(self._kinds.items())
            },
            "steps_sized": self.sized,
        }
