"""Saved activations stashed per layer in pool pages; when the KV cache is short, the pool asks the swapper
to ``reclaim(n_pages)`` and it spills layers outside its window to host memory. The pages themselves (map,
spill, bring back) are ``stash_pages.StashPages``'; this module decides what goes where and when."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from harli_train.saved_tensors import stays_in_place, storages

from .native import PagePool, PoolExhausted, Tenant
from .stash_pages import STASH_ALIGN, StashPages, contiguous_strides

# The counters of the spills a reclaim (another tenant's request) made, and the spill counters they take from.
_RECLAIM_SHARE = {
    "reclaim_spilled_bytes": "swap_out_bytes",
    "reclaim_copy_seconds": "reclaim_seconds",
    "reclaim_pin_seconds": "spill_pin_seconds",
    "reclaim_copy_gpu_seconds": "spill_copy_gpu_seconds",
}


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


class ActivationSwapper:
    """Saved activations of layer i live in layer i's stash in pool pages; `reclaim` spills whole stashes
    of layers outside the window to host slabs (pinned on CUDA, kept and reused for the run: `HostSlabs`)
    on a side stream and unmaps their pages; `host_reserve` bytes of slabs are made at construction
    (`slab_bytes` each; default: `SLAB_BYTES`, or one layer's stash when that is smaller).

    Wrap each layer's forward in ``with swapper.layer(i):``. Every saved tensor there that is not a parameter
    (nor one of `exclude`'s storages) and has at least `min_bytes` is copied into the stash and autograd keeps
    only its place (a smaller one stays an ordinary tensor: each pack and unpack costs the launching thread
    the same whatever the size; `pool_budget.stash_min_bytes` is the co-located rule). The range stays
    reserved while spilled, so when backward unpacks layer i its pages are mapped again at the same addresses
    and the bytes copied back; the `lookahead` layers below are prefetched on the side stream. Results are
    bit-identical to running without the swapper.
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
        self.window, self.lookahead, self.min_bytes = window, lookahead, min_bytes
        self._exclude = storages(exclude)
        self._seen: dict[int, tuple[Any, int, Any]] = {}  # id(tensor) -> (ref, version, ref to _Saved)
        self._current: int | None = None
        self._backward = False
        self._holding = 0  # arena_held depth
        self.pages = StashPages(
            pool,
            tenant,
            -(-layer_bytes // pool.page_bytes),
            self._window,
            host_reserve=host_reserve,
            slab_bytes=slab_bytes,
        )
        self._lock = self.pages.lock
        self.stats = self.pages.stats  # the store's counters (one dict: the swapper adds to it too)
        self.host = self.pages.host
        pool.register_reclaimer(tenant, self.reclaim, self.reclaimable_pages)

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Stash what layer `index` saves for backward."""
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, index), self._unpack):
            yield

    @property
    def resident_pages(self) -> int:
        return self.pages.resident_pages

    def reclaimable_pages(self) -> int:
        """Pages ``reclaim`` could free now: the mapped stashes outside the window (a snapshot)."""
        with self._lock:
            keep = self._window()
            return sum(s.mapped for i, s in self.pages.stashes.items() if i not in keep)

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
                stride = contiguous_strides(t.shape)
                span = t.numel() * t.element_size()
            stash = self.pages.stash(layer)
            offset = -(-stash.used // STASH_ALIGN) * STASH_ALIGN
            if offset + span > stash.region.nbytes:
                self.stats["passthrough_bytes"] += nbytes
                return t.detach()
            if stash.host is not None or stash.ready is not None:
                self.pages.ensure_resident(layer)
            pages = -(-(offset + span) // self.pool.page_bytes)
            if pages > stash.mapped:
                self.pages.ensure_mapped(stash, layer, pages)
            self.pages.note_stream()
            stash.view(offset, span, t.dtype, t.shape, stride).copy_(t)
            stash.used, stash.live = offset + span, stash.live + 1
            saved = _Saved(self, layer, offset, span, t, stride)
            self._seen[id(t)] = (weakref.ref(t), t._version, weakref.ref(saved))
            self.stats["stashed_bytes"] += span
            self.stats["stashed_tensors"] += 1
            return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        with self._lock:
            self._current, self._backward = saved.layer, True
            self.pages.note_stream()
            self.pages.ensure_resident(saved.layer)
            for lower in range(saved.layer - 1, saved.layer - 1 - self.lookahead, -1):
                with contextlib.suppress(PoolExhausted):  # prefetch is best effort; unpack maps for real
                    self.pages.bring_back(lower)
            stash = self.pages.stashes[saved.layer]
            return stash.view(saved.offset, saved.span, saved.dtype, saved.shape, saved.stride)

    def _drop(self, layer: int) -> None:
        with self._lock:
            stash = self.pages.stashes[layer]
            stash.live -= 1
            if stash.live == 0:  # nothing refers to the bytes any more: refill from the start
                if stash.host is not None:
                    self.host.give(stash.host)
                stash.used, stash.host = 0, None
                self._seen = {k: v for k, v in self._seen.items() if v[2]() is not None}

    def _window(self) -> set[int]:
        """Layers to keep: the current one, and in backward the `window` layers it needs next (all of them
        inside ``arena_held``)."""
        if self._holding:
            return set(self.pages.stashes)
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
            pages = self.pages.spill(n_pages, protect=self._window())
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
            for stash in self.pages.stashes.values():
                if stash.fixed:  # an arena's bytes belong to the abandoned step too
                    self.pages.discard(stash)
            holding = {i for i, s in self.pages.stashes.items() if s.holds}
            return self.pages.spill(self.tenant.stats()["used_pages"], protect=holding)

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
            stash = self.pages.stash(chunk)
            stash.fixed = True
            self._current, self._backward = chunk, False
            self.pages.note_stream()
            offset = -(-stash.used // STASH_ALIGN) * STASH_ALIGN
            if offset + span > stash.region.nbytes:
                self.stats["passthrough_bytes"] += span
                return None
            self.pages.make_writable(chunk, stash)
            self.pages.ensure_mapped(stash, chunk, -(-(offset + span) // self.pool.page_bytes))
            stash.used = offset + span
            self.stats["stashed_bytes"] += span
            self.stats["stashed_tensors"] += 1
            return stash.view(offset, span, dtype, tuple(shape), contiguous_strides(shape))

    def arena_before(self, chunk: int, backward: bool) -> None:
        """Ready chunk ``chunk``'s stash for a replay launched next on the current stream: for its forward,
        its pages mapped (what they held is dead: the forward writes every slot); for its backward, its
        bytes back in place, and the ``lookahead`` chunks below it on their way back."""
        with self._lock:
            self._current, self._backward = chunk, backward
            self.pages.note_stream()
            stash = self.pages.stashes.get(chunk)
            if stash is None:
                return
            if not backward:
                self.pages.make_writable(chunk, stash)
                return
            self.pages.ensure_resident(chunk)
            for lower in range(chunk - 1, chunk - 1 - self.lookahead, -1):
                with contextlib.suppress(PoolExhausted):
                    self.pages.bring_back(lower)

    def arena_after_backward(self, chunk: int) -> None:
        """Chunk ``chunk``'s backward has been launched: once the trainer's queued work has run, its stash's
        bytes are dead (a reclaim unmaps them without a copy)."""
        with self._lock:
            stash = self.pages.stashes.get(chunk)
            if stash is not None:
                stash.dead = True

    @contextlib.contextmanager
    def arena_held(self) -> Iterator[None]:
        """Inside, every arena stash is mapped with its bytes in place and no reclaim takes one (around a
        capture, whose eager pass and graphs touch every chunk's slots)."""
        with self._lock:
            self._holding += 1
            for index, stash in self.pages.stashes.items():
                if stash.fixed:
                    self.pages.ensure_resident(index)
                    self.pages.ensure_mapped(stash, index, -(-stash.used // self.pool.page_bytes))
        try:
            yield
        finally:
            with self._lock:
                self._holding -= 1

    def arena_reset(self) -> None:
        """The arena's slots are gone (its graphs released): its stashes fill from the start again. Call
        with no replay of them queued."""
        with self._lock:
            for stash in self.pages.stashes.values():
                if stash.fixed:
                    self.pages.discard(stash)
                    stash.used, stash.fixed, stash.dead = 0, False, False

    def stats_snapshot(self) -> dict[str, Any]:
        """A copy of ``stats``, consistent (taken under the lock the spills hold)."""
        return self.pages.stats_snapshot()

    def arena_bytes(self) -> int:
        """Bytes of a graphs' arena placed in the stashes now (``StashPages.arena_bytes``)."""
        return self.pages.arena_bytes()
