"""What the clients of the co-located engine saw, against the TPOT objective and, when one is set, the TTFT
objective: every token interval of every request, each request's own TPOT and TTFT. The console's live line
and the run's summary both come from ``objective_stats``, over the requests recorded so far plus those still
running or queued.

- a **violation** is a token interval (one of a request's tokens to its next) longer than the objective,
  whatever made it long: a prefill, a trainer launch, a re-partition, host work; nothing is left out;
- ``violation_rate`` = violating intervals / all intervals;
- ``tpot_attainment`` = the fraction of requests with at least 2 output tokens whose own TPOT (first token
  to last, so far for those still running or cut off at the end) meets the objective;
- a request's **TTFT** is arrival to first token; one without a first token (still queued or mid-prefill,
  or cut off at the end) counts with its wait so far, so a load a policy cannot keep up with shows in the
  TTFT figures instead of leaving them;
- ``ttft_attainment`` (with a TTFT objective) = the fraction of requests whose TTFT, or wait so far, meets it;
- ``preemptions`` counts the times a request lost its KV cache (recomputed later), and ``longest_wait``
  names the request with the longest wait between two of its tokens (what a client saw stall the most);
- a policy is **clean** when ``tpot_attainment >= ATTAINMENT_BAR`` and ``violation_rate <= RATE_BAR``
  (``tpot_clean``) and, with a TTFT objective, ``ttft_attainment >= ATTAINMENT_BAR``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from harli_train.engine.metrics import EngineMetrics, RequestRecord, percentiles, request_record
from harli_train.engine.sequence import Sequence

ATTAINMENT_BAR = 0.99
RATE_BAR = 0.001


def objective_stats(
    metrics: EngineMetrics,
    tpot_s: float,
    running: Iterable[Sequence] = (),
    ttft_s: float | None = None,
    waiting: Iterable[Sequence] = (),
    now: float | None = None,
) -> dict[str, Any]:
    """Objective figures over every request ``metrics`` recorded and the ``running`` and ``waiting`` ones so
    far (those without a first token count their wait up to ``now``, the engine's clock; without ``now``
    they are left out of the TTFT figures); with a TTFT objective ``ttft_s``, its attainment, which
    ``clean`` then holds too."""
    running, waiting = list(running), list(waiting)
    records = [r for r in metrics.requests if r.finish_reason != "refused"]
    records += [request_record(s, metrics.t0, now) for s in (*running, *waiting)]
    intervals = np.frombuffer(metrics.intervals, dtype=np.float64) if len(metrics.intervals) else np.zeros(0)
    extra = [np.diff(np.asarray(s.token_times)) for s in running if len(s.token_times) > 1]
    if extra:
        intervals = np.concatenate([intervals, *extra])
    tpot_ms = tpot_s * 1e3
    violations = int((intervals > tpot_s).sum())
    judged = [r.tpot_ms for r in records if r.output_tokens >= 2 and r.tpot_ms is not None]
    attainment = sum(t <= tpot_ms for t in judged) / len(judged) if judged else None
    rate = violations / intervals.size if intervals.size else None
    ttfts = [r.ttft_ms if r.ttft_ms is not None else r.latency_ms for r in records]
    ttfts = [t for t in ttfts if t is not None]
    ttft_met = None
    if ttft_s is not None and ttfts:
        ttft_met = sum(t <= ttft_s * 1e3 for t in ttfts) / len(ttfts)
    tpot_clean = attainment is not None and attainment >= ATTAINMENT_BAR and (rate or 0.0) <= RATE_BAR
    ttft_clean = ttft_s is None or ttft_met is None or ttft_met >= ATTAINMENT_BAR
    return {
        "objective_tpot_ms": tpot_ms,
        "intervals": int(intervals.size),
        "violations": violations,
        "violation_rate": rate,
        "tpot_attainment": attainment,
        "requests_judged": len(judged),
        "requests_missing_tpot": sum(t > tpot_ms for t in judged),
        "tpot_clean": tpot_clean,
        "clean": tpot_clean and ttft_clean,
        "ttft_ms": percentiles(ttfts),
        "requests_without_first_token": sum(r.ttft_ms is None for r in records),
        **({} if ttft_s is None else {"objective_ttft_ms": ttft_s * 1e3, "ttft_attainment": ttft_met}),
        "tpot_ms": percentiles(judged),
        "token_interval_ms": percentiles(intervals * 1e3),
        "preemptions": sum(r.preemptions for r in records),
        "longest_wait": _longest_wait(records),
    }


def _longest_wait(records: list[RequestRecord]) -> dict[str, Any] | None:
    """The request whose wait between two of its tokens was the longest (None before any has two)."""
    waited = [r for r in records if r.max_interval_ms is not None]
    if not waited:
        return None
    r = max(waited, key=lambda r: r.max_interval_ms)
    return {
        "request_id": r.request_id,
        "arrival_s": r.arrival_s,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "preemptions": r.preemptions,
        "finish_reason": r.finish_reason,
        "max_interval_ms": r.max_interval_ms,
    }
