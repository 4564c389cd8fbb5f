"""ctypes bindings to the native page pool (``harli_train._vmm``, built from allocator/): its errors, the
pool, its tenants and their reserved regions."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import threading
import time
import weakref
from collections.abc import Callable, Iterable
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


class PoolError(RuntimeError):
    """A pool call failed; the message says why."""


class PoolExhausted(PoolError, torch.OutOfMemoryError):
    """The pool has fewer free pages than asked for. It is an out-of-memory error, so that whoever recovers
    from torch's (the co-location feeder: abandon the trainer's step, redo it later) recovers from it too."""


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
        raise PoolError(
            f"{path} does not match harli_train/memory/native.py: rebuild it with `pip install -e .`"
        )
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
        self._reclaimers: list[tuple[Tenant, Callable[[int], int], Callable[[], int] | None]] = []
        self.reclaim_stats = {"calls": 0, "pages_asked": 0, "pages_freed": 0, "seconds": 0.0}
        self._stats_lock = threading.Lock()  # reclaim may be called from several threads

    def close(self) -> None:
        """Wait for the device's queued work, then unmap and release everything. Refused while torch still
        holds allocations made through TrainerMemory: releasing them would leave torch with dangling
        memory (a later kernel faults with an illegal address)."""
        if not self._close.alive:
            return
        stats = self.stats()
        live = stats["torch_allocs"] - stats["torch_frees"]
        if live:
            raise PoolError(
                f"PagePool.close: torch still holds {live} allocation(s) made in TrainerMemory.scope(); free "
                "those tensors and call TrainerMemory.close() first"
            )
        if self.backend == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
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

    def register_reclaimer(
        self, tenant: Tenant, reclaim: Callable[[int], int], reclaimable: Callable[[], int] | None = None
    ) -> None:
        """`reclaim(n_pages) -> pages_freed` is called when another tenant is short of pages;
        `reclaimable() -> pages` (optional) says how many it could free now (``reclaimable_pages``)."""
        self._reclaimers.append((tenant, reclaim, reclaimable))

    def reclaimable_pages(self, requester: Tenant | None = None) -> int:
        """Pages the other tenants' reclaimers say they could give back now (a snapshot: it may change)."""
        return sum(
            int(fn())
            for tenant, _, fn in list(self._reclaimers)
            if fn is not None and (requester is None or tenant.id != requester.id)
        )

    def reclaim(self, n_pages: int, requester: Tenant | None = None) -> int:
        """Ask the other tenants' reclaimers, in registration order, to free n_pages; returns pages freed."""
        t0, freed = time.perf_counter(), 0
        for tenant, fn, _ in list(self._reclaimers):
            if freed >= n_pages:
                break
            if requester is None or tenant.id != requester.id:
                freed += int(fn(n_pages - freed))
        with self._stats_lock:
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
