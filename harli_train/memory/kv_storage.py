"""The decode engine's paged KV cache in pool pages: one tensor over one reserved range that grows and
shrinks by mapping pages (no copy, fixed addresses)."""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from .native import PagePool, Tenant


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
    On the host backend newly mapped groups are zeroed: the engine's torch reference path multiplies
    masked-out values by a zero softmax weight, and a page another tenant left NaN bytes in would poison
    it (the GPU kernels mask their loads instead, so their pages are left as they come).
    ``grow``/``shrink`` may run on another thread than the decode steps (a lock orders them); a block
    the engine hands out is always below ``num_blocks`` before and after either.
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
        self.region.map(self._slots(0, 1), reclaim=True)
        self._groups = 1
        shape = (spec.num_layers, 2, self.max_blocks, *spec.block_shape)
        self.data = self.region.as_tensor().view(spec.dtype).view(shape)
        self._zero_new(0, 1)

    @property
    def num_blocks(self) -> int:
        return self._groups * self.blocks_per_page

    @property
    def pages_per_group(self) -> int:
        """Pages one page group (``blocks_per_page`` blocks of every layer's K and V) takes."""
        return self._planes

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
                self._zero_new(self._groups, groups)
                self._groups = groups
            return self.num_blocks

    def _zero_new(self, first: int, stop: int) -> None:
        if self.pool.backend == "host":  # see the class docstring
            self.pages()[:, :, first:stop].zero_()

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
