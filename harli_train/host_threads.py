"""Helper threads that run torch CPU ops without an OpenMP team of their own.

OpenMP gives every OS thread that enters a parallel region its own team of workers, and torch's CPU ops
enter one for any tensor past a small size. A helper thread (the KV resizer zeroing new pages or spilling a
stash) thus brings a second team whose idle workers spin on the same cores as the main team: on a 2-core
machine the co-located quickstart's every `linear` and attention call ran ~1.6x slower, and training ~3x
(docs/design.md). ``single_threaded_ops()`` cuts the calling thread's own team to one thread; other threads,
the main one included, keep theirs.
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)


def single_threaded_ops() -> bool:
    """Make torch CPU ops called from this thread run on this thread alone; True when it took effect (False
    where torch's OpenMP runtime is not libgomp, e.g. a build without OpenMP: nothing to cut then)."""
    return thread_ops(1)


def thread_ops(n: int) -> bool:
    """Make torch CPU ops called from this thread run on an OpenMP team of ``n`` threads (this one included);
    True when it took effect (see ``single_threaded_ops``)."""
    torch.get_num_threads()  # torch's per-thread OpenMP set-up runs first, so it does not undo what follows
    try:
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(n)  # the per-thread ICV of the runtime torch loaded
    except (OSError, AttributeError):
        return False
    return torch.get_num_threads() == n
