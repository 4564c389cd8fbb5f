"""Regenerate the shipped traces: `python recipes/traces/make_traces.py` (deterministic; seeds below).

steady.jsonl: Poisson arrivals at 2 requests/s for 60 s.
bursty.jsonl: 0.5 requests/s, except 8 requests/s during the first 4 s of every 20 s window, for 60 s.
varying.jsonl: 90 s that ramp: 0.5 requests/s for 25 s, up to 8 over 10 s, 8 for 20 s, down to 0.5 over 10 s,
0.5 for 25 s (one window of the co-location bench: what a fixed split must be provisioned for).
All three draw prompt lengths from a lognormal with median 512 tokens (sigma 0.5, clipped to 64-1536) and
output lengths from a lognormal with median 128 (sigma 0.5, clipped to 16-512), the shape of chat traffic.
longctx.jsonl: long-context bursts for the page pool: 0.2 requests/s, except 16 requests/s during the first
4 s of every 30 s window, for 90 s; prompts uniform in 4096-7680 tokens, outputs 128-384 (at most 8064
tokens a request). Sized for Llama-3-8B (128 KiB of bf16 K/V a token): a burst brings ~64 requests of
~5.9k tokens, ~46 GiB of KV cache once the engine's 64 sequences are admitted, which on an H200 beside the
trainer of recipes/llama-8b-lora.yaml (its stashes ~40 GiB at batch 4 x 1024) under a pool of ~80 GiB
(``colocation.memory_gib``, as bench/bench_pool.py sets it) must take pages from the trainer's working set.

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


LONG_PROMPT, LONG_OUTPUT = "uniform:4096:7680", "uniform:128:384"


def longctx() -> list[TraceRequest]:
    return poisson_trace(
        0.2, 90.0, LONG_PROMPT, LONG_OUTPUT, seed=4, burst_rate=16.0, burst_every_s=30.0, burst_len_s=4.0
    )


GENERATORS = {"steady": steady, "bursty": bursty}  # the traces a longer duration lengthens


def main() -> None:
    made = {"steady": steady(), "bursty": bursty(), "varying": varying(), "longctx": longctx()}
    headers = {
        "steady": f"steady: Poisson 2 req/s for 60 s; prompt {PROMPT}, output {OUTPUT}; "
        "made by recipes/traces/make_traces.py (seed 1)",
        "bursty": f"bursty: 0.5 req/s with 8 req/s bursts (first 4 s of every 20 s) for 60 s; prompt {PROMPT}, "
        f"output {OUTPUT}; made by recipes/traces/make_traces.py (seed 2)",
        "varying": f"varying: rate knots (s, req/s) {list(VARYING)}, linear between; prompt {PROMPT}, "
        f"output {OUTPUT}; made by recipes/traces/make_traces.py (seed 3)",
        "longctx": f"longctx: 0.2 req/s with 16 req/s bursts (first 4 s of every 30 s) for 90 s; prompt "
        f"{LONG_PROMPT}, output {LONG_OUTPUT}; made by recipes/traces/make_traces.py (seed 4)",
    }
    for name, reqs in made.items():
        write_trace(HERE / f"{name}.jsonl", reqs, headers[name])
        print(
            f"{name}: {len(reqs)} requests, {sum(r.prompt_len for r in reqs)} prompt tokens, "
            f"{sum(r.output_len for r in reqs)} output tokens"
        )


if __name__ == "__main__":
    main()
