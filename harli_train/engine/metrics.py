"""Serving metrics: per request (TTFT, TPOT, tokens), per step (batch, KV tokens, latency), p50/p99."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harli_train.engine.sequence import Sequence


@dataclass(slots=True)
class StepRecord:
    step: int
    start_s: float  # since the metrics' start
    kind: str  # "prefill" | "decode"
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
    tpot_ms: float | None  # (finish - first token) / (output tokens - 1)
    latency_ms: float | None
    finish_reason: str
    preemptions: int
    error: str | None = None


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p99 / mean / max of `values` (None when empty)."""
    if not values:
        return {"p50": None, "p99": None, "mean": None, "max": None, "count": 0}
    a = np.asarray(values, dtype=np.float64)
    return {
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
        "max": float(a.max()),
        "count": len(values),
    }


class EngineMetrics:
    """Collects records while the engine runs; `summary()` and `write()` report them."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.steps: list[StepRecord] = []
        self.requests: list[RequestRecord] = []
        self._tpots_ms: list[float] = []  # of the finished requests that have one, in finishing order

    def add_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def add_finished(self, seq: Sequence) -> None:
        first, end, n_out = seq.first_token_time, seq.finish_time, seq.num_completion_tokens
        ms = lambda a, b: None if a is None or b is None else (b - a) * 1e3
        tpot = ms(first, end) / (n_out - 1) if n_out > 1 and first is not None and end is not None else None
        if tpot is not None and seq.finish_reason != "refused":
            self._tpots_ms.append(tpot)
        self.requests.append(
            RequestRecord(
                seq.request_id,
                seq.arrival_time - self.t0,
                seq.num_prompt_tokens,
                n_out,
                ms(seq.arrival_time, first),
                tpot,
                ms(seq.arrival_time, end),
                seq.finish_reason or "",
                seq.num_preemptions,
                seq.error,
            )
        )

    def tpot_ms(self) -> dict[str, float | None]:
        """TPOT percentiles (ms) over every request finished so far: (finish - first token) / (tokens - 1)
        of each, refused requests and those of one token left out. What a live progress line shows and what
        `summary()` reports at the end, so the two always agree on the same requests."""
        return percentiles(self._tpots_ms)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.requests if r.finish_reason != "refused"]
        decode = [s for s in self.steps if s.kind == "decode"]
        prefill = [s for s in self.steps if s.kind == "prefill"]
        span_s = 0.0
        if self.steps:
            span_s = self.steps[-1].start_s + self.steps[-1].latency_ms / 1e3 - self.steps[0].start_s
        out_tokens = sum(r.output_tokens for r in done)
        return {
            "requests": len(done),
            "refused": len(self.requests) - len(done),
            "preemptions": sum(r.preemptions for r in done),
            "output_tokens": out_tokens,
            "prompt_tokens": sum(r.prompt_tokens for r in done),
            "span_s": span_s,
            "output_tokens_per_s": out_tokens / span_s if span_s > 0 else None,
            "ttft_ms": percentiles([r.ttft_ms for r in done if r.ttft_ms is not None]),
            "tpot_ms": self.tpot_ms(),
            "latency_ms": percentiles([r.latency_ms for r in done if r.latency_ms is not None]),
            "decode_step_ms": percentiles([s.latency_ms for s in decode]),
            "prefill_step_ms": percentiles([s.latency_ms for s in prefill]),
            "decode_batch": percentiles([float(s.num_seqs) for s in decode]),
            "kv_tokens": percentiles([float(s.kv_tokens) for s in decode]),
            "steps": {"decode": len(decode), "prefill": len(prefill)},
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
