"""Grows and shrinks the pooled KV cache on a thread of its own, off the decode step's critical path.

Mapping pages costs microseconds each (a page group of Llama-3-8B is 64 pages and 64 set-access calls, ~3 ms
on the H200), and a grow the pool cannot serve from free pages makes the trainer spill activations to host
memory first (~48 ms a GiB). Neither may sit inside a decode step, so the decode thread only *orders* a
resize and goes on; this thread maps or unmaps and reports back.

Ownership: the decode thread owns the engine's block manager, this thread the storage's mapping; they share
a queue of orders and a queue of results, nothing else. The invariant that keeps every block the engine
hands out mapped: a grow maps first, and the decode thread hands the new blocks out only when it reads the
result; a shrink is ordered only after the block manager has dropped the blocks, and its unmap waits for
the device's queued work first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harli_train.host_threads import single_threaded_ops

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Resized:
    """What one order did: the storage holds ``num_blocks`` blocks after it; ``error`` says why a grow fell
    short (the pool could not give the pages, even after asking the trainer); ``reclaimed`` pages came from
    the trainer's tenant during it."""

    order: int
    kind: str  # "grow" or "shrink"
    num_blocks: int
    pages: int  # pages mapped (grow) or unmapped (shrink)
    seconds: float
    reclaimed: int = 0
    error: str | None = None


class KVResizer:
    """Resizes ``kv`` (a ``PooledKVStorage``) as ordered, on its own thread, and samples the pool.

    ``grow(n)`` / ``shrink(n)`` queue an order and return its id at once; ``results()`` drains what is
    done (decode thread). ``wait(order)`` blocks until an order is done (for a recovery that needs the
    pages now, never a decode step). A grow that cannot be served in full maps what whole page groups the
    free pages allow and reports the rest as an error: the decode thread orders again if it still needs them.

    ``sample(reset)`` is called on this thread at start, after every order, every ``sample_s`` while idle
    and when poked (``poke``; ``reset=True`` starts the sample's statistics afresh); what it returns is kept
    as ``snapshot``, an immutable object other threads read instead of calling into the pool.
    """

    def __init__(self, kv: Any, sample: Callable[[bool], Any], sample_s: float = 0.05) -> None:
        self.kv, self._sample, self.sample_s = kv, sample, sample_s
        self._orders: queue.Queue[tuple[int, str, int] | None] = queue.Queue()
        self._results: queue.Queue[Resized] = queue.Queue()
        self._done = threading.Condition()
        self._last_done = -1
        self._next = 0
        self.snapshot: Any = sample(True)
        self._thread = threading.Thread(target=self._run, name="harli-kv-resizer", daemon=True)
        self._thread.start()

    # ---- the decode thread's side ----------------------------------------------------------------
    def grow(self, num_blocks: int) -> int:
        return self._order("grow", num_blocks)

    def shrink(self, num_blocks: int) -> int:
        return self._order("shrink", num_blocks)

    def poke(self, reset: bool = False, wait: bool = False) -> None:
        """Sample now (``reset``: statistics from now on); ``wait`` until it is done."""
        order = self._order("sample", int(reset))
        if wait:
            self.wait(order)

    def _order(self, kind: str, num_blocks: int) -> int:
        order, self._next = self._next, self._next + 1
        self._orders.put((order, kind, num_blocks))
        return order

    def results(self) -> list[Resized]:
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def wait(self, order: int, timeout_s: float = 30.0) -> bool:
        """Block until ``order`` is done; False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._last_done >= order, timeout_s)

    def close(self) -> None:
        """Finish the queued orders and stop the thread. Idempotent."""
        if self._thread.is_alive():
            self._orders.put(None)
            self._thread.join()

    # ---- the resizer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        single_threaded_ops()  # its page zeroing and spills must not bring an OpenMP team of their own
        while True:
            try:
                item = self._orders.get(timeout=self.sample_s)
            except queue.Empty:
                self.snapshot = self._sample(False)
                continue
            if item is None:
                return
            order, kind, arg = item
            if kind == "sample":
                self.snapshot = self._sample(bool(arg))
            else:
                try:
                    self._results.put(self._do(order, kind, arg))
                except Exception as err:  # reported, never raised into decode
                    log.warning("KV %s to %d blocks failed: %s", kind, arg, err)
                    self._results.put(Resized(order, kind, self.kv.num_blocks, 0, 0.0, error=str(err)))
                self.snapshot = self._sample(False)
            with self._done:
                self._last_done = order
                self._done.notify_all()

    def _do(self, order: int, kind: str, num_blocks: int) -> Resized:
        kv, t0 = self.kv, time.perf_counter()
        before = kv.mapped_bytes // kv.pool.page_bytes
        reclaimed0 = kv.pool.reclaim_stats["pages_freed"]
        error = None
        if kind == "grow":
            error = self._grow(num_blocks)
        else:
            kv.shrink(num_blocks)  # waits for the device's queued work before unmapping
        pages = abs(kv.mapped_bytes // kv.pool.page_bytes - before)
        reclaimed = kv.pool.reclaim_stats["pages_freed"] - reclaimed0
        return Resized(order, kind, kv.num_blocks, pages, time.perf_counter() - t0, reclaimed, error)

    def _grow(self, num_blocks: int) -> str | None:
        """Grow to ``num_blocks`` (whole page groups), or as many groups as the pool can give."""
        from harli_train.memory import PoolExhausted

        kv = self.kv
        try:
            kv.grow(num_blocks)
            return None
        except PoolExhausted as err:
            # All or nothing failed: take what whole groups the free pages (and reclaims) allow.
            groups = kv.pool.free_pages // kv.pages_per_group
            if groups > 0:
                kv.grow(kv.num_blocks + groups * kv.blocks_per_page)
            return str(err).splitlines()[0]
