"""One pool of physical GPU pages shared by the decode engine's KV cache and the trainer.

The native library (allocator/, built as ``harli_train._vmm``) maps pages of the driver's granularity
(2 MiB on the H200) into reserved virtual ranges through the CUDA VMM API, or pages of a memfd on the
host backend that tests use. This package holds its ctypes bindings (``native``) and the pool's three users:

- ``PooledKVStorage``: the engine's paged KV cache, one tensor over one reserved range whose prefix of
  blocks grows and shrinks by mapping pages (no copy, fixed addresses);
- ``TrainerMemory``: the trainer's torch allocations, routed into the pool through ``torch.cuda.MemPool``;
- ``ActivationSwapper``: saved activations stashed per layer in pool pages; when the KV cache is short,
  the pool asks it to ``reclaim(n_pages)`` and it spills layers outside its window to host memory (the
  stashes' pages, their spills to ``HostSlabs`` and the copies back are ``StashPages``').

Unmapping never waits for queued GPU work: whoever unmaps synchronises first (each method says how).
"""

from .kv_storage import PooledKVStorage
from .native import (
    PagePool,
    PoolError,
    PoolExhausted,
    QuotaExceeded,
    Region,
    Tenant,
    cuda_driver_available,
    native_library_path,
)
from .swapper import ActivationSwapper
from .trainer_memory import TrainerMemory

__all__ = [
    "ActivationSwapper",
    "PagePool",
    "PoolError",
    "PoolExhausted",
    "PooledKVStorage",
    "QuotaExceeded",
    "Region",
    "Tenant",
    "TrainerMemory",
    "cuda_driver_available",
    "native_library_path",
]
