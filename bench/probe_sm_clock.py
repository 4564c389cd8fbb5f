"""Probe: why does the trainer's GEMM rate per SM fall as its rung grows? Clock and power per rung.

For each trainer rung of the 16-SM ladder and the whole GPU, runs the trainer's largest GEMM (gate/up,
Llama-3-8B shape, 4 x 1024 tokens) back to back for about a second, alone and beside a decode stand-in on
the rung's inference SMs (a batch-64 GEMV streaming 470 MB of weights, always from HBM). While each burst
runs, a thread reads the SM clock, board power and the clock-event (throttle) reasons from nvidia-smi
(read-only queries). Per rung: GEMM TFLOP/s and TFLOP/s per SM, the stand-in's GB/s, median clock and power.

If the per-SM rate falls with the clock, the loss is the board's power limit (physics); if the clock holds,
it is the kernels' placement on the rung (software). Writes $OUT/probe_sm_clock.json and prints a table.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

import common
import torch

from harli_train.colocate.sm import SMLadder

TOKENS, HIDDEN, INTER = 4096, 4096, 14336
DECODE_BATCH, STANDIN_ROWS = 64, 4 * INTER  # 57344 x 4096 bf16 = 470 MB: far past the 50 MB L2
BURST_S = 1.0
WARM_S = 3.0  # the board's power limiter averages over a window: the first burst would run cold
QUERY = "clocks.sm,power.draw,{reasons}.active"
REASONS = {0x1: "idle", 0x4: "sw_power_cap", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


def smi(fields: str) -> list[str]:
    out = subprocess.run(
        ["nvidia-smi", "-i", "0", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return [f.strip() for f in out.stdout.strip().split(",")]


def reasons_field() -> str:
    """The driver's name for the clock-event reasons ('clocks_throttle_reasons' before the rename)."""
    for name in ("clocks_event_reasons", "clocks_throttle_reasons"):
        if smi(f"{name}.active")[0].startswith("0x"):
            return name
    raise RuntimeError("nvidia-smi reports no clock-event reasons field")


class Sampler:
    """Reads clock, power and event reasons every ~100 ms on a thread until stopped."""

    def __init__(self, reasons: str) -> None:
        self.query = QUERY.format(reasons=reasons)
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            clock, power, reasons = smi(self.query)
            self.samples.append((float(clock), float(power), int(reasons, 16)))
            time.sleep(0.1)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        body = self.samples[1:-1] or self.samples  # the first and last may straddle the burst's edges
        seen = 0
        for *_, r in body:
            seen |= r
        return {
            "sm_clock_mhz": common.median([c for c, _, _ in body]),
            "power_w": common.median([p for _, p, _ in body]),
            "reasons": [name for bit, name in REASONS.items() if seen & bit] or ["none"],
            "samples": len(body),
        }


def burst(jobs: list[tuple[torch.cuda.Stream, Callable[[], object], int]]) -> list[float]:
    """Launch each (stream, fn, n) n times, interleaved; seconds each stream took, while sampling."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in jobs]
    ends = [torch.cuda.Event(enable_timing=True) for _ in jobs]
    for (stream, _, _), ev in zip(jobs, starts, strict=True):
        ev.record(stream)
    left = [n for *_, n in jobs]
    while any(left):
        for i, (stream, fn, _) in enumerate(jobs):
            if left[i]:
                with torch.cuda.stream(stream):
                    fn()
                left[i] -= 1
    for (stream, _, _), ev in zip(jobs, ends, strict=True):
        ev.record(stream)
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends, strict=True)]


def reps_for(stream: torch.cuda.Stream, fn) -> int:
    """How many calls of fn fill about BURST_S on this stream."""
    (t,) = burst([(stream, fn, 3)])
    return max(3, int(BURST_S / (t / 3)))


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16)
    q = torch.randn(DECODE_BATCH, HIDDEN, device=dev, dtype=torch.bfloat16)
    big = torch.randn(STANDIN_ROWS, HIDDEN, device=dev, dtype=torch.bfloat16)
    gemm, gemv = (lambda: x @ w.t()), (lambda: q @ big.t())
    gemm_flops, gemv_bytes = 2 * TOKENS * HIDDEN * 2 * INTER, big.numel() * big.element_size()
    reasons = reasons_field()
    limits = dict(zip(("power_limit_w", "max_sm_clock_mhz"), smi("power.limit,clocks.max.sm"), strict=True))
    whole = torch.cuda.Stream()
    burst([(whole, gemm, int(WARM_S / BURST_S * reps_for(whole, gemm)))])
    rows = []
    with SMLadder.create(step=16) as ladder:
        rungs = [(p.train_sms, p.train_stream, p.infer_sms, p.infer_stream) for p in ladder.spatial]
        rungs.append((ladder.total_sms, whole, 0, None))
        for train_sms, ts, infer_sms, infer_stream in rungs:
            n_gemm = reps_for(ts, gemm)
            modes = [("alone", [(ts, gemm, n_gemm)])]
            if infer_stream is not None:
                modes.append(
                    (
                        "beside_decode",
                        [(ts, gemm, n_gemm), (infer_stream, gemv, reps_for(infer_stream, gemv))],
                    )
                )
            for mode, jobs in modes:
                with Sampler(reasons) as sampler:
                    secs = burst(jobs)
                tflops = gemm_flops * n_gemm / secs[0] / 1e12
                row = {
                    "train_sms": train_sms,
                    "infer_sms": infer_sms,
                    "mode": mode,
                    "gemm_tflops": tflops,
                    "tflops_per_sm": tflops / train_sms,
                    "standin_gbs": gemv_bytes * jobs[1][2] / secs[1] / 1e9 if len(jobs) > 1 else None,
                    **sampler.summary(),
                }
                rows.append(row)
                print(row, flush=True)
    path = common.write_json(
        "probe_sm_clock.json",
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **limits, "rows": rows},
    )
    print(
        f"wrote {path}; power limit {limits['power_limit_w']} W, max SM clock {limits['max_sm_clock_mhz']} MHz"
    )
    keys = ["train_sms", "mode", "gemm_tflops", "tflops_per_sm", "standin_gbs", "sm_clock_mhz", "power_w"]
    table_rows = [[r[k] for k in keys] + [",".join(r["reasons"])] for r in rows]
    print(
        common.table(
            table_rows, ["train SMs", "mode", "TFLOP/s", "per SM", "decode GB/s", "MHz", "W", "reasons"]
        )
    )


if __name__ == "__main__":
    main()
