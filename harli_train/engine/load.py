"""Request load: trace files (JSONL), synthetic Poisson arrivals, and a replay clock that releases them.

A trace line is one request: {"arrival_s": 0.25, "prompt": "text" | "prompt_len": 512, "output_len": 128}
(optional "id", and "model": the model id it asks for, e.g. a co-located run's live adapter; default the
base). `arrival_time` and `max_tokens` are accepted for `arrival_s` and `output_len`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harli_train.engine.engine_config import EngineError


class TraceError(EngineError):
    """A trace or load description that cannot be used: names the file, line and key."""


@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    output_len: int
    prompt: str | None = None
    prompt_len: int | None = None
    request_id: str | None = None
    model: str | None = None  # None: the base model

    def to_json(self) -> str:
        d = {
            "arrival_s": self.arrival_s,
            "prompt": self.prompt,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "id": self.request_id,
            "model": self.model,
        }
        return json.dumps({k: v for k, v in d.items() if v is not None})


def _field(d: dict, where: str, *names: str, required: bool = True) -> Any:
    for name in names:
        if name in d:
            return d[name]
    if required:
        raise TraceError(f"{where}: missing key {names[0]!r}")
    return None


def parse_request(d: dict, where: str) -> TraceRequest:
    arrival = _field(d, where, "arrival_s", "arrival_time")
    output_len = _field(d, where, "output_len", "max_tokens")
    prompt = _field(d, where, "prompt", required=False)
    prompt_len = _field(d, where, "prompt_len", required=False)
    if not isinstance(arrival, (int, float)) or arrival < 0:
        raise TraceError(f"{where}: arrival_s must be a number >= 0, got {arrival!r}")
    if not isinstance(output_len, int) or output_len < 1:
        raise TraceError(f"{where}: output_len must be an integer >= 1, got {output_len!r}")
    if (prompt is None) == (prompt_len is None):
        raise TraceError(f"{where}: give exactly one of 'prompt' (text) and 'prompt_len' (tokens)")
    if prompt is not None and not isinstance(prompt, str):
        raise TraceError(f"{where}: prompt must be a string, got {type(prompt).__name__}")
    if prompt_len is not None and (not isinstance(prompt_len, int) or prompt_len < 1):
        raise TraceError(f"{where}: prompt_len must be an integer >= 1, got {prompt_len!r}")
    model = d.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise TraceError(f"{where}: model must be a non-empty string (a served model id), got {model!r}")
    rid = d.get("id")
    return TraceRequest(
        float(arrival), output_len, prompt, prompt_len, None if rid is None else str(rid), model
    )


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Requests of a JSONL trace, sorted by arrival (blank lines and `#` comments skipped)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace {path}: file not found")
    out = []
    for n, line in enumerate(_text_lines(path), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise TraceError(f"{path}:{n}: expected a JSON object")
        out.append(parse_request(d, f"{path}:{n}"))
    if not out:
        raise TraceError(f"trace {path}: no requests")
    for i, r in enumerate(out):
        if r.request_id is None:
            r.request_id = str(i)  # the line's order among the requests
    out.sort(key=lambda r: r.arrival_s)
    return out


def _text_lines(path: Path) -> list[str]:
    """The file's lines as text; TraceError naming the line of the first byte that is not UTF-8."""
    with path.open("rb") as f:
        raw_lines = f.read().split(b"\n")
    lines = []
    for n, raw in enumerate(raw_lines, 1):
        try:
            lines.append(raw.decode("utf-8-sig" if n == 1 else "utf-8"))  # a leading BOM is tolerated
        except UnicodeDecodeError as e:
            raise TraceError(
                f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start} of the line)"
            ) from None
    return lines


def write_trace(path: str | Path, requests: list[TraceRequest], header: str = "") -> None:
    lines = [f"# {h}" for h in header.splitlines()] + [r.to_json() for r in requests]
    Path(path).write_text("\n".join(lines) + "\n")


@dataclass(slots=True)
class LengthDist:
    """A token-length distribution: 'fixed' (mean), 'uniform' [low, high], or 'lognormal' (median mean,
    shape sigma) clipped to [low, high]. Parsed from an int, "uniform:64:512", "lognormal:512:0.6:64:2048"."""

    kind: str
    mean: float = 0.0
    low: int = 1
    high: int = 1 << 20
    sigma: float = 0.5

    @classmethod
    def parse(cls, spec: int | str | dict | LengthDist, what: str = "length") -> LengthDist:
        if isinstance(spec, LengthDist):
            return spec
        if isinstance(spec, int):
            return cls("fixed", mean=spec, low=spec, high=spec)
        if isinstance(spec, dict):
            return cls(**spec)
        parts = str(spec).split(":")
        try:
            if parts[0] == "uniform" and len(parts) == 3:
                return cls("uniform", low=int(parts[1]), high=int(parts[2]))
            if parts[0] == "lognormal" and len(parts) in (3, 5):
                lo, hi = (int(parts[3]), int(parts[4])) if len(parts) == 5 else (1, 1 << 20)
                return cls("lognormal", mean=float(parts[1]), sigma=float(parts[2]), low=lo, high=hi)
            if len(parts) == 1:
                return cls.parse(int(parts[0]))
        except ValueError:
            pass
        raise TraceError(
            f"{what} {spec!r}: expected N, 'uniform:LOW:HIGH' or 'lognormal:MEDIAN:SIGMA[:LOW:HIGH]'"
        )

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.mean)
        elif self.kind == "uniform":
            x = rng.integers(self.low, self.high + 1, n)
        elif self.kind == "lognormal":
            x = np.exp(np.log(self.mean) + self.sigma * rng.standard_normal(n))
        else:
            raise TraceError(f"length distribution kind {self.kind!r}: expected fixed, uniform or lognormal")
        return np.clip(np.round(x), max(1, self.low), self.high).astype(np.int64)


def poisson_trace(
    rate: float,
    duration_s: float,
    prompt_len: int | str | LengthDist,
    output_len: int | str | LengthDist,
    seed: int = 0,
    burst_rate: float | None = None,
    burst_every_s: float = 20.0,
    burst_len_s: float = 4.0,
) -> list[TraceRequest]:
    """Poisson arrivals at `rate` req/s for `duration_s`; with `burst_rate`, the rate is `burst_rate` during
    the first `burst_len_s` of every `burst_every_s` window (on/off modulated Poisson, drawn by thinning)."""
    if rate <= 0 or duration_s <= 0:
        raise TraceError(f"synthetic load: rate ({rate}) and duration_s ({duration_s}) must be > 0")

    def rate_at(t: float) -> float:
        return burst_rate if burst_rate is not None and (t % burst_every_s) < burst_len_s else rate

    return _thinned_trace(rate_at, max(rate, burst_rate or 0.0), duration_s, prompt_len, output_len, seed)


def rate_profile_trace(
    knots: Sequence[tuple[float, float]],
    prompt_len: int | str | LengthDist,
    output_len: int | str | LengthDist,
    seed: int = 0,
) -> list[TraceRequest]:
    """Poisson arrivals whose rate follows `knots` [(seconds, requests/s), ...], linear between knots, from
    the first knot's time to the last's (a load that ramps up and down)."""
    times = [t for t, _ in knots]
    rates = [r for _, r in knots]
    if len(knots) < 2 or times != sorted(times) or min(rates) < 0 or max(rates) <= 0:
        raise TraceError(f"rate profile {list(knots)}: want >= 2 knots in time order with rates >= 0")
    return _thinned_trace(
        lambda t: float(np.interp(t, times, rates)), max(rates), times[-1], prompt_len, output_len, seed
    )


def _thinned_trace(
    rate_at: Callable[[float], float],
    peak: float,
    duration_s: float,
    prompt_len: int | str | LengthDist,
    output_len: int | str | LengthDist,
    seed: int,
) -> list[TraceRequest]:
    """Arrivals of a Poisson process of rate `rate_at(t)` <= `peak` over [0, duration_s), by thinning, and
    their lengths."""
    rng = np.random.default_rng(seed)
    t, times = 0.0, []
    while True:
        t += rng.exponential(1.0 / peak)
        if t >= duration_s:
            break
        if rng.random() < rate_at(t) / peak:
            times.append(t)
    p = LengthDist.parse(prompt_len, "prompt_len").sample(rng, len(times))
    o = LengthDist.parse(output_len, "output_len").sample(rng, len(times))
    return [
        TraceRequest(round(a, 4), int(b), prompt_len=int(c), request_id=str(i))
        for i, (a, b, c) in enumerate(zip(times, o, p, strict=True))
    ]


def synthetic_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """Random token ids for a `prompt_len` request, avoiding the special ids at the top of the vocabulary
    (and, for byte-level vocabularies, everything but the 256 byte ids)."""
    high = 256 if vocab_size <= 1024 else vocab_size - 1024
    return np.random.default_rng(seed).integers(0, high, length).tolist()


class TraceReplay:
    """Releases requests as a clock passes their arrival times (scaled by `time_scale`)."""

    def __init__(self, requests: list[TraceRequest], time_scale: float = 1.0):
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.time_scale = time_scale
        self.next = 0

    @property
    def exhausted(self) -> bool:
        return self.next >= len(self.requests)

    def next_arrival_s(self) -> float | None:
        return None if self.exhausted else self.requests[self.next].arrival_s * self.time_scale

    def due(self, elapsed_s: float) -> list[TraceRequest]:
        """Requests whose (scaled) arrival is at or before `elapsed_s` and not yet released."""
        out = []
        while not self.exhausted and self.requests[self.next].arrival_s * self.time_scale <= elapsed_s:
            out.append(self.requests[self.next])
            self.next += 1
        return out
