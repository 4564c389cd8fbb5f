"""The co-location bench's cells: one trace at one load, replayed for one window.

Loads are multiples of a trace's request rate: light, medium and heavy replay its arrivals 1x, 2x and 4x as
fast (``time_scale`` 1/K). A trace whose rate itself ramps (``WHOLE_TRACES``: varying) runs once, whole, at
1x: its one cell is ``varying/1x``.

A window lasts at least ``min_window_s`` and holds at least ``min_requests`` arrivals: it ends on the first
half second after the ``min_requests``-th arrival at its load, or at ``min_window_s``, whichever is later; a
whole trace's window is its length. Where a window runs past the shipped trace (recipes/traces/), the trace
is lengthened with its own generator (recipes/traces/make_traces.py, the same seed): the shipped requests
stay as they are and the generator's arrivals after the shipped length follow them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES_DIR = ROOT / "recipes" / "traces"
sys.path.insert(0, str(TRACES_DIR))
sys.path.insert(0, str(ROOT))
import make_traces  # noqa: E402

from harli_train.engine.load import TraceRequest, read_trace  # noqa: E402

LOADS = {"light": 1.0, "medium": 2.0, "heavy": 4.0}  # multiples of the trace's request rate
TRACES = ("steady", "bursty", "varying")  # the shipped traces a bench call may name
WHOLE_TRACES = ("varying",)
WHOLE = "1x"  # the load name of a trace run whole


@dataclass(frozen=True, slots=True)
class Cell:
    """A trace at a load: the requests that arrive within the window, at ``time_scale`` x their times."""

    trace: str
    load: str
    time_scale: float
    window_s: float
    requests: tuple[TraceRequest, ...]

    @property
    def key(self) -> str:
        return f"{self.trace}/{self.load}"

    def describe(self) -> dict[str, Any]:
        return {
            "window_s": self.window_s,
            "time_scale": self.time_scale,
            "requests_in_window": len(self.requests),
            "trace_s": round(self.window_s / self.time_scale, 3),
        }


def lengthened(name: str, duration_s: float) -> list[TraceRequest]:
    """The shipped trace ``name``, followed past its length by its generator's arrivals up to ``duration_s``
    (the shipped trace alone when it is long enough or has no generator)."""
    shipped = read_trace(TRACES_DIR / f"{name}.jsonl")
    length = make_traces.DURATION_S.get(name, math.inf)
    if duration_s <= length or name not in make_traces.GENERATORS:
        return shipped
    tail = [r for r in make_traces.GENERATORS[name](duration_s) if r.arrival_s >= length]
    return shipped + tail


def make_cell(trace: str, load: str, min_window_s: float, min_requests: int) -> Cell:
    """The cell of ``trace`` at ``load`` (``WHOLE`` for a whole trace), its window sized as the module says."""
    if trace in WHOLE_TRACES:
        reqs = lengthened(trace, 0.0)
        return Cell(trace, WHOLE, 1.0, make_traces.DURATION_S[trace], tuple(reqs))
    scale = 1.0 / LOADS[load]
    duration = make_traces.DURATION_S.get(trace, 0.0)
    while True:
        reqs = lengthened(trace, duration)
        if len(reqs) >= min_requests:
            nth = reqs[min_requests - 1].arrival_s * scale
            window = max(min_window_s, math.floor(2 * nth + 1) / 2)
            if window / scale <= duration or trace not in make_traces.GENERATORS:
                break
            duration = window / scale
        elif trace in make_traces.GENERATORS:
            duration = 1.5 * max(duration, 1.0)
        else:
            raise ValueError(f"trace {trace!r} has {len(reqs)} requests, fewer than {min_requests}")
    return Cell(trace, load, scale, window, tuple(r for r in reqs if r.arrival_s * scale < window))


def make_cells(trace: str, loads: list[str], min_window_s: float, min_requests: int) -> list[Cell]:
    """The trace's cells at ``loads`` (one whole cell for a trace that runs whole)."""
    if trace in WHOLE_TRACES:
        return [make_cell(trace, WHOLE, min_window_s, min_requests)]
    return [make_cell(trace, load, min_window_s, min_requests) for load in loads]


def compressed(cell: Cell, window_s: float, requests: int, max_prompt: int, max_output: int) -> Cell:
    """A CPU dry run's stand-in for ``cell``: ``requests`` of its requests, evenly spread over it (the load's
    shape, thinned), prompts and outputs clipped, replayed so that they arrive within 80 % of ``window_s``."""
    stride = max(len(cell.requests) // max(requests, 1), 1)
    reqs = tuple(
        dataclasses.replace(
            r, prompt_len=min(r.prompt_len, max_prompt), output_len=min(r.output_len, max_output)
        )
        for r in cell.requests[::stride][:requests]
    )
    span = max(reqs[-1].arrival_s if reqs else 0.0, 1e-3)
    return Cell(cell.trace, cell.load, 0.8 * window_s / span, window_s, reqs)
