"""The optimizer's state in pool pages, for a trainer on the host backend.

On a GPU the trainer's torch allocations reach the pool through torch's pluggable allocator (TrainerMemory);
on a CPU torch has no such hook, so what the trainer keeps for its whole run is placed explicitly: every
tensor of the optimizer's state (AdamW's moments and step counts) is copied into one region of the trainer's
tenant and the state refers to the copy. The optimizer updates its state in place, so the values, and
therefore the training, are exactly those of the tensors it replaced; a checkpoint reads them as any other.
"""

from __future__ import annotations

import torch

from harli_train.memory import PagePool, Tenant

ALIGN = 512  # as torch's allocator aligns blocks: vectorised kernels take the same paths


class OptimizerPlacement:
    """Moves ``optimizer``'s state tensors into pages of ``tenant``; ``release()`` moves them back out
    (to ordinary tensors, values unchanged) and returns the pages. The state must exist already (the
    trainer creates it at set-up) and keep its tensors (AdamW updates them in place)."""

    def __init__(self, pool: PagePool, tenant: Tenant, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        entries = [
            (state, name, value)
            for state in optimizer.state.values()
            for name, value in state.items()
            if isinstance(value, torch.Tensor) and value.device.type == "cpu"
        ]
        offsets, end = [], 0
        for _, _, value in entries:
            start = -(-end // ALIGN) * ALIGN
            offsets.append(start)
            end = start + value.numel() * value.element_size()
        self.nbytes = end
        self.region = None
        if not entries:
            return
        pages = -(-end // pool.page_bytes)
        self.region = pool.reserve(tenant, pages)
        self.region.map(range(pages), reclaim=True)
        flat = self.region.as_tensor()
        self._placed = []
        for (state, name, value), start in zip(entries, offsets, strict=True):
            nbytes = value.numel() * value.element_size()
            view = flat[start : start + nbytes].view(value.dtype).view(value.shape)
            view.copy_(value)
            state[name] = view
            self._placed.append((state, name))

    def release(self) -> None:
        """Give the state back as ordinary tensors, then unmap and release the region. Idempotent."""
        if self.region is None:
            return
        for state, name in self._placed:
            state[name] = state[name].clone()
        self._placed = []
        self.region.release()
        self.region = None
