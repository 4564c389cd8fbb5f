"""A profile of one thread's Python host time (cProfile), written where ``$HARLI_HOST_PROFILE`` points.

The co-located trainer is host-bound on the GPU (its launching thread is busy about as long as its kernels
run), and where that time goes is only visible on the GPU machine: with the variable set to a directory,
the trainer's thread and the decode loop each write ``<name>.prof`` (pstats) and ``<name>.txt`` (the top
functions by own time and by cumulative time). cProfile slows the profiled thread, so such a run measures
where host time goes, not how fast the run is. Autograd's backward runs on its own device threads: their
Python (the page pool's unpack hooks) is not in the trainer thread's profile; ``run_backward`` is.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import logging
import os
import pstats
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "HARLI_HOST_PROFILE"
TOP = 60


@contextlib.contextmanager
def host_profile(name: str) -> Iterator[None]:
    """Profile the block on this thread when ``$HARLI_HOST_PROFILE`` names a directory (else do nothing)."""
    where = os.environ.get(ENV)
    if not where:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        try:
            write_profile(profile, Path(where), name)
        except OSError as err:  # a diagnostic must not fail the run
            log.warning("could not write the host profile %s to %s: %s", name, where, err)


def write_profile(profile: cProfile.Profile, directory: Path, name: str) -> Path:
    """``<directory>/<name>.prof`` and ``.txt``; returns the text file's path."""
    directory.mkdir(parents=True, exist_ok=True)
    profile.dump_stats(str(directory / f"{name}.prof"))
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    total = sum(row[2] for row in stats.stats.values())  # own time of every function: the thread's busy time
    text.write(f"{name}: {total:.3f} s of Python-visible host time (own time summed)\n")
    for order in ("tottime", "cumulative"):
        text.write(f"\n=== by {order} ===\n")
        stats.sort_stats(order).print_stats(TOP)
    path = directory / f"{name}.txt"
    path.write_text(text.getvalue())
    log.info("host profile of the %s written to %s", name, path)
    return path
