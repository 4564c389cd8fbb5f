"""LoRACost: what serving adapters adds to a decode step, per SM share, for the latency predictor.

A decode step whose rows run on adapters pays, on top of the base step, the LoRA shrink/expand of every
projection: a fixed part once any row runs an adapter (the LoRA graph's extra launches and its first slot's
A/B read) and a part per further distinct adapter (its A/B read at the share's bandwidth). Rows add a rank-r
GEMV each, which at decode batch sizes is noise beside the weight reads, so the model is

    t_lora(s, n) = F[s] + P[s] * (n - 1)     for n >= 1 distinct adapters, 0 for a base-only step

``F`` and ``P`` are fitted per profiled share from solo steps of one batch at 0, 1 and k adapters; shares in
between are interpolated in ``1 / s`` like the base model's terms.

A mixed step's adapter rows are not a few decode rows: a prefill chunk on an adapter puts tens to hundreds of
rows through the shrink and expand, and past the GEMV's 64 rows the deltas take launches of their own. So
``MixedLoRACost`` prices one adapter in a mixed step by the rows the step's projections process (its token
bucket, as the mixed model counts them):

    t_lora_mixed(s, r) = G[s] + Q[s] * r     (one adapter; each further one adds LoRACost's P[s])

fitted per share from mixed steps timed with every row on one adapter beside the same steps on the base,
one line for the steps the GEMV serves (r <= MAX_GEMV_ROWS: the LoRA runs inside its launches) and one for
the steps past it (cuBLAS, the deltas in launches of their own): the two paths cost differently, a step
apart at the boundary (docs/design.md has the figures).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harli_train.colocate.mixed_model import padded_rows
from harli_train.engine.engine_config import MAX_GEMV_ROWS


@dataclass(slots=True)
class LoRACost:
    """Per-share (F, P) in seconds; ``seconds(sms, n)`` is the extra time of a step with ``n`` adapters."""

    params: dict[int, tuple[float, float]]  # sms -> (F, P)

    @classmethod
    def fit(cls, samples: Sequence[dict]) -> LoRACost | None:
        """From profile samples: solo decode samples (no ``prefill_tokens``) with ``lora_slots`` n >= 1, and
        the base sample of the same share, batch and KV length (``lora_slots`` 0 or absent). None when no
        share has both."""
        solo = [r for r in samples if not r.get("corun") and "prefill_tokens" not in r]
        key = lambda r: (int(r["infer_sms"]), int(r["batch"]), int(r["kv_tokens"]))  # noqa: E731
        base = {key(r): float(r["latency_s"]) for r in solo if not r.get("lora_slots")}
        lora: dict[int, dict[int, float]] = {}
        for r in solo:
            if r.get("lora_slots") and key(r) in base:
                lora.setdefault(int(r["infer_sms"]), {})[int(r["lora_slots"])] = (
                    float(r["latency_s"]) - base[key(r)]
                )
        params: dict[int, tuple[float, float]] = {}
        for sms, extra in lora.items():
            if 1 not in extra:
                continue
            f = max(extra[1], 0.0)
            more = [(n, t) for n, t in extra.items() if n > 1]
            p = max(sum((t - extra[1]) / (n - 1) for n, t in more) / len(more), 0.0) if more else 0.0
            params[sms] = (f, p)
        return cls(params) if params else None

    def seconds(self, sms: int, adapters: int) -> float:
        """Extra seconds of a decode step on ``sms`` SMs whose rows run ``adapters`` distinct adapters."""
        if adapters <= 0:
            return 0.0
        f, p = self._at(sms)
        return f + p * (adapters - 1)

    def _at(self, sms: int) -> tuple[float, float]:
        return _interpolated(self.params, sms)

    def to_dict(self) -> dict[str, Any]:
        return {str(s): list(fp) for s, fp in sorted(self.params.items())}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoRACost:
        return cls({int(s): (float(fp[0]), float(fp[1])) for s, fp in d.items()})


@dataclass(slots=True)
class MixedLoRACost:
    """Per-share (G, Q): one adapter in a mixed step whose projections process ``r`` rows adds G + Q r
    seconds (see the module docstring): ``params`` up to ``MAX_GEMV_ROWS`` rows, ``wide`` past them (a
    share that has no line of one range uses the other's); ``buckets``: the mixed graphs' token buckets ``r``
    is padded to."""

    params: dict[int, tuple[float, float]]  # sms -> (G, Q), steps of up to MAX_GEMV_ROWS rows
    buckets: tuple[int, ...] = ()
    wide: dict[int, tuple[float, float]] = field(default_factory=dict)  # sms -> (G, Q), past them

    @classmethod
    def fit(cls, samples: Sequence[dict], buckets: Sequence[int] = ()) -> MixedLoRACost | None:
        """From profile samples: solo mixed samples (with ``prefill_tokens``) on one adapter (``lora_slots``
        1) and the base sample of the same point. Per share and row range a least-squares line in the padded
        rows (both terms at least 0; one row count: G alone). None when no share has both."""
        solo = [r for r in samples if not r.get("corun") and "prefill_tokens" in r]
        key = lambda r: (  # noqa: E731
            int(r["infer_sms"]), int(r["batch"]), int(r["kv_tokens"]), int(r["prefill_tokens"]),
            int(r.get("prefill_context", 0)),
        )  # fmt: skip
        base = {key(r): float(r["latency_s"]) for r in solo if not r.get("lora_slots")}
        points: tuple[dict[int, list], dict[int, list]] = ({}, {})
        for r in solo:
            if r.get("lora_slots") == 1 and key(r) in base:
                rows = padded_rows(int(r["batch"]) + int(r["prefill_tokens"]), tuple(buckets))
                points[rows > MAX_GEMV_ROWS].setdefault(int(r["infer_sms"]), []).append(
                    (float(rows), float(r["latency_s"]) - base[key(r)])
                )
        narrow, wide = ({sms: _line(pts) for sms, pts in side.items()} for side in points)
        if not narrow and not wide:
            return None
        return cls(narrow, tuple(int(b) for b in buckets), wide)

    def seconds(self, sms: int, rows: int) -> float:
        """Extra seconds of one adapter in a mixed step of ``rows`` tokens (padded to its bucket here)."""
        padded = padded_rows(rows, self.buckets)
        first, other = (self.wide, self.params) if padded > MAX_GEMV_ROWS else (self.params, self.wide)
        g, q = _interpolated(first or other, sms)
        return g + q * padded

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": {str(s): list(gq) for s, gq in sorted(self.params.items())},
            "wide": {str(s): list(gq) for s, gq in sorted(self.wide.items())},
            "buckets": list(self.buckets),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MixedLoRACost:
        lines = lambda m: {int(s): (float(gq[0]), float(gq[1])) for s, gq in m.items()}  # noqa: E731
        return cls(lines(d["params"]), tuple(int(b) for b in d.get("buckets", ())), lines(d.get("wide", {})))


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(G, Q) of the least-squares line through (rows, extra seconds), both at least 0 (one row count: G
    alone)."""
    rows = [p[0] for p in points]
    extra = [max(p[1], 0.0) for p in points]
    mean_r, mean_e = sum(rows) / len(rows), sum(extra) / len(extra)
    var = sum((x - mean_r) ** 2 for x in rows)
    q = sum((x - mean_r) * (e - mean_e) for x, e in zip(rows, extra, strict=True)) / var if var else 0.0
    q = max(q, 0.0)
    return max(mean_e - q * mean_r, 0.0), q


def _interpolated(params: dict[int, tuple[float, float]], sms: int) -> tuple[float, float]:
    """A share's two terms: its own, interpolated in ``1 / s`` between profiled shares, scaled up below the
    smallest (fewer SMs: the reads slow down in proportion), the largest's above it."""
    shares = sorted(params)
    if sms in params:
        return params[sms]
    if sms <= shares[0]:
        f, p = params[shares[0]]
        scale = shares[0] / sms
        return f * scale, p * scale
    if sms >= shares[-1]:
        return params[shares[-1]]
    hi = bisect.bisect_left(shares, sms)
    lo_s, hi_s = shares[hi - 1], shares[hi]
    w = (1 / sms - 1 / hi_s) / (1 / lo_s - 1 / hi_s)
    (f0, p0), (f1, p1) = params[lo_s], params[hi_s]
    return w * f0 + (1 - w) * f1, w * p0 + (1 - w) * p1
