"""Regenerate the shipped traces: `python recipes/traces/make_traces.py` (deterministic; seeds below).

steady.jsonl: Poisson arrivals at 2 requests/s for 60 s.
bursty.jsonl: 0.5 requests/s, except 8 requests/s during the first 4 s of every 20 s window, for 60 s.
varying.jsonl: 90 s that ramp: 0.5 requests/s for 25 s, up to 8 over 10 s, 8 for 20 s, down to 0.5 over 10 s,
0.5 for 25 s (one window of the co-location bench: what a fixed split must be provisioned for).
All draw prompt lengths from a lognormal with median 512 tokens (sigma 0.5, clipped to 64-1536) and output
lengths from a lognormal with median 128 (sigma 0.5, clipped to 16-512), the shape of chat traffic.

``steady`` and ``bursty`` take a duration: a longer one draws the same arrival times up to the shipped 60 s
and more after them, but other lengths (they are drawn after all the arrivals), so a shipped trace is
lengthened by appending the longer draw's arrivals past its end to its own requests.
"""

from __future__ import annotations

from pathlib import Path

from harli_train.engine.load import TraceRequest, poisson_trace, rate_profile_trace, write_trace

HERE = Path(__file__).parent
PROMPT = "lognormal:512:0.5:64:1536"
OUTPUT = "lognormal:128:0.5:16:512"
VARYING = ((0.0, 0.5), (25.0, 0.5), (35.0, 8.0), (55.0, 8.0), (65.0, 0.5), (90.0, 0.5))
DURATION_S = {"steady": 60.0, "bursty": 60.0, "varying": VARYING[-1][0]}  # of the shipped files


def steady(duration_s: float = DURATION_S["steady"]) -> list[TraceRequest]:
    return poisson_trace(2.0, duration_s, PROMPT, OUTPUT, seed=1)


def bursty(duration_s: float = DURATION_S["bursty"]) -> list[TraceRequest]:
    return poisson_trace(
        0.5, duration_s, PROMPT, OUTPUT, seed=2, burst_rate=8.0, burst_every_s=20.0, burst_len_s=4.0
    )


def varying() -> list[TraceRequest]:
    return rate_profile_trace(VARYING, PROMPT, OUTPUT, seed=3)


GENERATORS = {"steady": steady, "bursty": bursty}  # the traces a longer duration lengthens


def main() -> None:
    made = {"steady": steady(), "bursty": bursty(), "varying": varying()}
    headers = {
        "steady": f"steady: Poisson 2 req/s for 60 s; prompt {PROMPT}, output {OUTPUT}; "
        "made by recipes/traces/make_traces.py (seed 1)",
        "bursty": f"bursty: 0.5 req/s with 8 req/s bursts (first 4 s of every 20 s) for 60 s; prompt {PROMPT}, "
        f"output {OUTPUT}; made by recipes/traces/make_traces.py (seed 2)",
        "varying": f"varying: rate knots (s, req/s) {list(VARYING)}, linear between; prompt {PROMPT}, "
        f"output {OUTPUT}; made by recipes/traces/make_traces.py (seed 3)",
    }
    for name, reqs in made.items():
        write_trace(HERE / f"{name}.jsonl", reqs, headers[name])
        print(
            f"{name}: {len(reqs)} requests, {sum(r.prompt_len for r in reqs)} prompt tokens, "
            f"{sum(r.output_len for r in reqs)} output tokens"
        )


if __name__ == "__main__":
    main()
