"""The server's metrics in the Prometheus text exposition format (version 0.0.4), kept by the HTTP handlers:
requests and tokens by kind, errors by status, TTFT and TPOT histograms, the engine's queue, and any figures
the caller adds (the co-located trainer's tokens/s, SM shares, objective violations)."""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any

BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class Histogram:
    """Cumulative buckets over ``BUCKETS_S`` (seconds), their sum and count."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip([*BUCKETS_S, float("inf")], self.counts, strict=True):
            running += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        return out + [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class ServerMetrics:
    """Counters and histograms of the requests served; one instance per server, used from its event loop."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (kind, state) -> n
        self.tokens: Counter[str] = Counter()  # prompt / completion
        self.errors: Counter[int] = Counter()  # HTTP status -> n
        self.ttft, self.tpot = Histogram(), Histogram()

    def started(self, kind: str) -> None:
        self.requests[(kind, "started")] += 1

    def finished(
        self, kind: str, prompt: int, completion: int, t0: float, first: float | None, end: float
    ) -> None:
        self.requests[(kind, "finished")] += 1
        self.tokens["prompt"] += prompt
        self.tokens["completion"] += completion
        if first is not None:
            self.ttft.observe(first - t0)
            if completion > 1:
                self.tpot.observe((end - first) / (completion - 1))

    def count_error(self, status: int) -> None:
        self.errors[status] += 1

    def render(self, engine: dict[str, Any], extra: dict[str, float]) -> str:
        """The exposition text: engine figures from ``engine`` (waiting, running), ``extra`` as gauges."""
        lines = [
            "# HELP harli_requests_total Requests by endpoint kind and state.",
            "# TYPE harli_requests_total counter",
        ]
        lines += [
            f'harli_requests_total{{kind="{k}",state="{s}"}} {n}'
            for (k, s), n in sorted(self.requests.items())
        ]
        lines += ["# HELP harli_tokens_total Tokens by kind.", "# TYPE harli_tokens_total counter"]
        lines += [f'harli_tokens_total{{kind="{k}"}} {n}' for k, n in sorted(self.tokens.items())]
        lines += [
            "# HELP harli_errors_total Refused requests by HTTP status.",
            "# TYPE harli_errors_total counter",
        ]
        lines += [f'harli_errors_total{{status="{s}"}} {n}' for s, n in sorted(self.errors.items())]
        for name, hist, what in (("harli_ttft_seconds", self.ttft, "Time to first token"),
                                 ("harli_tpot_seconds", self.tpot, "Time per output token")):  # fmt: skip
            lines += [f"# HELP {name} {what}, at the server.", f"# TYPE {name} histogram", *hist.lines(name)]
        gauges = {
            "harli_queue_waiting": engine.get("waiting", 0),
            "harli_requests_running": engine.get("running", 0),
        }
        for name, value in {**gauges, **extra}.items():
            lines += [f"# TYPE {name} gauge", f"{name} {float(value):g}"]
        return "\n".join(lines) + "\n"
