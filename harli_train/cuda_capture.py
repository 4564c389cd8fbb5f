"""CUDA graph captures that leave torch's caching allocator consistent when the captured launches raise.

``CUDAGraph.capture_begin`` registers the capture's memory pool with the allocator as *capturing* (and takes a
reference on it); ``capture_end`` removes that registration only after ``cudaStreamEndCapture`` succeeds. A
capture that the error inside it invalidated fails there, and the pool stays registered as capturing for the
rest of the process: torch then refuses to release any cached memory, and the next ``emptyCache`` of a pool
(a ``torch.cuda.MemPool``'s destructor calls one) trips an internal assert, which inside a destructor aborts
the process. ``capturing`` ends such a capture the way ``capture_end`` would have, so the error that says
why the capture failed is the one the caller sees, and the process stays whole.

The pool is always named by the caller (``torch.cuda.graph_pool_handle()`` for a pool of its own): after a
failed capture torch no longer tells a graph's pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def capturing(graph: Any, pool: Any, error_mode: str = "thread_local") -> Iterator[None]:
    """Capture the launches of the ``with`` body on the current stream into ``graph``, its memory from
    ``pool``. ``error_mode`` is ``CUDAGraph.capture_begin``'s ``capture_error_mode``; the default,
    ``thread_local``, lets other threads go on with their own CUDA calls meanwhile. When the body raises,
    the capture is ended (``end_failed_capture``) and the body's error propagates; when the body ran but
    ``capture_end`` fails (a capture invalidated from outside it), the routing is ended the same way and
    ``capture_end``'s error propagates."""
    graph.capture_begin(pool=pool, capture_error_mode=error_mode)
    try:
        yield
    except BaseException:
        end_failed_capture(graph, pool)
        raise
    try:
        graph.capture_end()
    except BaseException:
        end_routing(pool)
        raise


def end_failed_capture(graph: Any, pool: Any, device: int | None = None) -> bool:
    """End ``graph``'s capture into ``pool`` after its launches raised; never raises. Returns whether the
    allocator's side had to be ended here (``capture_end`` itself failed before ending it): then the pool's
    capturing registration is removed and the reference the capture took on it released."""
    try:
        graph.capture_end()
        return False
    except Exception:
        return end_routing(pool, device)


def end_routing(pool: Any, device: int | None = None) -> bool:
    """Remove one capturing registration of ``pool`` (a capture's, or a MemPool routing's) and release the
    reference it took on the pool, if one is still registered; whether one was. Never raises."""
    try:
        dev = torch.cuda.current_device() if device is None else device
        torch._C._cuda_endAllocateToPool(dev, pool)
    except Exception:  # capture_end got past this point (it failed later): nothing is left registered
        return False
    with contextlib.suppress(Exception):
        torch._C._cuda_releasePool(dev, pool)
    return True
