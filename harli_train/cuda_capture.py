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

A pool id that graphs are captured into again after every earlier graph of it is gone (a trainer replaced on
the same ``torch.cuda.MemPool``) needs ``anchor_pool``: torch's pinned-host allocator keeps its own pool per
capture pool id, counted by the graphs alive, and refuses a new capture into an id whose count fell to zero
(an internal assert in ``CachingHostAllocator``, raised after the device allocator registered the capture).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

# Taken to begin a capture, and by another thread to look at a stream and record an event there: no capture
# begins on the stream between the look and the record (``record_unless_capturing``).
_BEGIN = threading.Lock()


@contextlib.contextmanager
def capturing(graph: Any, pool: Any, error_mode: str = "thread_local") -> Iterator[None]:
    """Capture the launches of the ``with`` body on the current stream into ``graph``, its memory from
    ``pool``. ``error_mode`` is ``CUDAGraph.capture_begin``'s ``capture_error_mode``; the default,
    ``thread_local``, lets other threads go on with their own CUDA calls meanwhile. When the body raises,
    the capture is ended (``end_failed_capture``) and the body's error propagates; when the body ran but
    ``capture_end`` fails (a capture invalidated from outside it), the routing is ended the same way and
    ``capture_end``'s error propagates; when ``capture_begin`` fails after registering the capture, that
    registration is ended and its error propagates. Nothing else may route to ``pool`` when it begins."""
    try:
        with _BEGIN:
            graph.capture_begin(pool=pool, capture_error_mode=error_mode)
    except BaseException as err:
        # Refused after the device allocator registered the capture (the host allocator's refusal): end
        # that registration. "already recording" is the device allocator's own refusal of a pool someone
        # else records to: that registration is theirs.
        if "already recording" not in str(err):
            end_routing(pool)
        raise
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


def record_unless_capturing(stream: Any) -> Any:
    """An event recorded now on ``stream`` (a CUDA stream another thread launches on), or None while a graph
    is being captured on it: an event recorded there would join that capture (which then fails unjoined),
    and waiting on it fails (cudaErrorCapturedEvent). No capture begins on ``stream`` between the look and
    the record (``capturing`` begins under the same lock); one that begins after it leaves the event
    outside the capture."""
    with _BEGIN:
        with torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():
                return None
        event = torch.cuda.Event()
        event.record(stream)
        return event


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


def anchor_pool(pool: Any, device: torch.device) -> Any:
    """A one-kernel graph captured into ``pool`` (from a side stream of ``device``): while it lives, the
    pinned-host allocator's count for ``pool`` stays above zero, so graphs can be captured into ``pool``
    again after all others captured into it are gone. Keep it as long as ``pool`` takes captures; drop it
    before ``pool`` itself. Call with nothing routed to ``pool``."""
    flag = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    stream, current = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream), capturing(graph, pool):
        flag.add_(1)
    current.wait_stream(stream)
    graph.flag = flag  # the buffer the graph writes lives as long as the graph
    return graph
