"""How the runtime reacts to memory pressure: a small hook, so the loop works with or without the page pool.

``before_decode`` runs ahead of every engine step (a pooled KV cache grows there, asking the trainer's
tenant to give pages back through the pool's reclaim protocol); ``on_trainer_oom`` runs after the trainer
ran out of memory and its step was abandoned (the hook frees what the serving side can spare). Neither may
raise for the serving side's sake: a failure is logged and the loop goes on.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class MemoryHook(Protocol):
    def before_decode(self, engine: Any) -> None: ...

    def on_trainer_oom(self) -> int: ...


class CacheReleaseHook:
    """Without a page pool: after a trainer OOM, return torch's cached blocks to the driver."""

    def before_decode(self, engine: Any) -> None:
        return None

    def on_trainer_oom(self) -> int:
        gc.collect()
        if not torch.cuda.is_available():
            return 0
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        return max(before - torch.cuda.memory_reserved(), 0)


class PoolMemoryHook(CacheReleaseHook):
    """With the VMM page pool (``harli_train.memory``) and an engine whose KV storage is pooled.

    ``kv`` is the engine's ``PooledKVStorage``; ``headroom_blocks`` free blocks are kept mapped ahead of
    decode's needs (growing reclaims pages from the trainer's tenant when the pool is short). After a
    trainer OOM the cache shrinks back to the blocks in use plus the headroom, returning pages to the pool.
    """

    def __init__(self, kv: Any, headroom_blocks: int = 64) -> None:
        self.kv, self.headroom = kv, headroom_blocks
        self.engine: Any = None  # the DecodeEngine, known from the first before_decode

    def before_decode(self, engine: Any) -> None:
        self.engine = engine.engine
        bm = self.engine.block_manager
        if bm.num_free >= self.headroom or self.kv.num_blocks >= self.kv.max_blocks:
            return
        try:
            grown = self.kv.grow(bm.num_blocks + self.headroom)
        except Exception as err:  # the pool is exhausted even after reclaiming: decode keeps what it has
            log.warning("KV cache could not grow: %s", err)
            return
        engine.engine.grow_kv_blocks(grown)

    def on_trainer_oom(self) -> int:
        freed = super().on_trainer_oom()
        if self.engine is None:
            return freed
        bm, before = self.engine.block_manager, self.kv.mapped_bytes
        keep = max(bm.used_blocks, default=-1) + 1 + self.headroom
        if keep < bm.num_blocks and self.engine.shrink_kv_blocks(keep):
            # The cache keeps whole pages: blocks it still maps stay usable.
            self.engine.grow_kv_blocks(self.kv.shrink(keep))
        return freed + max(before - self.kv.mapped_bytes, 0)
