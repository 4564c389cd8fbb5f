"""What the clients of the co-located engine saw, against the TPOT objective: every token interval of every
request, each request's own TPOT and TTFT. The console's live line and the run's summary both come from
``objective_stats``, over the requests recorded so far plus those still running.

- a **violation** is a token interval (one of a request's tokens to its next) longer than the objective,
  whatever made it long: a prefill, a trainer launch, a re-partition, host work; nothing is left out;
- ``violation_rate`` = violating intervals / all intervals;
- ``tpot_attainment`` = the fraction of requests with at least 2 output tokens whose own TPOT (first token
  to last, so far for those still running or cut off at the end) meets the objective;
- a policy is **clean** when ``tpot_attainment >= ATTAINMENT_BAR`` and ``violation_rate <= RATE_BAR``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from harli_train.engine.metrics import EngineMetrics, percentiles, request_record
from harli_train.engine.sequence import Sequence

ATTAINMENT_BAR = 0.99
RATE_BAR = 0.001


def objective_stats(
    metrics: EngineMetrics, tpot_s: float, running: Iterable[Sequence] = (), ttft_s: float | None = None
) -> dict[str, Any]:
    """Objective figures over every request ``metrics`` recorded and the ``running`` ones (so far); with a
    TTFT objective ``ttft_s``, the fraction of requests with a first token whose TTFT met it."""
    running = list(running)
    records = [r for r in metrics.requests if r.finish_reason != "refused"]
    records += [request_record(s, metrics.t0) for s in running]
    intervals = np.frombuffer(metrics.intervals, dtype=np.float64) if len(metrics.intervals) else np.zeros(0)
    extra = [np.diff(np.asarray(s.token_times)) for s in running if len(s.token_times) > 1]
    if extra:
        intervals = np.concatenate([intervals, *extra])
    tpot_ms = tpot_s * 1e3
    violations = int((intervals > tpot_s).sum())
    judged = [r.tpot_ms for r in records if r.output_tokens >= 2 and r.tpot_ms is not None]
    attainment = sum(t <= tpot_ms for t in judged) / len(judged) if judged else None
    rate = violations / intervals.size if intervals.size else None
    ttfts = [r.ttft_ms for r in records if r.ttft_ms is not None]
    ttft_met = None
    if ttft_s is not None and ttfts:
        ttft_met = sum(t <= ttft_s * 1e3 for t in ttfts) / len(ttfts)
    return {
        "objective_tpot_ms": tpot_ms,
        "intervals": int(intervals.size),
        "violations": violations,
        "violation_rate": rate,
        "tpot_attainment": attainment,
        "requests_judged": len(judged),
        "requests_missing_tpot": sum(t > tpot_ms for t in judged),
        "clean": attainment is not None and attainment >= ATTAINMENT_BAR and (rate or 0.0) <= RATE_BAR,
        "ttft_ms": percentiles(ttfts),
        **({} if ttft_s is None else {"objective_ttft_ms": ttft_s * 1e3, "ttft_attainment": ttft_met}),
        "tpot_ms": percentiles(judged),
        "token_interval_ms": percentiles(intervals * 1e3),
    }
