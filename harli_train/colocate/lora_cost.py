"""LoRACost: what serving adapters adds to a decode step, per SM share, for the latency predictor.

A decode step whose rows run on adapters pays, on top of the base step, the LoRA shrink/expand of every
projection: a fixed part once any row runs an adapter (the LoRA graph's extra launches and its first slot's
A/B read) and a part per further distinct adapter (its A/B read at the share's bandwidth). Rows add a rank-r
GEMV each, which at decode batch sizes is noise beside the weight reads, so the model is

    t_lora(s, n) = F[s] + P[s] * (n - 1)     for n >= 1 distinct adapters, 0 for a base-only step

``F`` and ``P`` are fitted per profiled share from solo steps of one batch at 0, 1 and k adapters; shares in
between are interpolated in ``1 / s`` like the base model's terms.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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
        params, shares = self.params, sorted(self.params)
        if sms in params:
            return params[sms]
        if sms <= shares[0]:
            f, p = params[shares[0]]
            scale = shares[0] / sms  # fewer SMs than profiled: the reads slow down in proportion
            return f * scale, p * scale
        if sms >= shares[-1]:
            return params[shares[-1]]
        hi = bisect.bisect_left(shares, sms)
        lo_s, hi_s = shares[hi - 1], shares[hi]
        w = (1 / sms - 1 / hi_s) / (1 / lo_s - 1 / hi_s)
        (f0, p0), (f1, p1) = params[lo_s], params[hi_s]
        return w * f0 + (1 - w) * f1, w * p0 + (1 - w) * p1

    def to_dict(self) -> dict[str, Any]:
        return {str(s): list(fp) for s, fp in sorted(self.params.items())}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoRACost:
        return cls({int(s): (float(fp[0]), float(fp[1])) for s, fp in d.items()})
