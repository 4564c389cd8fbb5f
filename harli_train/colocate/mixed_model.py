"""Linear model of a mixed step's latency per SM share: decode rows plus prefill chunks in one varlen step.

For a step of ``b`` decode rows reading ``kv`` cached tokens and prefill chunks of ``n`` tokens in all, whose
attention covers ``w`` query-key pairs, on ``s`` SMs::

    t_solo = M0[s] + M1[s]*r + M2[s]*max(r - K1, 0) + M3[s]*max(r - K2, 0) + M4[s]*w + M5[s]*kv,  r = b + n

The row terms are a linear spline in the rows the projections process: flat while reading the weights
dominates, then compute-bound with a slope that depends on the share. Where the engine replays mixed steps as
CUDA graphs, a step's tokens are padded to its graph's bucket (``buckets``: 16, 32, 64, 96, then multiples of
64) and the projections process every padded row, so ``r`` is the bucket's token count: the cost steps up at
each bucket and is flat within one (but for the attention and KV terms). ``w`` is the chunks' attention,
``kv`` the decode rows' KV read. Beside the trainer the step runs ``1 + D[s]`` times longer (fitted per share
from co-run samples of the same points). Each share is fitted on its own by least squares weighted to relative
error; a share the profile lacks borrows the nearest profiled one scaled by the SM ratio (fewer SMs: slower).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harli_train.colocate.regression import weighted_lstsq

KNOTS = (64, 256)  # rows where the projections' cost per row changes (weight-bound -> compute-bound)
MIXED_FIELDS = ("batch", "kv_tokens", "prefill_tokens", "attn_pairs", "infer_sms", "corun", "latency_s")


def attention_pairs(pieces: Sequence[tuple[int, int]]) -> int:
    """Query-key pairs of prefill pieces ``(tokens, context before them)`` under a causal mask."""
    return sum(n * c + n * (n + 1) // 2 for n, c in pieces)


def padded_rows(rows: int, buckets: Sequence[int]) -> int:
    """The rows a step of ``rows`` tokens runs the projections over: the smallest of ``buckets`` (ascending)
    that holds them, or ``rows`` itself past the last (such a step runs eagerly) or without buckets."""
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else rows


def _features(
    batch: int, kv_tokens: int, tokens: int, pairs: int, buckets: Sequence[int] = ()
) -> tuple[float, ...]:
    r = float(padded_rows(batch + tokens, buckets))
    return (1.0, r, max(r - KNOTS[0], 0.0), max(r - KNOTS[1], 0.0), float(pairs), float(kv_tokens))


@dataclass(slots=True)
class MixedStepModel:
    """Per-share coefficients of the mixed-step model; ``predict`` is a dot product of six terms."""

    coef: dict[int, list[float]]  # sms -> M0..M5
    slowdown: dict[int, float]  # sms -> D (co-run)
    fit_report: dict[str, Any] = field(default_factory=dict)
    buckets: tuple[int, ...] = ()  # the engine's mixed-step token buckets (ascending); () without graphs

    @classmethod
    def fit(cls, samples: Sequence[dict], buckets: Sequence[int] = ()) -> MixedStepModel:
        """Fit every share with at least as many solo samples as the terms they pin down (the rest stay 0),
        on the rows of ``buckets`` (the engine's, when it profiled on graphs); ``fit_report`` has the error on
        the samples and the leave-one-point-out error (``held_out_errors``)."""
        model = cls._fit_shares(samples, tuple(buckets))
        model.fit_report = {**model.evaluate(samples, prefix="fit_"), **held_out_errors(samples, buckets)}
        return model

    @classmethod
    def _fit_shares(cls, samples: Sequence[dict], buckets: tuple[int, ...] = ()) -> MixedStepModel:
        solo = [r for r in samples if not r["corun"]]
        by_share: dict[int, list[dict]] = {}
        for r in solo:
            by_share.setdefault(int(r["infer_sms"]), []).append(r)
        coef = {}
        for sms, rows in by_share.items():
            X = np.array(
                [
                    _features(r["batch"], r["kv_tokens"], r["prefill_tokens"], r["attn_pairs"], buckets)
                    for r in rows
                ]
            )
            used = _pinned(X)
            if len(rows) < used.sum():
                continue
            y = np.array([float(r["latency_s"]) for r in rows])
            coef[sms] = [float(c) for c in weighted_lstsq(X * used, y, 1.0 / y)]
        if not coef:
            raise ValueError("no SM share has enough solo mixed-step samples to fit the mixed model")
        model = cls(coef, {}, buckets=buckets)
        measured = {_point(r): float(r["latency_s"]) for r in solo}
        ratios: dict[int, list[float]] = {}
        for r in samples:
            if r["corun"] and _point(r) in measured:
                ratios.setdefault(int(r["infer_sms"]), []).append(float(r["latency_s"]) / measured[_point(r)])
        model.slowdown = {s: max(float(np.median(v)) - 1.0, 0.0) for s, v in ratios.items()}
        return model

    def _share(self, sms: int) -> tuple[list[float], float]:
        """Coefficients at ``sms``: its own, or the nearest profiled share's scaled by the SM ratio."""
        if sms in self.coef:
            return self.coef[sms], self.slowdown.get(sms, self._nearest_slowdown(sms))
        near = min(self.coef, key=lambda s: abs(s - sms))
        scale = max(near / sms, 1.0)  # fewer SMs than profiled: everything slows in proportion (safe side)
        return [c * scale for c in self.coef[near]], self._nearest_slowdown(sms)

    def _nearest_slowdown(self, sms: int) -> float:
        if not self.slowdown:
            return 0.0
        return self.slowdown[min(self.slowdown, key=lambda s: abs(s - sms))]

    def slowdown_at(self, sms: int) -> float:
        """D at ``sms``: a step beside the trainer runs ``1 + D`` times longer than alone."""
        return self._share(sms)[1]

    def predict(self, batch: int, kv_tokens: int, tokens: int, pairs: int, sms: int, corun: bool) -> float:
        coef, slow = self._share(sms)
        features = _features(batch, kv_tokens, tokens, pairs, self.buckets)
        t = sum(c * x for c, x in zip(coef, features, strict=True))
        return t * (1.0 + slow) if corun else t

    def evaluate(self, samples: Sequence[dict], prefix: str = "") -> dict[str, float]:
        """Mean and max absolute percentage error, solo and co-run."""
        out: dict[str, float] = {}
        for name, want in (("mixed_solo", False), ("mixed_corun", True)):
            errs = [
                abs(
                    self.predict(
                        r["batch"], r["kv_tokens"], r["prefill_tokens"], r["attn_pairs"], r["infer_sms"], want
                    )
                    / r["latency_s"]
                    - 1
                )
                for r in samples
                if bool(r["corun"]) == want
            ]
            if errs:
                out[f"{prefix}{name}_mape_pct"] = 100.0 * sum(errs) / len(errs)
                out[f"{prefix}{name}_max_ape_pct"] = 100.0 * max(errs)
                out[f"{prefix}{name}_n"] = len(errs)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "coef": {str(s): list(c) for s, c in self.coef.items()},
            "slowdown": {str(s): d for s, d in self.slowdown.items()},
            "fit_report": dict(self.fit_report),
            "buckets": list(self.buckets),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MixedStepModel:
        return cls(
            {int(s): [float(x) for x in c] for s, c in d["coef"].items()},
            {int(s): float(x) for s, x in d.get("slowdown", {}).items()},
            dict(d.get("fit_report", {})),
            tuple(int(b) for b in d.get("buckets", ())),
        )


def held_out_errors(samples: Sequence[dict], buckets: Sequence[int] = ()) -> dict[str, float]:
    """Leave-one-point-out error of the mixed model on its own profile: each grid point (its solo and co-run
    samples) predicted by the model of its share fitted without it. ``heldout_mixed_{solo,corun}_{mape,
    max_ape}_pct``; a point whose share cannot be fitted without it is not counted."""
    by_share: dict[int, list[dict]] = {}
    for r in samples:
        by_share.setdefault(int(r["infer_sms"]), []).append(r)
    errs: dict[bool, list[float]] = {False: [], True: []}
    for rows in by_share.values():
        for point in {_point(r) for r in rows}:
            rest = [r for r in rows if _point(r) != point]
            try:
                model = MixedStepModel._fit_shares(rest, tuple(buckets))
            except ValueError:
                continue
            for r in rows:
                if _point(r) == point and int(r["infer_sms"]) in model.coef:
                    got = model.predict(
                        r["batch"], r["kv_tokens"], r["prefill_tokens"], r["attn_pairs"], r["infer_sms"],
                        bool(r["corun"]),
                    )  # fmt: skip
                    errs[bool(r["corun"])].append(abs(got / float(r["latency_s"]) - 1.0))
    out: dict[str, float] = {}
    for corun, e in errs.items():
        if e:
            name = "corun" if corun else "solo"
            out[f"heldout_mixed_{name}_mape_pct"] = 100.0 * sum(e) / len(e)
            out[f"heldout_mixed_{name}_max_ape_pct"] = 100.0 * max(e)
    return out


def _pinned(X: np.ndarray) -> np.ndarray:
    """Which terms a share's samples can pin down: the intercept and rows always; a knot's hinge only with
    two distinct row counts past it; the attention and KV terms only where they vary."""
    distinct = lambda col: len(np.unique(X[:, col]))  # noqa: E731
    return np.array(
        [1.0, 1.0]
        + [float(len(np.unique(X[X[:, j] > 0, j])) >= 2) for j in (2, 3)]
        + [float(distinct(4) > 1), float(distinct(5) > 1)]
    )


def _point(r: dict) -> tuple:
    return (r["batch"], r["kv_tokens"], r["prefill_tokens"], r["attn_pairs"], r["infer_sms"])
