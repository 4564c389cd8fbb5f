"""How the runtime reacts to memory pressure: a small hook, so the loop works with or without the page pool.

``before_decode`` runs ahead of every engine step (a pooled KV cache orders its resizes there, which may
make the trainer's tenant give pages back through the pool's reclaim protocol). After the trainer ran out of
memory and its step was abandoned, ``on_trainer_oom`` runs on the decode thread (the one that owns the
engine) and gives up what the serving side can spare without waiting for anything (it orders the unmaps and
returns a ticket), then ``after_trainer_oom(ticket)`` runs on the trainer's thread: it frees the trainer's
own caches and waits for what was ordered, so a recovery never holds up a decode step. Inline (no trainer
thread) both run in turn on the one thread. None of them may raise for the serving side's sake: a failure is
logged and the loop goes on.

A hook may also have ``begin_run()`` (a run starts), ``trainer_scope()`` (a context entered around each
trainer micro-step: where its allocations go), ``step_row()`` (fields for each step record) and
``summary()`` (the run summary's ``memory.pool``), ``trainer_bytes()``, ``trainer_peak_bytes()`` and
``trainer_room_bytes()`` (what the trainer holds, has held at most, and may still take, on a GPU: how many
trainer streams fit); ``CacheReleaseHook`` gives
the defaults, and the page pool's hook is ``harli_train.colocate.pool_memory.PoolMemory``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class MemoryHook(Protocol):
    def before_decode(self, engine: Any) -> None: ...

    def on_trainer_oom(self) -> Any: ...

    def after_trainer_oom(self, ticket: Any) -> None: ...


class CacheReleaseHook:
    """Without a page pool: after a trainer OOM, return torch's cached blocks to the driver."""

    def before_decode(self, engine: Any) -> None:
        return None

    def begin_run(self) -> None:
        return None

    def trainer_scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step_row(self) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any] | None:
        return None

    def trainer_bytes(self) -> int:
        """GPU memory torch holds (the trainer's share of it is what grows as its streams are warmed)."""
        return torch.cuda.memory_reserved()

    def trainer_peak_bytes(self) -> int:
        """The most ``trainer_bytes`` has been (torch keeps a step's freed blocks cached: the same figure)."""
        return torch.cuda.max_memory_reserved()

    def trainer_room_bytes(self) -> int:
        """GPU memory the trainer may still take: what the driver has free (the KV cache is allocated)."""
        return torch.cuda.mem_get_info()[0]

    def on_trainer_oom(self) -> Any:
        """Decode thread: nothing of the serving side's to give up (its KV cache is a fixed tensor)."""
        return None

    def after_trainer_oom(self, ticket: Any) -> None:
        """Trainer's thread: collect the abandoned step's cyclic garbage and return torch's cached blocks to
        the driver."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
