"""Where named threads' Python host time goes, sampled, written where ``$HARLI_HOST_PROFILE`` points.

The co-located trainer is host-bound on the GPU (its launching thread is busy about as long as its kernels
run), and where that time goes is only visible on the GPU machine. With the variable set to a directory,
every block run under ``host_profile(name)`` has its thread's Python stack sampled (``SAMPLE_S`` apart, by
one sampler thread for all of them) until the block ends; then ``<name>.txt`` lists the functions by the
samples they were running in (own: the innermost frame; inclusive: anywhere on the stack) and
``<name>.folded`` holds the stacks one per line with their counts (the collapsed format flame-graph tools
read). A sample of a thread blocked in C (a CUDA call, a lock, a sleep) lands on the Python frame that
called it, so waits show as the call that waits.

Sampling rather than cProfile: cProfile is one process-wide profiler on Python 3.12 (a second thread's
cannot start), and its per-call cost would inflate the very launch paths measured. The sampler takes the GIL
about every ``SAMPLE_S``, so a profiled run is slightly slower; it measures where host time goes, not
throughput. Autograd's backward runs on its own device threads: their Python (the page pool's unpack hooks)
is not in the trainer thread's samples; ``run_backward`` is.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)
ENV = "HARLI_HOST_PROFILE"
SAMPLE_S = 1e-3
TOP = 60
MAX_DEPTH = 64


class _Thread:
    """One profiled block's samples."""

    def __init__(self, name: str):
        self.name = name
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()  # outermost first
        self.samples = 0
        self.torn = 0  # samples dropped: the thread's frames changed while they were read (`_stack`)
        self.t0 = time.perf_counter()


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def _stack(frame: object) -> tuple[str, ...] | None:
    """The functions on the stack from `frame` outwards, outermost first; None when the walk meets something
    that is not a frame. Another thread's frames are read while it runs: if the sampler loses the GIL in the
    walk, a frame the thread has since left can point anywhere (CPython 3.11 gave a dict for its `f_back`)."""
    stack = []
    while frame is not None and len(stack) < MAX_DEPTH:
        if not isinstance(frame, FrameType):
            return None
        try:
            stack.append(_where(frame))
            frame = frame.f_back
        except (AttributeError, TypeError):
            return None
    return tuple(reversed(stack))


class Sampler:
    """One thread that samples the stacks of the threads registered with it; it ends once none is (its
    wake-ups take the GIL), and the next ``add`` starts another."""

    def __init__(self, interval_s: float = SAMPLE_S):
        self.interval_s = interval_s
        self._threads: dict[int, _Thread] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, ident: int, name: str) -> _Thread:
        with self._lock:
            entry = self._threads[ident] = _Thread(name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="harli-host-sampler", daemon=True)
                self._thread.start()
        return entry

    def remove(self, ident: int) -> None:
        with self._lock:
            self._threads.pop(ident, None)

    def _run(self) -> None:
        try:
            while True:
                time.sleep(self.interval_s)
                with self._lock:
                    watched = dict(self._threads)
                    if not watched:
                        self._thread = None
                        return
                frames = sys._current_frames()
                for ident, entry in watched.items():
                    frame = frames.get(ident)
                    if frame is None:
                        continue
                    stack = _stack(frame)
                    if stack is None:
                        entry.torn += 1
                        continue
                    entry.stacks[stack] += 1
                    entry.samples += 1
                del frames
        finally:  # however this thread ends, the next `add` starts another
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None


_SAMPLER = Sampler()


@contextlib.contextmanager
def host_profile(name: str) -> Iterator[None]:
    """Sample this thread's stack for the block when ``$HARLI_HOST_PROFILE`` names a directory (else do
    nothing); the block's report is written when it ends."""
    where = os.environ.get(ENV)
    if not where:
        yield
        return
    ident = threading.get_ident()
    entry = _SAMPLER.add(ident, name)
    try:
        yield
    finally:
        _SAMPLER.remove(ident)
        try:
            write_profile(entry, Path(where), time.perf_counter() - entry.t0)
        except OSError as err:  # a diagnostic must not fail the run
            log.warning("could not write the host profile %s to %s: %s", name, where, err)


def write_profile(entry: _Thread, directory: Path, seconds: float) -> Path:
    """``<directory>/<name>.txt`` (the tables) and ``<name>.folded`` (the stacks);
    returns the table's path."""
    directory.mkdir(parents=True, exist_ok=True)
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for stack, n in entry.stacks.items():
        own[stack[-1]] += n
        for fn in set(stack):
            inclusive[fn] += n
    total = max(entry.samples, 1)
    per_sample_ms = 1e3 * seconds / total
    lines = [
        f"{entry.name}: {entry.samples} samples over {seconds:.2f} s "
        f"(one per {per_sample_ms:.2f} ms; {entry.torn} torn and dropped); share of the samples each "
        "function was running in",
    ]
    for title, counts in (("own (innermost frame)", own), ("inclusive (anywhere on the stack)", inclusive)):
        lines += ["", f"=== by {title} ===", f"{'share':>7} {'samples':>8}  function"]
        for fn, n in counts.most_common(TOP):
            lines.append(f"{100 * n / total:6.1f}% {n:8d}  {fn}")
    path = directory / f"{entry.name}.txt"
    path.write_text("\n".join(lines) + "\n")
    folded = (f"{';'.join(stack)} {n}" for stack, n in entry.stacks.most_common())
    (directory / f"{entry.name}.folded").write_text("\n".join(folded) + "\n")
    log.info("host profile of the %s written to %s", entry.name, path)
    return path
