"""GcPauses: Python's garbage collections while the co-located loop serves: setup's objects frozen out of
them, run by the decode thread where they cost it nothing, and timed."""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Python's cyclic collector while serving.

    A collection holds the GIL, so it stalls the decode thread whichever thread triggers it, for as long as it
    walks the tracked objects of its generation. Two measures keep it out of decode's token intervals:

    - What exists when serving starts (the model, the engine, the trainer: millions of objects) is frozen out
      of every collection.
    - Automatic collection is off while serving (``scheduled``, the default). The decode thread runs what
      CPython's thresholds say is due itself, where it would otherwise only wait: ``young_if_due`` while the
      GPU runs a step it has just launched (generations 0 and 1, a few hundred microseconds at most), and
      ``full_if_due`` when nothing is decoding (generation 2). A full collection that stays due under a load
      that never idles runs in a GPU wait after ``max_defer_s`` (counted in ``forced_full``), so cyclic
      garbage cannot pile up without bound. ``automatic`` hands collection back to CPython (the trainer alone,
      after serving).

    What a collection cost decode on the H200, left to CPython and scheduled: docs/design.md.
    """

    def __init__(self, scheduled: bool = True, max_defer_s: float = 60.0) -> None:
        self.scheduled, self.max_defer_s = scheduled, max_defer_s
        self.count, self.total_s, self.max_s = [0, 0, 0], 0.0, 0.0
        self.forced_full = 0
        self._active = False  # collections are the decode thread's to run (scheduled, inside the block)
        self._t0: float | None = None
        self._was_enabled = True
        self._full_due_since: float | None = None
        self.thresholds = gc.get_threshold()

    def __enter__(self) -> GcPauses:
        gc.collect()
        gc.freeze()
        gc.callbacks.append(self._callback)
        self._was_enabled = gc.isenabled()
        self.thresholds = gc.get_threshold()
        if self.scheduled:
            gc.disable()
            self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)
        self._active = False
        if self._was_enabled:
            gc.enable()
        gc.unfreeze()

    def automatic(self) -> None:
        """CPython collects on its own again (as before ``__enter__``) until the block ends."""
        self._active = False
        if self._was_enabled:
            gc.enable()

    def _due(self) -> int | None:
        """The generation CPython would collect now (None: none is due)."""
        c0, c1, c2 = gc.get_count()
        t0, t1, t2 = self.thresholds
        if t0 <= 0 or c0 < t0:
            return None
        if c2 >= t2:
            return 2
        return 1 if c1 >= t1 else 0

    def young_if_due(self) -> None:
        """The decode thread has launched a step and is about to wait for the GPU: collect the young
        generations if due (a due full collection waits for ``full_if_due``, at most ``max_defer_s``)."""
        if not self._active:
            return
        gen = self._due()
        if gen is None:
            return
        if gen == 2:
            now = time.perf_counter()
            if self._full_due_since is None:
                self._full_due_since = now
            if now - self._full_due_since < self.max_defer_s:
                gen = 1
            else:
                self.forced_full += 1
        gc.collect(gen)
        if gen == 2:
            self._full_due_since = None

    def full_if_due(self) -> None:
        """Nothing is decoding: run whatever collection is due, the full one included."""
        if not self._active:
            return
        gen = self._due()
        if gen is None and self._full_due_since is None:
            return
        gen = 2 if self._full_due_since is not None else gen
        gc.collect(gen)
        if gen == 2:
            self._full_due_since = None

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            took, self._t0 = time.perf_counter() - self._t0, None
            self.count[info["generation"]] += 1
            self.total_s += took
            self.max_s = max(self.max_s, took)

    def summary(self) -> dict[str, Any]:
        return {
            "scheduled": self.scheduled,
            "collections_by_generation": list(self.count),
            "forced_full": self.forced_full,
            "total_ms": 1e3 * self.total_s,
            "max_ms": 1e3 * self.max_s,
        }
