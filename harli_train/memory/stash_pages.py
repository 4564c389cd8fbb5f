"""The pages behind the activation stashes: one reserved range a layer (or a graphs' chunk), filled front to
back and mapped as a prefix, spilled whole to host slabs and mapped again at the same addresses.

``StashPages`` is ``ActivationSwapper``'s store. Every method but ``stats_snapshot`` assumes the caller holds
``lock`` (the swapper's autograd hooks, the pool's reclaim callback and the arena's calls all take it), so a
spill never races a pack or a copy back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harli_train.cuda_capture import record_unless_capturing

from .host_slabs import SLAB_BYTES, HostSlabs
from .native import PagePool, PoolExhausted, Region, Tenant

# torch's allocator aligns blocks to 512 bytes; stashed tensors get the same alignment, so kernels that pick
# code paths by pointer alignment (cuBLAS, MKL) take the same ones and results stay bit-identical.
STASH_ALIGN = 512


@dataclass(slots=True, eq=False)
class Stash:
    """One layer's saved activations: a reserved range filled front to back, mapped as a prefix. An
    arena's stash (``fixed``) keeps its tensors at their places for good; ``dead``: its bytes are no longer
    needed once the trainer's queued work has run (a reclaim unmaps it without copying)."""

    region: Region
    flat: torch.Tensor | None = None  # uint8 view of the range, made once page 0 is mapped
    typed: dict = None  # dtype -> `flat` viewed as that dtype (one as_strided then makes a saved tensor)
    used: int = 0  # bytes filled
    mapped: int = 0  # pages mapped: [0, mapped)
    live: int = 0  # saved tensors autograd still holds
    host: list[torch.Tensor] | None = None  # the host slabs of the spilled bytes while the pages are unmapped
    ready: Any = None  # event of an in-flight copy back to the device
    fixed: bool = False
    dead: bool = False

    @property
    def holds(self) -> bool:
        """Whether its bytes are still needed (a spill must copy them)."""
        return self.used > 0 and not self.dead

    def view(self, offset: int, span: int, dtype: torch.dtype, shape: Any, stride: Any) -> torch.Tensor:
        """The bytes [offset, offset + span) as a tensor of `shape`/`stride` (offset is STASH_ALIGN-aligned,
        so a whole number of elements)."""
        typed = self.typed.get(dtype) if self.typed is not None else None
        if typed is None:
            if self.typed is None:
                self.typed = {}
            typed = self.typed[dtype] = self.flat.view(dtype)
        return typed.as_strided(shape, stride, typed.storage_offset() + offset // dtype.itemsize)


def contiguous_strides(shape: Any) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class StashPages:
    """The stashes of one trainer tenant: ``stash(i)`` reserves layer i's range (``layer_pages`` pages) on
    first use; ``spill`` copies whole stashes to host slabs (pinned on CUDA, kept and reused for the run:
    ``HostSlabs``; ``host_reserve`` bytes made at construction, ``slab_bytes`` each) on a side stream,
    ordered after the trainer's latest stream, and unmaps them; ``bring_back`` maps them again at the same
    addresses and starts the copy back. Where a stash cannot map, the stashes outside ``protect()`` (and the
    one mapping) are spilled first, then the pool is asked for other tenants' idle pages."""

    def __init__(
        self,
        pool: PagePool,
        tenant: Tenant,
        layer_pages: int,
        protect: Callable[[], set[int]],
        host_reserve: int = 0,
        slab_bytes: int | None = None,
    ):
        self.pool, self.tenant, self.layer_pages = pool, tenant, layer_pages
        self.protect = protect
        self.cuda = pool.backend == "cuda"
        self.stashes: dict[int, Stash] = {}
        # Re-entrant: a pack that maps may spill, and a spill may meet the pool's reclaim of this tenant.
        self.lock = threading.RLock()
        # torch's raw (id, device, type) of the stream of the latest pack or unpack: reading it costs far
        # less than making a torch.cuda.Stream each call (the hooks run for every saved tensor).
        self._stream: tuple[int, int, int] | None = None
        self._side: Any = None
        self._device_index = pool.device.index or 0
        # A stash's bytes fill whole slabs but the last; a small model's stashes take one small slab each.
        self.host = HostSlabs(slab_bytes or min(SLAB_BYTES, layer_pages * pool.page_bytes), pinned=self.cuda)
        self.host.reserve(host_reserve)
        self.stats = {
            "stashed_bytes": 0,
            "stashed_tensors": 0,
            "passthrough_bytes": 0,
            "swap_out_bytes": 0,
            "swap_in_bytes": 0,
            "swap_outs": 0,
            "swap_ins": 0,
            "reclaimed_pages": 0,
            "reclaim_seconds": 0.0,
            # Only the spills other tenants asked for (``reclaim``), not the trainer's own.
            "reclaims": 0,
            "reclaim_pages": 0,
            "reclaim_spilled_bytes": 0,
            "reclaim_copy_seconds": 0.0,
            # Of the spills' host seconds (CUDA): pinning host buffers, and the copies' own GPU time (the
            # rest is the wait for the trainer's queued work, which the copies are ordered after, and unmaps).
            "spill_pin_seconds": 0.0,
            "spill_copy_gpu_seconds": 0.0,
            "reclaim_pin_seconds": 0.0,
            "reclaim_copy_gpu_seconds": 0.0,
        }

    @property
    def resident_pages(self) -> int:
        return sum(s.mapped for s in self.stashes.values())

    def stats_snapshot(self) -> dict[str, Any]:
        """A copy of ``stats``, consistent (taken under the lock the spills hold)."""
        with self.lock:
            return dict(self.stats)

    def arena_bytes(self) -> int:
        """Bytes of a graphs' arena placed in the stashes now, mapped or spilled (a level: its slots are
        placed once, at capture, which ``stats`` count then and never again). Takes the lock."""
        with self.lock:
            return sum(stash.used for stash in self.stashes.values() if stash.fixed)

    def stash(self, index: int) -> Stash:
        """Layer (or chunk) ``index``'s stash, its range reserved on first use."""
        if index not in self.stashes:
            self.stashes[index] = Stash(self.pool.reserve(self.tenant, self.layer_pages))
        return self.stashes[index]

    def note_stream(self) -> None:
        """Remember the stream the trainer launches on now (spills are ordered after it)."""
        if self.cuda:
            self._stream = torch._C._cuda_getCurrentStream(self._device_index)  # what current_stream reads

    def _last_stream(self) -> Any:
        """The stream of the latest pack or unpack as a torch Stream (the current one if none)."""
        if self._stream is None:
            return torch.cuda.current_stream(self.pool.device)
        sid, dev, kind = self._stream
        return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=kind)

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.pool.device)
        return self._side

    def ensure_mapped(self, stash: Stash, index: int, n_pages: int) -> None:
        """Map the stash's first ``n_pages`` pages (spilling others, or taking idle pages from other
        tenants, where the pool has none free)."""
        if n_pages <= stash.mapped:
            return
        pages = range(stash.mapped, n_pages)
        try:
            stash.region.map(pages)
        except PoolExhausted:
            # Spill this trainer's far layers first, then take idle pages from the other tenants.
            self.spill(len(pages), protect=self.protect() | {index})
            self.pool.reclaim(len(pages), requester=self.tenant)
            try:
                stash.region.map(pages)
            except PoolExhausted as e:
                raise type(e)(
                    f"trainer activations of layer {index} need {len(pages)} more pages: {e}"
                ) from None
        stash.mapped = n_pages
        if stash.flat is None:
            stash.flat = stash.region.as_tensor()

    def bring_back(self, index: int) -> None:
        """Map a spilled stash again and start copying its bytes back (on the side stream on CUDA)."""
        stash = self.stashes.get(index)
        if stash is None or stash.host is None or stash.ready is not None or stash.mapped:
            return
        self.ensure_mapped(stash, index, -(-stash.used // self.pool.page_bytes))
        dst = stash.flat[: stash.used]
        if self.cuda:
            side = self._side_stream()
            with torch.cuda.stream(side):
                self.host.copy_in(stash.host, dst)
                stash.ready = torch.cuda.Event()
                stash.ready.record(side)
        else:
            self.host.copy_in(stash.host, dst)
        self.host.give(stash.host)  # a later copy into them is queued after this one (HostSlabs)
        stash.host = None
        self.stats["swap_in_bytes"] += stash.used
        self.stats["swap_ins"] += 1

    def ensure_resident(self, index: int) -> None:
        """The stash's bytes back in place before the current stream reads them."""
        stash = self.stashes.get(index)
        if stash is None:
            return
        if stash.host is not None and not stash.mapped:
            self.bring_back(index)
        if stash.ready is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(stash.ready)
            stash.ready = None

    def make_writable(self, index: int, stash: Stash) -> None:
        """The stash mapped for a forward that writes it anew: a spilled copy is dropped, a copy back in
        flight waited for (it must not land after the forward's writes)."""
        if stash.host is not None:
            self.discard(stash)
        if stash.ready is not None:
            self.ensure_resident(index)
        self.ensure_mapped(stash, index, -(-stash.used // self.pool.page_bytes))
        stash.dead = False

    def discard(self, stash: Stash) -> None:
        """Forget the stash's bytes: its spilled copy goes back to the slabs, and it is dead."""
        if stash.host is not None:
            self.host.give(stash.host)
            stash.host = None
        stash.dead = True

    def spill(self, n_pages: int, protect: set[int]) -> int:
        """Unmap stashes outside ``protect`` until ``n_pages`` are free, copying out the bytes still needed;
        blocks until the copies (and the trainer's queued work) are done. Returns the pages freed: none
        while a graph is being captured on the trainer's stream, which the copies would have to follow."""
        # Empty and dead stashes cost nothing to unmap; then the lowest layers, which backward needs last.
        order = sorted(self.stashes.items(), key=lambda kv: (kv[1].holds, kv[0]))
        chosen, pages = [], 0
        for index, stash in order:
            if pages >= n_pages:
                break
            if index not in protect and stash.mapped:
                chosen.append(stash)
                pages += stash.mapped
        if not chosen:
            return 0
        t0 = time.perf_counter()
        copies = [s for s in chosen if s.holds]
        if self.cuda:
            # Also orders the unmap after every queued trainer kernel that may still read the pages. A spill
            # may run on another thread (a KV grow's reclaim) while the trainer captures a graph on that
            # stream: then nothing is freed now.
            after = record_unless_capturing(self._last_stream())
            if after is None:
                return 0
            side = self._side_stream()
            side.wait_event(after)
            started = torch.cuda.Event(enable_timing=True)
            started.record(side)  # reached once the trainer's queued work is done
            pinned = self.host.pin_seconds
            with torch.cuda.stream(side):
                for s in copies:
                    s.host = self.host.take(s.used)
                    self.host.copy_out(s.flat[: s.used], s.host)
            pin_s = self.host.pin_seconds - pinned
            done = torch.cuda.Event(enable_timing=True)
            done.record(side)
            done.synchronize()
            self.stats["spill_pin_seconds"] += pin_s
            self.stats["spill_copy_gpu_seconds"] += started.elapsed_time(done) / 1e3
        else:
            for s in copies:
                s.host = self.host.take(s.used)
                self.host.copy_out(s.flat[: s.used], s.host)
        for s in chosen:
            s.region.unmap(range(s.mapped))
            s.mapped, s.ready = 0, None
        self.stats["swap_out_bytes"] += sum(s.used for s in copies)
        self.stats["swap_outs"] += len(copies)
        self.stats["reclaimed_pages"] += pages
        self.stats["reclaim_seconds"] += time.perf_counter() - t0
        return pages
