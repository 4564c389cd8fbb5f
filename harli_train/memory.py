"""One pool of physical GPU pages shared by the decode engine's KV cache and the trainer.

The native library (allocator/, built as ``harli_train._vmm``) maps pages of the driver's granularity
(2 MiB on the H200) into reserved virtual ranges through the CUDA VMM API, or pages of a memfd on the
host backend that tests use. This module holds its ctypes bindings and the pool's three users:

- ``PooledKVStorage``: the engine's paged KV cache, one tensor over one reserved range whose prefix of
  blocks grows and shrinks by mapping pages (no copy, fixed addresses);
- ``TrainerMemory``: the trainer's torch allocations, routed into the pool through ``torch.cuda.MemPool``;
- ``ActivationSwapper``: saved activations stashed per layer in pool pages; when the KV cache is short,
  the pool asks it to ``reclaim(n_pages)`` and it spills layers outside its window to host memory.

Unmapping never waits for queued GPU work: whoever unmaps synchronises first (each method says how).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_OK, _EXHAUSTED, _QUOTA, _INVALID, _BACKEND, _UNAVAILABLE = range(6)
_BACKENDS = {"auto": 0, "cuda": 1, "host": 2}
_STATS_FIELDS = (
    "page_bytes budget_pages created_pages free_pages owned_pages tenants regions create_calls create_ns "
    "map_calls map_ns set_access_calls set_access_ns unmap_calls unmap_ns exhausted_errors quota_errors "
    "torch_allocs torch_frees"
).split()
_TENANT_FIELDS = "quota_pages used_pages peak_pages regions pages_mapped_total pages_unmapped_total".split()
# torch's allocator aligns blocks to 512 bytes; stashed tensors get the same alignment, so kernels that pick
# code paths by pointer alignment (cuBLAS, MKL) take the same ones and results stay bit-identical.
_STASH_ALIGN = 512


class PoolError(RuntimeError):
    """A pool call failed; the message says why."""


class PoolExhausted(PoolError):
    """The pool has fewer free pages than asked for."""


class QuotaExceeded(PoolExhausted):
    """A tenant would go over its quota."""


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in _STATS_FIELDS]


class _TenantStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in _TENANT_FIELDS]


def native_library_path() -> str | None:
    """Path of the built ``harli_train._vmm`` library, or None when it was not built."""
    spec = importlib.util.find_spec("harli_train._vmm")
    return spec.origin if spec is not None else None


@functools.cache
def _lib() -> ctypes.CDLL:
    path = native_library_path()
    if path is None:
        raise PoolError(
            "the native page pool (harli_train._vmm) is not built: run `pip install -e .` in the repository "
            "root (it compiles allocator/*.cpp with g++)"
        )
    lib = ctypes.CDLL(path)
    c_int, c_size, c_void_p, c_u64 = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64
    signatures = {
        "hvmm_last_error": ([], ctypes.c_char_p),
        "hvmm_cuda_available": ([], c_int),
        "hvmm_stats_size": ([], c_size),
        "hvmm_tenant_stats_size": ([], c_size),
        "hvmm_pool_create": ([c_int, c_int, c_size, c_size, c_int, ctypes.POINTER(c_void_p)], c_int),
        "hvmm_pool_destroy": ([c_void_p], None),
        "hvmm_pool_backend": ([c_void_p], c_int),
        "hvmm_pool_page_bytes": ([c_void_p], c_size),
        "hvmm_tenant_add": ([c_void_p, ctypes.c_char_p, c_size, ctypes.POINTER(c_int)], c_int),
        "hvmm_tenant_set_quota": ([c_void_p, c_int, c_size], c_int),
        "hvmm_tenant_stats": ([c_void_p, c_int, ctypes.POINTER(_TenantStats)], c_int),
        "hvmm_region_reserve": (
            [c_void_p, c_int, c_size, ctypes.POINTER(c_int), ctypes.POINTER(c_u64)],
            c_int,
        ),
        "hvmm_region_release": ([c_void_p, c_int], c_int),
        "hvmm_region_map": ([c_void_p, c_int, ctypes.POINTER(c_size), c_size], c_int),
        "hvmm_region_unmap": ([c_void_p, c_int, ctypes.POINTER(c_size), c_size], c_int),
        "hvmm_region_mapped": ([c_void_p, c_int, ctypes.POINTER(ctypes.c_uint8), c_size], c_int),
        "hvmm_pool_find": ([c_void_p, c_u64, ctypes.POINTER(c_int)], c_int),
        "hvmm_pool_check": ([c_void_p], c_int),
        "hvmm_pool_stats": ([c_void_p, ctypes.POINTER(_Stats)], c_int),
        "hvmm_pool_synchronize": ([c_void_p, c_void_p], c_int),
        "hvmm_torch_bind": ([c_void_p, c_int], c_int),
        "hvmm_torch_alloc": ([c_size, c_int, c_void_p], c_void_p),
        "hvmm_torch_free": ([c_void_p, c_size, c_int, c_void_p], None),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    sizes = (lib.hvmm_stats_size(), lib.hvmm_tenant_stats_size())
    if sizes != (ctypes.sizeof(_Stats), ctypes.sizeof(_TenantStats)):
        raise PoolError(f"{path} does not match harli_train/memory.py: rebuild it with `pip install -e .`")
    return lib


def _check(status: int) -> None:
    if status == _OK:
        return
    msg = (_lib().hvmm_last_error() or b"").decode()
    raise {_EXHAUSTED: PoolExhausted, _QUOTA: QuotaExceeded}.get(status, PoolError)(msg)


def cuda_driver_available() -> bool:
    """True when libcuda.so.1 loads and reports a device (False on machines without a GPU)."""
    return bool(_lib().hvmm_cuda_available())


def _slot_array(slots: list[int]) -> ctypes.Array:
    return (ctypes.c_size_t * len(slots))(*slots)


@dataclass(frozen=True, slots=True)
class Tenant:
    """A user of the pool with a quota (pages it may own at once) and usage."""

    pool: PagePool
    id: int
    name: str

    def stats(self) -> dict[str, int]:
        out = _TenantStats()
        _check(_lib().hvmm_tenant_stats(self.pool._handle, self.id, ctypes.byref(out)))
        return {name: getattr(out, name) for name in _TENANT_FIELDS}

    def set_quota(self, quota_pages: int | None) -> None:
        _check(_lib().hvmm_tenant_set_quota(self.pool._handle, self.id, quota_pages or 0))


class PagePool:
    """A budget of physical pages shared by tenants; every page is free or owned by one tenant.

    backend: "cuda" (VMM on `device`), "host" (memfd pages of `host_page_bytes`, for tests) or "auto"
    (CUDA when the driver loads, host otherwise). precreate: create every physical page now (creating
    costs ~4x mapping on the H200) instead of on first use.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        backend: str = "auto",
        device: int = 0,
        host_page_bytes: int = 2 << 20,
        precreate: bool = True,
    ):
        if backend not in _BACKENDS:
            raise ValueError(f"PagePool: backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
        lib = _lib()
        handle = ctypes.c_void_p()
        _check(
            lib.hvmm_pool_create(
                _BACKENDS[backend],
                device,
                budget_bytes,
                host_page_bytes,
                int(precreate),
                ctypes.byref(handle),
            )
        )
        self._handle = handle
        self._close = weakref.finalize(self, lib.hvmm_pool_destroy, handle)
        self.backend = "cuda" if lib.hvmm_pool_backend(handle) == _BACKENDS["cuda"] else "host"
        self.device = torch.device("cuda", device) if self.backend == "cuda" else torch.device("cpu")
        self.page_bytes: int = lib.hvmm_pool_page_bytes(handle)
        self.budget_pages: int = self.stats()["budget_pages"]
        self._reclaimers: list[tuple[Tenant, Callable[[int], int]]] = []
        self.reclaim_stats = {"calls": 0, "pages_asked": 0, "pages_freed": 0, "seconds": 0.0}

    def close(self) -> None:
        """Unmap and release everything; no queued device work may use the pool any more."""
        self._close()

    def __enter__(self) -> PagePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def free_pages(self) -> int:
        return self.stats()["free_pages"]

    def add_tenant(self, name: str, quota_pages: int | None = None) -> Tenant:
        tid = ctypes.c_int()
        _check(_lib().hvmm_tenant_add(self._handle, name.encode(), quota_pages or 0, ctypes.byref(tid)))
        return Tenant(self, tid.value, name)

    def reserve(self, tenant: Tenant, n_pages: int) -> Region:
        """A virtual range of n_pages pages for `tenant`, nothing mapped yet."""
        return Region(self, tenant, n_pages)

    def register_reclaimer(self, tenant: Tenant, reclaim: Callable[[int], int]) -> None:
        """`reclaim(n_pages) -> pages_freed` is called when another tenant is short of pages."""
        self._reclaimers.append((tenant, reclaim))

    def reclaim(self, n_pages: int, requester: Tenant | None = None) -> int:
        """Ask the other tenants' reclaimers, in registration order, to free n_pages; returns pages freed."""
        t0, freed = time.perf_counter(), 0
        for tenant, fn in list(self._reclaimers):
            if freed >= n_pages:
                break
            if requester is None or tenant.id != requester.id:
                freed += int(fn(n_pages - freed))
        rs = self.reclaim_stats
        rs["calls"] += 1
        rs["pages_asked"] += n_pages
        rs["pages_freed"] += freed
        rs["seconds"] += time.perf_counter() - t0
        return freed

    def check(self) -> None:
        """Raise PoolError unless every page is free or owned by exactly one tenant (accounting invariant)."""
        _check(_lib().hvmm_pool_check(self._handle))

    def synchronize(self, stream: Any = None) -> None:
        """Wait for queued work on `stream` (a torch.cuda.Stream, optional) and on the device."""
        handle = None if stream is None else ctypes.c_void_p(stream.cuda_stream)
        _check(_lib().hvmm_pool_synchronize(self._handle, handle))

    def find(self, addr: int) -> int | None:
        """Id of the region whose reserved range holds `addr`, or None."""
        rid = ctypes.c_int()
        return rid.value if _lib().hvmm_pool_find(self._handle, addr, ctypes.byref(rid)) == _OK else None

    def stats(self) -> dict[str, Any]:
        """Pages, call counts and driver times (microseconds) of the pool."""
        out = _Stats()
        _check(_lib().hvmm_pool_stats(self._handle, ctypes.byref(out)))
        s: dict[str, Any] = {name: getattr(out, name) for name in _STATS_FIELDS}
        for call in ("create", "map", "set_access", "unmap"):
            s[f"{call}_us"] = s.pop(f"{call}_ns") / 1e3
        return s


class _DeviceRange:
    """A device address range as `__cuda_array_interface__`, so torch can wrap it without a copy.
    The tensor keeps this object, and through it the region and its pool, alive."""

    def __init__(self, region: Region):
        self.region = region
        self.__cuda_array_interface__ = {
            "shape": (region.nbytes,),
            "typestr": "|u1",
            "data": (region.va, False),
            "strides": None,
            "version": 2,
        }


class Region:
    """A reserved virtual range of `n_pages` pages owned by a tenant; pages are mapped into its slots."""

    def __init__(self, pool: PagePool, tenant: Tenant, n_pages: int):
        rid, va = ctypes.c_int(), ctypes.c_uint64()
        _check(
            _lib().hvmm_region_reserve(pool._handle, tenant.id, n_pages, ctypes.byref(rid), ctypes.byref(va))
        )
        self.pool, self.tenant, self.id = pool, tenant, rid.value
        self.va, self.n_pages, self.nbytes = va.value, n_pages, n_pages * pool.page_bytes

    def map(self, pages: Iterable[int], *, reclaim: bool = False) -> None:
        """Map a free page into each slot in `pages`, all or nothing; contents are undefined.

        reclaim: when the pool is short, ask the other tenants' reclaimers for the difference first."""
        slots = sorted(pages)
        if not slots:
            return
        try:
            _check(_lib().hvmm_region_map(self.pool._handle, self.id, _slot_array(slots), len(slots)))
        except QuotaExceeded:
            raise
        except PoolExhausted as e:
            if not reclaim:
                raise
            short = len(slots) - self.pool.free_pages
            freed = self.pool.reclaim(short, requester=self.tenant)
            try:
                _check(_lib().hvmm_region_map(self.pool._handle, self.id, _slot_array(slots), len(slots)))
            except PoolExhausted as again:
                raise type(again)(
                    f"{again} (after reclaiming {freed} of {short} pages from other tenants)"
                ) from e

    def unmap(self, pages: Iterable[int]) -> None:
        """Unmap the slots in `pages`, all or nothing. Synchronise every stream that may touch them first."""
        slots = sorted(pages)
        if slots:
            _check(_lib().hvmm_region_unmap(self.pool._handle, self.id, _slot_array(slots), len(slots)))

    def mapped(self) -> list[bool]:
        out = (ctypes.c_uint8 * self.n_pages)()
        _check(_lib().hvmm_region_mapped(self.pool._handle, self.id, out, self.n_pages))
        return [bool(x) for x in out]

    def release(self) -> None:
        """Unmap everything and free the range; tensors over it become dangling."""
        _check(_lib().hvmm_region_release(self.pool._handle, self.id))

    def as_tensor(self) -> torch.Tensor:
        """A uint8 tensor over the whole range, no copy. Touch only mapped pages."""
        if self.pool.backend == "host":
            buffer = (ctypes.c_uint8 * self.nbytes).from_address(self.va)
            buffer.region = self  # the tensor keeps the buffer, hence the region and its pool, alive
            return torch.frombuffer(buffer, dtype=torch.uint8)
        # torch asks the driver which device owns the first address: it must be mapped at that moment.
        temporary = not self.mapped()[0]
        if temporary:
            self.map([0], reclaim=True)
        try:
            return torch.as_tensor(_DeviceRange(self), device=self.pool.device)
        finally:
            if temporary:
                self.unmap([0])


def _wait(wait: Any, device: torch.device) -> None:
    """Block until `wait` (a torch Stream or Event) is done; None means the whole device."""
    if device.type != "cuda":
        return
    if wait is None:
        torch.cuda.synchronize(device)
    else:
        wait.synchronize()


class PooledKVStorage:
    """The decode engine's paged KV cache in pool pages (the engine's ``KVStorage`` protocol).

    One reserved range holds ``data`` [num_layers, 2, max_blocks, *spec.block_shape]; each layer's K and V
    plane is cut into pages of ``blocks_per_page`` blocks, and page group g (page g of every plane) holds
    blocks [g * blocks_per_page, (g + 1) * blocks_per_page) of all layers. The first ``num_blocks`` blocks
    are mapped; ``grow`` maps groups (asking the trainer to give pages back when the pool is short) and
    ``shrink`` unmaps them, so addresses and strides never change (CUDA graphs stay valid).
    Group 0 is always mapped, so padded block-table entries (block 0) stay readable; other unmapped
    blocks are backed by nothing (no zero page): block tables must name only blocks < num_blocks.
    spec: any object with ``num_layers``, ``block_shape`` and ``dtype`` (engine.kv_cache.KVCacheSpec).
    """

    def __init__(self, pool: PagePool, spec: Any, max_blocks: int, *, tenant: Tenant | None = None):
        block_bytes = math.prod(spec.block_shape) * torch.empty((), dtype=spec.dtype).element_size()
        if pool.page_bytes % block_bytes:
            raise ValueError(
                f"PooledKVStorage: one layer's K block is {block_bytes} bytes, which does not divide "
                f"the pool page of {pool.page_bytes} bytes; pick a block_size that does"
            )
        self.spec, self.pool = spec, pool
        self.tenant = tenant or pool.add_tenant("kv")
        self.blocks_per_page = pool.page_bytes // block_bytes
        self.n_groups = -(-max_blocks // self.blocks_per_page)
        self.max_blocks = self.n_groups * self.blocks_per_page
        self._planes = 2 * spec.num_layers
        self._lock = threading.Lock()
        self._groups = 0
        self.region = pool.reserve(self.tenant, self._planes * self.n_groups)
        self.grow(1)
        shape = (spec.num_layers, 2, self.max_blocks, *spec.block_shape)
        self.data = self.region.as_tensor().view(spec.dtype).view(shape)

    @property
    def num_blocks(self) -> int:
        return self._groups * self.blocks_per_page

    @property
    def mapped_bytes(self) -> int:
        return self._groups * self._planes * self.pool.page_bytes

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0, : self.num_blocks]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1, : self.num_blocks]

    def pages(self) -> torch.Tensor:
        """The 2-D page view [num_layers, 2, n_groups, blocks_per_page, *block_shape] of the whole range."""
        return self.data.view(
            self.spec.num_layers, 2, self.n_groups, self.blocks_per_page, *self.spec.block_shape
        )

    def _slots(self, first: int, stop: int) -> list[int]:
        return [plane * self.n_groups + g for plane in range(self._planes) for g in range(first, stop)]

    def grow(self, num_blocks: int) -> int:
        """Map pages so that at least `num_blocks` blocks exist (rounded up to whole page groups, at most
        max_blocks); reclaims from other tenants when the pool is short. Returns the new num_blocks."""
        with self._lock:
            groups = min(self.n_groups, -(-num_blocks // self.blocks_per_page))
            if groups > self._groups:
                self.region.map(self._slots(self._groups, groups), reclaim=True)
                self._groups = groups
            return self.num_blocks

    def shrink(self, num_blocks: int, wait: Any = None) -> int:
        """Unmap page groups wholly past `num_blocks` (never group 0); the caller guarantees those blocks are
        free. Waits for `wait` (the decode stream or an event after its last use; None = whole device)
        before unmapping. Returns the new num_blocks."""
        with self._lock:
            groups = max(1, -(-num_blocks // self.blocks_per_page))
            if groups < self._groups:
                _wait(wait, self.pool.device)
                self.region.unmap(self._slots(groups, self._groups))
                self._groups = groups
            return self.num_blocks


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

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Route allocations to the pool: those on the current stream from any thread (so backward's
        autograd threads are covered) when it is not the default stream, else this thread's."""
        dev = self.pool.device.index
        by_stream = torch.cuda.current_stream(dev).cuda_stream != 0 and hasattr(
            torch._C, "_cuda_beginAllocateCurrentStreamToPool"
        )
        begin = (
            torch._C._cuda_beginAllocateCurrentStreamToPool
            if by_stream
            else torch._C._cuda_beginAllocateCurrentThreadToPool
        )
        begin(dev, self.mempool.id)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(dev, self.mempool.id)
            torch._C._cuda_releasePool(dev, self.mempool.id)

    def close(self) -> None:
        """Drop the MemPool so torch frees its segments into the pool. Every tensor allocated in scope()
        must be dead by now (torch frees survivors with cudaFree otherwise: pytorch#146431)."""
        self.mempool = None
        torch.cuda.synchronize(self.pool.device)
        torch.cuda.empty_cache()
        _check(_lib().hvmm_torch_bind(None, -1))


@dataclass(slots=True, eq=False)
class _Stash:
    """One layer's saved activations: a reserved range filled front to back, mapped as a prefix."""

    region: Region
    flat: torch.Tensor | None = None  # uint8 view of the range, made once page 0 is mapped
    used: int = 0  # bytes filled
    mapped: int = 0  # pages mapped: [0, mapped)
    live: int = 0  # saved tensors autograd still holds
    host: torch.Tensor | None = None  # the spilled bytes while the pages are unmapped, or until `ready`
    ready: Any = None  # event of an in-flight copy back to the device


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
    of layers outside the window to (pinned) host memory on a side stream and unmaps their pages.

    Wrap each layer's forward in ``with swapper.layer(i):``. Every saved tensor there that is not a
    parameter (nor one of `exclude`'s storages) and has at least `min_bytes` is copied into the stash and
    autograd keeps only its place. The range stays reserved while spilled, so when backward unpacks layer
    i its pages are mapped again at the same addresses and the bytes copied back; the `lookahead` layers
    below are prefetched on the side stream. Results are bit-identical to running without the swapper.
    A stash is reused once autograd has dropped all its tensors. `layer_bytes` bounds one layer's saved
    bytes; what does not fit stays an ordinary tensor. One trainer stream is assumed.
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
    ):
        self.pool, self.tenant = pool, tenant
        self.layer_pages = -(-layer_bytes // pool.page_bytes)
        self.window, self.lookahead, self.min_bytes = window, lookahead, min_bytes
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._cuda = pool.backend == "cuda"
        self._stashes: dict[int, _Stash] = {}
        self._seen: dict[int, tuple[Any, int, Any]] = {}  # id(tensor) -> (ref, version, ref to _Saved)
        self._current: int | None = None
        self._backward = False
        self._lock = threading.RLock()
        self._stream: Any = None
        self._side: Any = None
        self.stats = {
            "stashed_bytes": 0,
            "passthrough_bytes": 0,
            "swap_out_bytes": 0,
            "swap_in_bytes": 0,
            "swap_outs": 0,
            "swap_ins": 0,
            "reclaimed_pages": 0,
            "reclaim_seconds": 0.0,
        }
        pool.register_reclaimer(tenant, self.reclaim)

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Stash what layer `index` saves for backward."""
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, index), self._unpack):
            yield

    @property
    def resident_pages(self) -> int:
        return sum(s.mapped for s in self._stashes.values())

    # -- autograd hooks ---------------------------------------------------------------------------------
    def _pack(self, layer: int, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if (
            nbytes < max(self.min_bytes, 1)
            or t.device != self.pool.device
            or (t.requires_grad and t.is_leaf)
            or isinstance(t, torch.nn.Parameter)
            or isinstance(t._base, torch.nn.Parameter)
            or t.untyped_storage().data_ptr() in self._exclude
        ):
            # Parameters (and views of them, like a frozen weight's transpose) stay where they are; detached,
            # since autograd must not get back a tensor that refers to its own graph (a reference cycle).
            return t.detach()
        with self._lock:
            self._current, self._backward = layer, False
            seen = self._seen.get(id(t))
            if seen is not None and seen[0]() is t and seen[1] == t._version and seen[2]() is not None:
                return seen[2]()  # the same tensor saved twice (e.g. by two ops of the layer)
            stride = t.stride() if t.is_contiguous() else _contiguous_strides(t.shape)
            span = (1 + sum((n - 1) * s for n, s in zip(t.shape, stride, strict=True))) * t.element_size()
            stash = self._stash(layer)
            offset = -(-stash.used // _STASH_ALIGN) * _STASH_ALIGN
            if offset + span > stash.region.nbytes:
                self.stats["passthrough_bytes"] += nbytes
                return t.detach()
            self._ensure_resident(layer)
            self._ensure_mapped(stash, layer, -(-(offset + span) // self.pool.page_bytes))
            if self._cuda and self._stream is None:
                self._stream = torch.cuda.current_stream(self.pool.device)
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
                stash.used, stash.host = 0, None
                self._seen = {k: v for k, v in self._seen.items() if v[2]() is not None}

    # -- stash management -------------------------------------------------------------------------------
    @staticmethod
    def _view(
        stash: _Stash, offset: int, span: int, dtype: torch.dtype, shape: Any, stride: Any
    ) -> torch.Tensor:
        return stash.flat[offset : offset + span].view(dtype).as_strided(shape, stride)

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
                dst.copy_(stash.host, non_blocking=True)
                stash.ready = torch.cuda.Event()
                stash.ready.record(side)
        else:
            dst.copy_(stash.host)
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
            stash.ready, stash.host = None, None

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.pool.device)
        return self._side

    def _window(self) -> set[int]:
        """Layers to keep: the current one, and in backward the `window` layers it needs next."""
        if self._current is None:
            return set()
        below = self.window if self._backward else 0
        return set(range(self._current - below, self._current + 1))

    def reclaim(self, n_pages: int) -> int:
        """Pool callback: spill stashes of layers outside the window until n_pages are free; returns pages
        freed. Blocks until the copies (and the trainer's queued work) are done."""
        with self._lock:
            return self._spill(n_pages, protect=self._window())

    def _spill(self, n_pages: int, protect: set[int]) -> int:
        # Empty stashes cost nothing to unmap; then the lowest layers, which backward needs last.
        order = sorted(self._stashes.items(), key=lambda kv: (kv[1].used > 0, kv[0]))
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
        copies = [s for s in chosen if s.used > 0]
        if self._cuda:
            side = self._side_stream()
            # Also orders the unmap after every queued trainer kernel that may still read the pages.
            side.wait_stream(self._stream or torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(side):
                for s in copies:
                    s.host = torch.empty(s.used, dtype=torch.uint8, pin_memory=True)
                    s.host.copy_(s.flat[: s.used], non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
            done.synchronize()
        else:
            for s in copies:
                s.host = s.flat[: s.used].clone()
        for s in chosen:
            s.region.unmap(range(s.mapped))
            s.mapped, s.ready = 0, None
        self.stats["swap_out_bytes"] += sum(s.used for s in copies)
        self.stats["swap_outs"] += len(copies)
        self.stats["reclaimed_pages"] += pages
        self.stats["reclaim_seconds"] += time.perf_counter() - t0
        return pages
