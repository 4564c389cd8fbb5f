"""The trainer's torch allocations, routed into the pool through ``torch.cuda.MemPool``."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from harli_train.cuda_capture import anchor_pool, end_routing

from .native import PagePool, PoolError, Tenant, _check, _lib, native_library_path

log = logging.getLogger(__name__)


class TrainerMemory:
    """The trainer's torch allocations routed into the pool (CUDA backend only).

    Inside ``scope()`` torch allocates through a ``torch.cuda.MemPool`` whose pluggable allocator is the
    library's ``hvmm_torch_alloc``/``hvmm_torch_free``: every segment is whole pool pages of `tenant`.
    A live MemPool never hands its cached segments back (pytorch#145168), so these pages return to the
    pool only at ``close()``; the pages the trainer gives back on demand are the ActivationSwapper's.
    """

    def __init__(self, pool: PagePool, tenant: Tenant):
        if pool.backend != "cuda":
            raise PoolError(
                "TrainerMemory needs the CUDA backend: torch's pluggable allocator serves only CUDA "
                "tensors (on the host backend call hvmm_torch_alloc/hvmm_torch_free directly)"
            )
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
        if "expandable_segments:true" in conf.replace(" ", "").lower():
            raise PoolError(
                "TrainerMemory: torch's MemPool needs expandable segments off; unset "
                "expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF"
            )
        self.pool, self.tenant = pool, tenant
        _check(_lib().hvmm_torch_bind(pool._handle, tenant.id))
        self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
            native_library_path(), "hvmm_torch_alloc", "hvmm_torch_free"
        )
        self.mempool: Any = torch.cuda.MemPool(self._allocator.allocator())
        self._warm_streams: set[int] = set()
        self._routes: list[tuple[Any, bool]] = []  # the open scopes' (stream, by stream), innermost last
        self._anchor: Any = None  # `cuda_capture.anchor_pool`'s graph, from the first capture to close()

    def _warm_cublas(self) -> None:
        # cuBLAS(Lt) keeps a workspace per (handle, stream) for the process's lifetime, allocated by the
        # stream's first matmul. Made inside scope() it would pin pool pages past close(): make it outside.
        stream = torch.cuda.current_stream(self.pool.device)
        if stream.cuda_stream in self._warm_streams:
            return
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = torch.ones((16, 16), device=self.pool.device, dtype=dtype)
            torch.addmm(a[0], a, a)  # the cublasLt path (bias epilogue)
            torch.mm(a, a)
        self._warm_streams.add(stream.cuda_stream)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Route allocations to the pool: those on the current stream from any thread (so backward's
        autograd threads are covered) when it is not the default stream, else this thread's."""
        dev = self.pool.device.index
        by_stream = torch.cuda.current_stream(dev).cuda_stream != 0 and hasattr(
            torch._C, "_cuda_beginAllocateCurrentStreamToPool"
        )
        self._warm_cublas()
        self._route(by_stream)
        self._routes.append((torch.cuda.current_stream(dev), by_stream))
        try:
            yield
        finally:
            self._routes.pop()
            self._unroute()

    @contextlib.contextmanager
    def capture(self) -> Iterator[Any]:
        """Around a CUDA graph capture, in ``scope()`` or not: yields the pool id to capture into (this
        MemPool's, so the graphs' memory is the tenant's pages too). An open scope's routing is lifted
        meanwhile (the capture routes its stream's allocations to the same pool itself), then restored. The
        first capture anchors the MemPool (`cuda_capture.anchor_pool`, until close()), so that a trainer
        replaced after every graph of the last one is gone captures into it again."""
        lifted = list(self._routes)
        for _ in lifted:
            self._unroute()
        try:
            if self._anchor is None:  # a trainer replaced later captures into the same MemPool again
                self._anchor = anchor_pool(self.mempool.id, self.pool.device)
            yield self.mempool.id
        finally:
            for stream, by_stream in lifted:
                with torch.cuda.stream(stream):  # a scope by stream routes the stream it was opened on
                    self._route(by_stream)

    def _route(self, by_stream: bool) -> None:
        """Route the current stream's allocations (``by_stream``, from any thread) or this thread's to the
        MemPool."""
        begin = (
            torch._C._cuda_beginAllocateCurrentStreamToPool
            if by_stream
            else torch._C._cuda_beginAllocateCurrentThreadToPool
        )
        begin(self.pool.device.index, self.mempool.id)

    def _end_stale_routings(self, most: int = 64) -> None:
        """End what still routes to the MemPool with no scope() open: captures into it that failed before
        ending their routing. Each is logged."""
        for _ in range(most):
            if not end_routing(self.mempool.id, self.pool.device.index):  # nothing (more) routes to it
                return
            log.warning(
                "TrainerMemory.close: ended a failed graph capture's routing into the trainer's MemPool"
            )

    def _unroute(self) -> None:
        """End one routing to the MemPool (the innermost)."""
        dev = self.pool.device.index
        torch._C._cuda_endAllocateToPool(dev, self.mempool.id)
        torch._C._cuda_releasePool(dev, self.mempool.id)

    def close(self) -> None:
        """Drop the MemPool so torch frees its segments into the pool. No scope() may be open any more
        (PoolError, the MemPool kept: dropping it with a routing open aborts the process in torch's
        allocator), and every tensor allocated in scope() must be dead by now; survivors are reported
        (PoolError) and the pool stays bound to torch, so their memory stays valid (torch would otherwise
        free them with cudaFree: pytorch#146431). A graph capture into the MemPool that failed without
        ending its routing (`cuda_capture`) is ended here first."""
        if self.mempool is None:
            return
        if self._routes:
            # Never destroyed, not even at interpreter exit: its destructor would abort the process.
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.mempool))
            raise PoolError(
                f"TrainerMemory.close: {len(self._routes)} scope() still open (a thread still training in "
                "it?); the MemPool is kept, and the page pool with it"
            )
        self._end_stale_routings()
        self._anchor = None  # a graph holds its pool: it goes first
        self.mempool = None
        torch.cuda.synchronize(self.pool.device)
        if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            # A workspace made in scope() despite _warm_cublas (a stream first used by a thread torch made).
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        stats = self.pool.stats()
        live = stats["torch_allocs"] - stats["torch_frees"]
        if live:
            raise PoolError(
                f"TrainerMemory.close: {live} allocation(s) made in scope() are still alive "
                f"({self.tenant.stats()['used_pages']} pages of tenant {self.tenant.name!r}); drop every "
                "tensor made in scope() (parameters, gradients, optimizer state, saved activations) first"
            )
        _check(_lib().hvmm_torch_bind(None, -1))
