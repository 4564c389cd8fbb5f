"""Serving metrics: per request (TTFT, TPOT, tokens), per step (batch, KV tokens, latency), every token
interval a client saw, p50/p99."""

from __future__ import annotations

import json
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harli_train.engine.sequence import Sequence


@dataclass(slots=True)
class StepRecord:
    step: int
    start_s: float  # since the metrics' start
    kind: str  # "decode", "mixed" or "prefill"
    partition: str
    num_seqs: int
    num_tokens: int  # tokens computed (prefill chunk tokens, or one per sequence)
    kv_tokens: int  # tokens in the cache of the step's sequences after the step
    latency_ms: float
    free_blocks: int
    preempted: int


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None  # (last token - first token) / (output tokens - 1)
    latency_ms: float | None
    finish_reason: str  # "eos", "length", "refused" or "aborted" (still queued or running at the end)
    preemptions: int
    error: str | None = None
    max_interval_ms: float | None = None  # the longest wait between two of its tokens


def percentiles(values: Any) -> dict[str, float | None]:
    """p50 / p99 / mean / max of `values` (a sequence or array; None when empty)."""
    if len(values) == 0:
        return {"p50": None, "p99": None, "mean": None, "max": None, "count": 0}
    a = np.asarray(values, dtype=np.float64)
    return {
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
        "max": float(a.max()),
        "count": len(values),
    }


def request_record(seq: Sequence, t0: float, now: float | None = None) -> RequestRecord:
    """A request's record: TTFT from arrival, TPOT and the longest wait over the tokens drawn so far; its
    latency to its finish, or for one not finished to ``now`` (None without it)."""
    first, n_out, times = seq.first_token_time, seq.num_completion_tokens, seq.token_times
    last = times[-1] if times else None
    end = seq.finish_time if seq.finish_time is not None else now
    ms = lambda a, b: None if a is None or b is None else (b - a) * 1e3
    tpot = ms(first, last) / (n_out - 1) if n_out > 1 and first is not None else None
    longest = max((b - a for a, b in zip(times, times[1:], strict=False)), default=None)
    return RequestRecord(
        seq.request_id,
        seq.arrival_time - t0,
        seq.num_prompt_tokens,
        n_out,
        ms(seq.arrival_time, first),
        tpot,
        ms(seq.arrival_time, end),
        seq.finish_reason or "",
        seq.num_preemptions,
        seq.error,
        None if longest is None else longest * 1e3,
    )


class EngineMetrics:
    """Collects records while the engine runs; `summary()` and `write()` report them.

    `intervals` holds every token interval of every recorded request (seconds from one of its tokens to the
    next, whatever the steps between them were), the figure a streaming client's TPOT is made of."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.steps: list[StepRecord] = []
        self.requests: list[RequestRecord] = []
        self.intervals = array("d")

    def add_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def add_finished(self, seq: Sequence) -> None:
        """Record a request that ended (finished, refused, or aborted with the tokens it had so far)."""
        self.requests.append(request_record(seq, self.t0))
        times = seq.token_times
        self.intervals.extend(b - a for a, b in zip(times, times[1:], strict=False))

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.requests if r.finish_reason != "refused"]
        decode = [s for s in self.steps if s.kind == "decode"]
        mixed = [s for s in self.steps if s.kind == "mixed"]
        prefill = [s for s in self.steps if s.kind == "prefill"]
        span_s = 0.0
        if self.steps:
            span_s = self.steps[-1].start_s + self.steps[-1].latency_ms / 1e3 - self.steps[0].start_s
        out_tokens = sum(r.output_tokens for r in done)
        return {
            "requests": len(done),
            "refused": len(self.requests) - len(done),
            "aborted": sum(r.finish_reason == "aborted" for r in done),
            "preemptions": sum(r.preemptions for r in done),
            "output_tokens": out_tokens,
            "prompt_tokens": sum(r.prompt_tokens for r in done),
            "span_s": span_s,
            "output_tokens_per_s": out_tokens / span_s if span_s > 0 else None,
            "ttft_ms": percentiles([r.ttft_ms for r in done if r.ttft_ms is not None]),
            "tpot_ms": percentiles([r.tpot_ms for r in done if r.tpot_ms is not None]),
            "latency_ms": percentiles([r.latency_ms for r in done if r.latency_ms is not None]),
            "token_interval_ms": percentiles([1e3 * x for x in self.intervals]),
            "decode_step_ms": percentiles([s.latency_ms for s in decode]),
            "mixed_step_ms": percentiles([s.latency_ms for s in mixed]),
            "prefill_step_ms": percentiles([s.latency_ms for s in prefill]),
            "decode_batch": percentiles([float(s.num_seqs) for s in decode]),
            "kv_tokens": percentiles([float(s.kv_tokens) for s in decode]),
            "steps": {"decode": len(decode), "mixed": len(mixed), "prefill": len(prefill)},
        }

    def write(self, out_dir: str | Path) -> dict[str, Any]:
        """Write requests.jsonl, steps.jsonl and summary.json under `out_dir`; returns the summary."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "requests.jsonl", "w") as f:
            for r in self.requests:
                f.write(json.dumps(asdict(r)) + "\n")
        with open(out / "steps.jsonl", "w") as f:
            for s in self.steps:
                f.write(json.dumps(asdict(s)) + "\n")
        summary = self.summary()
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
