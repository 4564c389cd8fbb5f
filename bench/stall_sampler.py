"""Diagnosis: where the decode loop and the trainer thread are when the decode loop stalls on the host.

A daemon thread wakes every ``period_s`` and records, per Python thread, the top frames of its stack
(``file:line function``) and how late it woke. A late wake-up means the GIL was held without a switch (a C call
that does not release it); a decode thread caught mid-stall in a frame of its own while the sampler woke on
time means decode was blocked in a call that released the GIL (a driver call, a lock). ``around`` returns the
samples inside given time spans, on the runtime's clock (seconds from ``t0``), and the first one after each:
a span with no sample inside and a late one after it held the sampler too (the GIL held throughout, or the
whole process descheduled). ``HostCounters`` reads what the OS says of the window: the CPU time the
hypervisor stole from the machine and the decode thread's involuntary context switches.

Sampling costs the GIL every period: it perturbs what it measures a little, so only diagnostic runs use it
(``bench_colocate.py --sample-stalls``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any


def top_frames(frame: Any, depth: int) -> list[str]:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return out


class StallSampler:
    def __init__(self, period_s: float = 1e-3, depth: int = 8, keep: int = 20000) -> None:
        self.period_s, self.depth = period_s, depth
        self.samples: deque[tuple[float, float, dict[str, list[str]]]] = deque(maxlen=keep)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-sampler", daemon=True)

    def __enter__(self) -> StallSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            due = time.perf_counter() + self.period_s
            time.sleep(self.period_s)
            now = time.perf_counter()
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = {
                names.get(ident, f"thread-{ident}"): top_frames(frame, self.depth)
                for ident, frame in sys._current_frames().items()
                if ident != me
            }
            self.samples.append((now, now - due, stacks))

    def around(self, spans: list[tuple[float, float]], t0: float, limit: int = 40) -> list[dict[str, Any]]:
        """The samples inside each (start, end) span (runtime seconds), at most ``limit`` per span."""
        out = []
        for start, end in spans:
            inside = [s for s in self.samples if start <= s[0] - t0 <= end]
            after = next((s for s in self.samples if s[0] - t0 > end), None)
            out.append(
                {
                    "span": [round(start, 4), round(end, 4)],
                    "samples": [
                        {"t": round(t - t0, 4), "late_ms": round(1e3 * late, 2), "stacks": stacks}
                        for t, late, stacks in inside[:limit]
                    ],
                    "after": None
                    if after is None
                    else {"t": round(after[0] - t0, 4), "late_ms": round(1e3 * after[1], 2)},
                }
            )
        return out


class HostCounters:
    """What the OS counts for the calling thread and the machine, from ``start()`` to ``delta()``: the CPU
    time the hypervisor stole from every CPU together (``steal_s``, /proc/stat; 0 on bare metal) and this
    thread's voluntary and involuntary context switches (/proc/thread-self/status). Empty where /proc
    lacks them."""

    def start(self) -> HostCounters:
        self._first = self._read()
        return self

    def delta(self) -> dict[str, float]:
        now = self._read()
        return {k: round(now[k] - self._first[k], 3) for k in now if k in self._first}

    @staticmethod
    def _read() -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal ...
            if fields[0] == "cpu" and len(fields) > 8:
                out["steal_s"] = int(fields[8]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open("/proc/thread-self/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                        out[key] = int(value)
        except (OSError, ValueError):
            pass
        return out


def stall_spans(rows: list[dict[str, Any]], min_gap_s: float = 2.5e-3) -> list[tuple[float, float]]:
    """Host stalls of the decode loop in a window's step rows, as (start, end) on the runtime clock:
    between decode steps (token interval less the step's latency), inside a decode step (its latency less its
    GPU span), and the launch of any engine step that took over ``min_gap_s`` (``launch_s``). A launch's
    span runs from that long before the row before it ended (a step launched ahead of its predecessor's
    tokens launches while that one runs) to its own row's end, so it holds the launch either way."""
    spans = []
    prev_t: float | None = None
    for r in rows:
        launch = r.get("launch_s")
        if launch is not None and launch > min_gap_s and r.get("kind") in ("decode", "mixed", "prefill"):
            start = (prev_t if prev_t is not None else r["t"]) - launch - min_gap_s
            spans.append((start, r["t"]))
        prev_t = r["t"]
        if r.get("kind") != "decode":
            continue
        measured, gpu, interval = r.get("measured_s"), r.get("gpu_s"), r.get("interval_s")
        if interval is not None and measured is not None and interval - measured > min_gap_s:
            spans.append((r["t"] - interval, r["t"] - measured))
        if gpu is not None and measured is not None and measured - gpu > min_gap_s:
            spans.append((r["t"] - measured, r["t"]))
    return spans
