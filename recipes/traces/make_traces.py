"""Regenerate the shipped traces: `python recipes/traces/make_traces.py` (deterministic; seeds below).

steady.jsonl: Poisson arrivals at 2 requests/s for 60 s.
bursty.jsonl: 0.5 requests/s, except 8 requests/s during the first 4 s of every 20 s window, for 60 s.
varying.jsonl: 90 s that ramp: 0.5 requests/s for 25 s, up to 8 over 10 s, 8 for 20 s, down to 0.5 over 10 s,
0.5 for 25 s (one window of the co-location bench: what a fixed split must be provisioned for).
Both draw prompt lengths from a lognormal with median 512 tokens (sigma 0.5, clipped to 64-1536) and output
lengths from a lognormal with median 128 (sigma 0.5, clipped to 16-512), the shape of chat traffic.
"""

from __future__ import annotations

from pathlib import Path

from harli_train.engine.load import poisson_trace, rate_profile_trace, write_trace

HERE = Path(__file__).parent
PROMPT = "lognormal:512:0.5:64:1536"
OUTPUT = "lognormal:128:0.5:16:512"
VARYING = ((0.0, 0.5), (25.0, 0.5), (35.0, 8.0), (55.0, 8.0), (65.0, 0.5), (90.0, 0.5))


def main() -> None:
    steady = poisson_trace(2.0, 60.0, PROMPT, OUTPUT, seed=1)
    write_trace(
        HERE / "steady.jsonl",
        steady,
        f"steady: Poisson 2 req/s for 60 s; prompt {PROMPT}, output {OUTPUT}; "
        "made by recipes/traces/make_traces.py (seed 1)",
    )
    bursty = poisson_trace(
        0.5, 60.0, PROMPT, OUTPUT, seed=2, burst_rate=8.0, burst_every_s=20.0, burst_len_s=4.0
    )
    write_trace(
        HERE / "bursty.jsonl",
        bursty,
        f"bursty: 0.5 req/s with 8 req/s bursts (first 4 s of every 20 s) for 60 s; prompt {PROMPT}, "
        f"output {OUTPUT}; made by recipes/traces/make_traces.py (seed 2)",
    )
    varying = rate_profile_trace(VARYING, PROMPT, OUTPUT, seed=3)
    write_trace(
        HERE / "varying.jsonl",
        varying,
        f"varying: rate knots (s, req/s) {list(VARYING)}, linear between; prompt {PROMPT}, output {OUTPUT}; "
        "made by recipes/traces/make_traces.py (seed 3)",
    )
    for name, reqs in (("steady", steady), ("bursty", bursty), ("varying", varying)):
        print(
            f"{name}: {len(reqs)} requests, {sum(r.prompt_len for r in reqs)} prompt tokens, "
            f"{sum(r.output_len for r in reqs)} output tokens"
        )


if __name__ == "__main__":
    main()
