"""Saved activations stashed per layer in pool pages; when the KV cache is short, the pool asks the swapper
to ``reclaim(n_pages)`` and it spills layers outside its window to host memory."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from harli_train.saved_tensors import stays_in_place, storages

from .host_slabs import SLAB_BYTES, HostSlabs
from .native import PagePool, PoolExhausted, Region, Tenant

# torch's allocator aligns blocks to 512 bytes; stashed tensors get the same alignment, so kernels that pick
# code paths by pointer alignment (cuBLAS, MKL) take the same ones and results stay bit-identical.
_STASH_ALIGN = 512
# The counters of the spills a reclaim (another tenant's request) made, and the spill counters they take from.
_RECLAIM_SHARE = {
    "reclaim_spilled_bytes": "swap_out_bytes",
    "reclaim_copy_seconds": "reclaim_seconds",
    "reclaim_pin_seconds": "spill_pin_seconds",
    "reclaim_copy_gpu_seconds": "spill_copy_gpu_seconds",
}


@dataclass(slots=True, eq=False)
class _Stash:
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


class _Saved:
    """A saved tensor as autograd holds it: a place in its layer's stash."""

    __slots__ = ("swapper", "layer", "offset", "span", "shape", "stride", "dtype", "__weakref__")

    def __init__(
        self,
        swapper: ActivationSwapper,
        layer: int,
        offset: int,
        span: int,
        t: torch.Tensor,
        stride: tuple[int, ...],
    ):
        self.swapper, self.layer, self.offset, self.span = swapper, layer, offset, span
        self.shape, self.stride, self.dtype = tuple(t.shape), stride, t.dtype

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.swapper._drop(self.layer)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class ActivationSwapper:
    """Saved activations of layer i live in layer i's stash in pool pages; `reclaim` spills whole stashes
    of layers outside the window to host slabs (pinned on CUDA, kept and reused for the run: `HostSlabs`)
    on a side stream and unmaps their pages; `host_reserve` bytes of slabs are made at construction
    (`slab_bytes` each; default: `SLAB_BYTES`, or one layer's stash when that is smaller).

    Wrap each layer's forward in ``with swapper.layer(i):``. Every saved tensor there that is not a
    parameter (nor one of `exclude`'s storages) and has at least `min_bytes` is copied into the stash and
    autograd keeps only its place. The range stays reserved while spilled, so when backward unpacks layer
    i its pages are mapped again at the same addresses and the bytes copied back; the `lookahead` layers
    below are prefetched on the side stream. Results are bit-identical to running without the swapper.
    A stash is reused once autograd has dropped all its tensors. `layer_bytes` bounds one layer's saved
    bytes; what does not fit stays an ordinary tensor. The trainer may move between streams when each
    new one waits for the one before (as the co-location feeder hands work over): spills are ordered after
    the stream of the latest pack or unpack, which is after all the trainer's earlier work.
    """

    def __init__(
        self,
        pool: PagePool,
        tenant: Tenant,
        *,
        layer_bytes: int,
        window: int = 1,
        lookahead: int = 1,
        exclude: Iterable[torch.Tensor] = (),
        min_bytes: int = 4096,
        host_reserve: int = 0,
        slab_bytes: int | None = None,
    ):
        self.pool, self.tenant, self.device = pool, tenant, pool.device
        self.layer_pages = -(-layer_bytes // pool.page_bytes)
        self.window, self.lookahead, self.min_bytes = window, lookahead, min_bytes
        self._exclude = storages(exclude)
        self._cuda = pool.backend == "cuda"
        self._stashes: dict[int, _Stash] = {}
        self._seen: dict[int, tuple[Any, int, Any]] = {}  # id(tensor) -> (ref, version, ref to _Saved)
        self._current: int | None = None
        self._backward = False
        self._lock = threading.RLock()
        # torch's raw (id, device, type) of the stream of the latest pack or unpack: reading it costs far
        # less than making a torch.cuda.Stream each call (the hooks run for every saved tensor).
        self._stream: tuple[int, int, int] | None = None
        self._side: Any = None
        self._holding = 0  # arena_held depth
        # A stash's bytes fill whole slabs but the last; a small model's stashes take one small slab each.
        slab = slab_bytes or min(SLAB_BYTES, self.layer_pages * pool.page_bytes)
        self.host = HostSlabs(slab, pinned=self._cuda)
        self.host.reserve(host_reserve)
        self._device_index = pool.device.index or 0
        self.stats = {
            "stashed_bytes": 0,
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
        pool.register_reclaimer(tenant, self.reclaim, self.reclaimable_pages)

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Stash what layer `index` saves for backward."""
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, index), self._unpack):
            yield

    @property
    def resident_pages(self) -> int:
        return sum(s.mapped for s in self._stashes.values())

    def reclaimable_pages(self) -> int:
        """Pages ``reclaim`` could free now: the mapped stashes outside the window (a snapshot)."""
        with self._lock:
            keep = self._window()
            return sum(s.mapped for i, s in self._stashes.items() if i not in keep)

    # -- autograd hooks ---------------------------------------------------------------------------------
    def _pack(self, layer: int, t: torch.Tensor) -> Any:
        # Cheapest checks first: this runs for every tensor autograd saves (hundreds per trainer micro-step,
        # on the thread that launches it).
        nbytes = t.nbytes
        if (
            nbytes < max(self.min_bytes, 1)
            or t.device != self.pool.device
            or stays_in_place(t, self._exclude)
        ):
            # Parameters (and views of them, like a frozen weight's transpose) stay where they are; detached,
            # since autograd must not get back a tensor that refers to its own graph (a reference cycle).
            return t.detach()
        with self._lock:
            self._current, self._backward = layer, False
            seen = self._seen.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] == t._version and seen[2]() is not None:
                return seen[2]()  # the same tensor saved twice (e.g. by two ops of the layer)
            if t.is_contiguous():
                stride, span = t.stride(), nbytes
            else:
                stride = _contiguous_strides(t.shape)
                span = t.numel() * t.element_size()
            stash = self._stash(layer)
            offset = -(-stash.used // _STASH_ALIGN) * _STASH_ALIGN
            if offset + span > stash.region.nbytes:
                self.stats["passthrough_bytes"] += nbytes
                return t.detach()
            if stash.host is not None or stash.ready is not None:
                self._ensure_resident(layer)
            pages = -(-(offset + span) // self.pool.page_bytes)
            if pages > stash.mapped:
                self._ensure_mapped(stash, layer, pages)
            self._note_stream()
            self._view(stash, offset, span, t.dtype, t.shape, stride).copy_(t)
            stash.used, stash.live = offset + span, stash.live + 1
            saved = _Saved(self, layer, offset, span, t, stride)
            self._seen[id(t)] = (weakref.ref(t), t._version, weakref.ref(saved))
            self.stats["stashed_bytes"] += span
            return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        with self._lock:
            self._current, self._backward = saved.layer, True
            self._note_stream()
            self._ensure_resident(saved.layer)
            for lower in range(saved.layer - 1, saved.layer - 1 - self.lookahead, -1):
                with contextlib.suppress(PoolExhausted):  # prefetch is best effort; unpack maps for real
                    self._bring_back(lower)
            stash = self._stashes[saved.layer]
            return self._view(stash, saved.offset, saved.span, saved.dtype, saved.shape, saved.stride)

    def _drop(self, layer: int) -> None:
        with self._lock:
            stash = self._stashes[layer]
            stash.live -= 1
            if stash.live == 0:  # nothing refers to the bytes any more: refill from the start
                if stash.host is not None:
                    self.host.give(stash.host)
                stash.used, stash.host = 0, None
                self._seen = {k: v for k, v in self._seen.items() if v[2]() is not None}

    def _note_stream(self) -> None:
        """Remember the stream the trainer launches on now (spills are ordered after it)."""
        if self._cuda:
            self._stream = torch._C._cuda_getCurrentStream(self._device_index)  # what current_stream reads

    def _last_stream(self) -> Any:
        """The stream of the latest pack or unpack as a torch Stream (the current one if none)."""
        if self._stream is None:
            return torch.cuda.current_stream(self.pool.device)
        sid, dev, kind = self._stream
        return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=kind)

    # -- stash management -------------------------------------------------------------------------------
    @staticmethod
    def _view(
        stash: _Stash, offset: int, span: int, dtype: torch.dtype, shape: Any, stride: Any
    ) -> torch.Tensor:
        """The bytes [offset, offset + span) of the stash as a tensor of `shape`/`stride` (offset is
        _STASH_ALIGN-aligned, so a whole number of elements)."""
        typed = stash.typed.get(dtype) if stash.typed is not None else None
        if typed is None:
            if stash.typed is None:
                stash.typed = {}
            typed = stash.typed[dtype] = stash.flat.view(dtype)
        return typed.as_strided(shape, stride, typed.storage_offset() + offset // dtype.itemsize)

    def _stash(self, layer: int) -> _Stash:
        if layer not in self._stashes:
            self._stashes[layer] = _Stash(self.pool.reserve(self.tenant, self.layer_pages))
        return self._stashes[layer]

    def _ensure_mapped(self, stash: _Stash, layer: int, n_pages: int) -> None:
        if n_pages <= stash.mapped:
            return
        pages = range(stash.mapped, n_pages)
        try:
            stash.region.map(pages)
        except PoolExhausted:
            # Spill this trainer's far layers first, then take idle pages from the other tenants.
            self._spill(len(pages), protect=self._window() | {layer})
            self.pool.reclaim(len(pages), requester=self.tenant)
            try:
                stash.region.map(pages)
            except PoolExhausted as e:
                raise type(e)(
                    f"trainer activations of layer {layer} need {len(pages)} more pages: {e}"
                ) from None
        stash.mapped = n_pages
        if stash.flat is None:
            stash.flat = stash.region.as_tensor()

    def _bring_back(self, layer: int) -> None:
        """Map a spilled stash again and start copying its bytes back (on the side stream on CUDA)."""
        stash = self._stashes.get(layer)
        if stash is None or stash.host is None or stash.ready is not None or stash.mapped:
            return
        self._ensure_mapped(stash, layer, -(-stash.used // self.pool.page_bytes))
        dst = stash.flat[: stash.used]
        if self._cuda:
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

    def _ensure_resident(self, layer: int) -> None:
        stash = self._stashes.get(layer)
        if stash is None:
            return
        if stash.host is not None and not stash.mapped:
            self._bring_back(layer)
        if stash.ready is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(stash.ready)
            stash.ready = None

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.pool.device)
        return self._side

    def _window(self) -> set[int]:
        """Layers to keep: the current one, and in backward the `window` layers it needs next (all of them
        inside ``arena_held``)."""
        if self._holding:
            return set(self._stashes)
        if self._current is None:
            return set()
        below = self.window if self._backward else 0
        return set(range(self._current - below, self._current + 1))

    def reclaim(self, n_pages: int) -> int:
        """Pool callback: spill stashes of layers outside the window until n_pages are free; returns pages
        freed. Blocks until the copies (and the trainer's queued work) are done."""
        with self._lock:
            st = self.stats
            before = {spill: st[spill] for spill in _RECLAIM_SHARE.values()}
            pages = self._spill(n_pages, protect=self._window())
            if pages:
                st["reclaims"] += 1
                st["reclaim_pages"] += pages
                for reclaim, spill in _RECLAIM_SHARE.items():
                    st[reclaim] += st[spill] - before[spill]
            return pages

    def release_idle(self) -> int:
        """Unmap every stash that holds nothing (after an abandoned step, all of them: an arena's too), so
        the trainer's other allocations can have its pages; a stash maps pages again when its layer next
        saves. Ordered after the trainer's queued work; returns the pages freed."""
        with self._lock:
            for stash in self._stashes.values():
                if stash.fixed:  # an arena's bytes belong to the abandoned step too
                    self._discard(stash)
            holding = {i for i, s in self._stashes.items() if s.holds}
            return self._spill(self.tenant.stats()["used_pages"], protect=holding)

    # -- a graphs' saved-tensor arena -----------------------------------------------------------------
    # The slots of a `SavedArena` (train/saved_arena.py) placed in chunk i's stash, at fixed places: the
    # step's CUDA graphs read and write their addresses, so they are never moved, only unmapped (spilled
    # first while a backward still needs them) and mapped again at the same addresses before a replay.
    def arena_slot(self, chunk: int, shape: Any, dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous tensor of ``shape``/``dtype`` at the next free place of chunk ``chunk``'s stash,
        kept there for good; None when the stash has no room left (the arena then allocates it itself)."""
        numel = 1
        for size in shape:
            numel *= int(size)
        span = numel * dtype.itemsize
        with self._lock:
            stash = self._stash(chunk)
            stash.fixed = True
            self._current, self._backward = chunk, False
            self._note_stream()
            offset = -(-stash.used // _STASH_ALIGN) * _STASH_ALIGN
            if offset + span > stash.region.nbytes:
                self.stats["passthrough_bytes"] += span
                return None
            self._make_writable(chunk, stash)
            self._ensure_mapped(stash, chunk, -(-(offset + span) // self.pool.page_bytes))
            stash.used = offset + span
            self.stats["stashed_bytes"] += span
            return self._view(stash, offset, span, dtype, tuple(shape), _contiguous_strides(shape))

    def arena_before(self, chunk: int, backward: bool) -> None:
        """Ready chunk ``chunk``'s stash for a replay launched next on the current stream: for its forward,
        its pages mapped (what they held is dead: the forward writes every slot); for its backward, its
        bytes back in place, and the ``lookahead`` chunks below it on their way back."""
        with self._lock:
            self._current, self._backward = chunk, backward
            self._note_stream()
            stash = self._stashes.get(chunk)
            if stash is None:
                return
            if not backward:
                self._make_writable(chunk, stash)
                return
            self._ensure_resident(chunk)
            for lower in range(chunk - 1, chunk - 1 - self.lookahead, -1):
                with contextlib.suppress(PoolExhausted):
                    self._bring_back(lower)

    def arena_after_backward(self, chunk: int) -> None:
        """Chunk ``chunk``'s backward has been launched: once the trainer's queued work has run, its stash's
        bytes are dead (a reclaim unmaps them without a copy)."""
        with self._lock:
            stash = self._stashes.get(chunk)
            if stash is not None:
                stash.dead = True

    @contextlib.contextmanager
    def arena_held(self) -> Iterator[None]:
        """Inside, every arena stash is mapped with its bytes in place and no reclaim takes one (around a
        capture, whose eager pass and graphs touch every chunk's slots)."""
        with self._lock:
            self._holding += 1
            for index, stash in self._stashes.items():
                if stash.fixed:
                    self._ensure_resident(index)
                    self._ensure_mapped(stash, index, -(-stash.used // self.pool.page_bytes))
        try:
            yield
        finally:
            with self._lock:
                self._holding -= 1

    def arena_reset(self) -> None:
        """The arena's slots are gone (its graphs released): its stashes fill from the start again. Call
        with no replay of them queued."""
        with self._lock:
            for stash in self._stashes.values():
                if stash.fixed:
                    self._discard(stash)
                    stash.used, stash.fixed, stash.dead = 0, False, False

    def _make_writable(self, chunk: int, stash: _Stash) -> None:
        """The stash mapped for a forward that writes it anew: a spilled copy is dropped, a copy back in
        flight waited for (it must not land after the forward's writes)."""
        if stash.host is not None:
            self._discard(stash)
        if stash.ready is not None:
            self._ensure_resident(chunk)
        self._ensure_mapped(stash, chunk, -(-stash.used // self.pool.page_bytes))
        stash.dead = False

    def _discard(self, stash: _Stash) -> None:
        """Forget the stash's bytes: its spilled copy goes back to the slabs, and it is dead."""
        if stash.host is not None:
            self.host.give(stash.host)
            stash.host = None
        stash.dead = True

    def stats_snapshot(self) -> dict[str, Any]:
        """A copy of ``stats``, consistent (taken under the lock the spills hold)."""
        with self._lock:
            return dict(self.stats)

    def _spill(self, n_pages: int, protect: set[int]) -> int:
        # Empty and dead stashes cost nothing to unmap; then the lowest layers, which backward needs last.
        order = sorted(self._stashes.items(), key=lambda kv: (kv[1].holds, kv[0]))
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
        if self._cuda:
            side = self._side_stream()
            # Also orders the unmap after every queued trainer kernel that may still read the pages.
            side.wait_stream(self._last_stream())
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
