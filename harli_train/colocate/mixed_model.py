"""Linear model of a mixed step's latency per SM share: decode rows plus prefill chunks in one varlen step.

For a step of ``b`` decode rows reading ``kv`` cached tokens and prefill chunks of ``n`` tokens in all, whose
attention covers ``w`` query-key pairs, on ``s`` SMs::

    t_solo = M0[s] + M1[s]*r + sum_i H_i[s]*max(r - K_i, 0) + A[s]*w + V[s]*kv,  r = b + n

The row terms are a linear spline in the rows the projections process, with knots ``K_i`` where the cost per
row may change. Where the engine replays mixed steps as CUDA graphs, a step's tokens are padded to its graph's
bucket (``buckets``: 16, 32, 64, 96, then multiples of 64) and the projections process every padded row, so
``r`` is the bucket's token count: the cost steps up at each bucket and is flat within one (but for the
attention and KV terms). Such a profile measures a few buckets only, and the cost between them is not one
line: on the H200 a step of 96 rows cost 1.2-1.5 ms more than one of 64 (past ``MAX_GEMV_ROWS`` the
projections leave the weight-streaming GEMV for cuBLAS), then little more up to 256. So the knots are every
profiled bucket between the least and the largest, and the spline goes through the cost of each (the model
interpolates between them, and prices a bucket past the last on the last segment's slope). Without graphs a
step's rows are its tokens and the knots are ``KNOTS``: flat while reading the weights dominates, then
compute-bound with a slope that depends on the share. ``w`` is the chunks' attention,
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
    batch: int,
    kv_tokens: int,
    tokens: int,
    pairs: int,
    buckets: Sequence[int] = (),
    knots: Sequence[int] = KNOTS,
) -> tuple[float, ...]:
    r = float(padded_rows(batch + tokens, buckets))
    return (1.0, r, *(max(r - k, 0.0) for k in knots), float(pairs), float(kv_tokens))


def profiled_knots(samples: Sequence[dict], buckets: Sequence[int]) -> tuple[int, ...]:
    """The spline's knots for ``samples`` profiled on ``buckets``: the padded row counts they measured, but
    the least and the largest (``KNOTS`` without buckets, where a step's rows are not a few levels)."""
    if not buckets:
        return KNOTS
    levels = sorted({padded_rows(int(r["batch"]) + int(r["prefill_tokens"]), buckets) for r in samples})
    return tuple(levels[1:-1])


@dataclass(slots=True)
class MixedStepModel:
    """Per-share coefficients of the mixed-step model; ``predict`` is a dot product of ``4 + len(knots)``
    terms."""

    coef: dict[int, list[float]]  # sms -> M0, M1, H_1..H_k, A, V
    slowdown: dict[int, float]  # sms -> D (co-run)
    fit_report: dict[str, Any] = field(default_factory=dict)
    buckets: tuple[int, ...] = ()  # the engine's mixed-step token buckets (ascending); () without graphs
    knots: tuple[int, ...] = KNOTS  # the spline's knots in rows (``profiled_knots``), fixed at the fit

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
        knots = profiled_knots(solo, buckets)
        by_share: dict[int, list[dict]] = {}
        for r in solo:
            by_share.setdefault(int(r["infer_sms"]), []).append(r)
        coef = {}
        for sms, rows in by_share.items():
            X = np.array(
                [
                    _features(
                        r["batch"], r["kv_tokens"], r["prefill_tokens"], r["attn_pairs"], buckets, knots
                    )
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
        model = cls(coef, {}, buckets=buckets, knots=knots)
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
        features = _features(batch, kv_tokens, tokens, pairs, self.buckets, self.knots)
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
            "knots": list(self.knots),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MixedStepModel:
        return cls(
            {int(s): [float(x) for x in c] for s, c in d["coef"].items()},
            {int(s): float(x) for s, x in d.get("slowdown", {}).items()},
            dict(d.get("fit_report", {})),
            tuple(int(b) for b in d.get("buckets", ())),
            tuple(int(k) for k in d.get("knots", KNOTS)),  # saved before the knots were: KNOTS
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
    """Which terms a share's samples can pin down: the intercept and rows always; a knot's hinge only with a
    row count past its knot and not past the next one (its own segment: a share that lacks some of the
    profiled buckets fits one line over the knots it did not measure, not columns that only its largest
    rows tell apart); the attention and KV terms (the last two columns) only where they vary."""
    distinct = lambda col: len(np.unique(X[:, col]))  # noqa: E731
    last = X.shape[1] - 3  # the last hinge's column
    past = X > 0
    hinges = [past[:, j] & ~past[:, j + 1] if j < last else past[:, j] for j in range(2, last + 1)]
    return np.array(
        [1.0, 1.0] + [float(h.any()) for h in hinges] + [float(distinct(-2) > 1), float(distinct(-1) > 1)]
    )


def _point(r: dict) -> tuple:
    return (r["batch"], r["kv_tokens"], r["prefill_tokens"], r["attn_pairs"], r["infer_sms"])
