"""How big the co-located page pool is, and the sizes derived from the recipe: its budget, the host page,
the trainer's quota and how much one chunk of layers saves for backward.

Every figure is a plain function of the recipe and the machine, so the assembly and the bench size the pool
the same way, and a bad ``colocation.memory_gib`` / ``trainer_memory_gib`` / ``spill_host_gib`` is refused
with the key named.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from harli_train.config import RecipeConfig, RecipeError
from harli_train.model import ModelConfig

GIB = 1 << 30
# Left outside the pool on a GPU: what torch still allocates there (the engine's graphs and staging buffers,
# cuBLAS workspaces, the backward's allocations on autograd's threads, which torch's MemPool cannot route
# into the pool from Python) and fragmentation. 10 % of the device, at least 8 GiB.
GPU_MARGIN_FRACTION, GPU_MARGIN_MIN = 0.10, 8 * GIB
# On a CPU host memory is the pool's: leave 10 % of it, at least 1 GiB, to everything else.
CPU_MARGIN_FRACTION, CPU_MARGIN_MIN = 0.10, 1 * GIB
HOST_PAGE_TARGET = 64 << 10  # host backend pages: ~64 KiB (a multiple of the OS page and of a KV block)
OS_PAGE = 4096
# A saved tensor under 1/STASH_MIN_FRACTION of a chunk's reserve (at most STASH_MIN_CAP bytes, at least
# STASH_MIN_FLOOR) stays an ordinary tensor rather than going into the stash: see stash_min_bytes.
STASH_MIN_FRACTION, STASH_MIN_CAP, STASH_MIN_FLOOR = 2048, 1 << 20, 4096
# The trainer's spills on a GPU go to pinned host slabs. Pinning host memory holds the driver for the
# while (~1.4 s of a reclaim's 3.1 s when the slabs grew from 2 to 11 GiB in one pressed run on the H100,
# decode's steps stalled meanwhile), so by default as many slabs as a spill can fill are pinned at set-up,
# up to 1/HOST_SPILL_FRACTION of the host's memory (`spill_reserve_bytes`).
HOST_SPILL_FRACTION = 8


@dataclass(frozen=True, slots=True)
class PoolBudget:
    """The pool's size in bytes, where that figure came from, the trainer's quota (None: none) and the
    pinned host memory its spills start with on a GPU (None: `spill_reserve_bytes`'s default)."""

    bytes: int
    source: str  # "colocation.memory_gib" or a description of the default
    trainer_quota_bytes: int | None
    spill_host_bytes: int | None = None


def available_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of ``device``: the GPU's as the driver reports them, else the host's
    MemAvailable / MemTotal."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return host_bytes()


def host_bytes() -> tuple[int, int]:
    """The host's (MemAvailable, MemTotal) bytes."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return info.get("MemAvailable", total // 2), total


def margin_bytes(device: torch.device, total: int) -> int:
    if device.type == "cuda":
        return max(GPU_MARGIN_MIN, int(GPU_MARGIN_FRACTION * total))
    return max(CPU_MARGIN_MIN, int(CPU_MARGIN_FRACTION * total))


def pool_budget(cfg: RecipeConfig, device: torch.device) -> PoolBudget:
    """``colocation.memory_gib`` when set (refused past what is free now), else what is free now (after
    the weights) less the safety margin; ``trainer_memory_gib`` as the trainer's quota."""
    col = cfg.colocation
    free, total = available_bytes(device)
    where = "the GPU" if device.type == "cuda" else "this host"
    if col.memory_gib is not None:
        budget = int(col.memory_gib * GIB)
        if budget > free:
            raise RecipeError(
                cfg.source,
                "colocation.memory_gib",
                f"at most the {free / GIB:.2f} GiB free on {where} after the weights",
                f"{col.memory_gib:g}",
            )
        source = "colocation.memory_gib"
    else:
        margin = margin_bytes(device, total)
        budget = free - margin
        if budget <= 0:
            raise RecipeError(
                cfg.source,
                "colocation.memory_gib",
                f"a pool budget that fits: {free / GIB:.2f} GiB are free on {where} after the weights, "
                f"less a safety margin of {margin / GIB:.2f} GiB leaves none (set it, or memory_pool: false)",
                "null (the default)",
            )
        source = f"free after the weights ({free / GIB:.2f} GiB) less a {margin / GIB:.2f} GiB margin"
    quota = None if col.trainer_memory_gib is None else int(col.trainer_memory_gib * GIB)
    if quota is not None and quota > budget:
        raise RecipeError(
            cfg.source,
            "colocation.trainer_memory_gib",
            f"a quota within the pool's budget of {budget / GIB:.2f} GiB",
            f"{col.trainer_memory_gib:g}",
        )
    spill = None if col.spill_host_gib is None else int(col.spill_host_gib * GIB)
    if spill is not None and device.type == "cuda":
        host_free, _ = host_bytes()
        if spill > host_free:
            raise RecipeError(
                cfg.source,
                "colocation.spill_host_gib",
                f"at most the {host_free / GIB:.2f} GiB of host memory available",
                f"{col.spill_host_gib:g}",
            )
    return PoolBudget(budget, source, quota, spill)


def spill_reserve_bytes(stash_bytes: int, pool_bytes: int, requested: int | None, host_total: int) -> int:
    """Pinned host bytes to make at set-up for the trainer's spills: at most what a spill can ever move
    (what its stashes can hold, ``stash_bytes``, within the pool's ``pool_bytes``); of that, ``requested``
    (``colocation.spill_host_gib``) when set, else up to 1/HOST_SPILL_FRACTION of the host's memory. More
    are pinned later only when a reclaim spills more at once than is held."""
    cap = host_total // HOST_SPILL_FRACTION if requested is None else requested
    return max(min(stash_bytes, pool_bytes, cap), 0)


def host_page_bytes(block_bytes: int) -> int:
    """A host page that whole KV blocks (``block_bytes``: one layer's K block) and OS pages both tile."""
    unit = math.lcm(block_bytes, OS_PAGE)
    return unit * max(1, -(-HOST_PAGE_TARGET // unit))


def chunk_saved_bytes(model: ModelConfig, batch: int, seq_len: int, layers: int, dtype: torch.dtype) -> int:
    """An upper bound on what one chunk of ``layers`` layers saves for backward at ``batch`` x ``seq_len``:
    the ActivationSwapper reserves this much address space per chunk (reserving costs no memory; what does
    not fit would stay an ordinary tensor). Per layer: ~16 hidden-sized and ~6 intermediate-sized tensors
    per token (norms, projections, LoRA inputs, the MLP's gates), and fp32 attention probabilities where the
    attention falls back to the math path, with a factor 2 to spare."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = batch * seq_len
    per_token = (16 * model.hidden_size + 6 * model.intermediate_size) * elem
    scores = batch * model.num_heads * seq_len * seq_len * 4
    return 2 * layers * (tokens * per_token + scores)


def stash_min_bytes(chunk_bytes: int) -> int:
    """The least size of a saved tensor the ActivationSwapper copies into its stash, for chunks reserving
    ``chunk_bytes`` (``chunk_saved_bytes``). Every stashed tensor costs the trainer's launching thread a
    pack and an unpack whatever its size (on the H200 ~27 us a pack, mostly the copy's launch), while the
    small ones hold almost none of the bytes: for Llama-3-8B at 4 x 1024 with rank-16 LoRA on seven targets,
    17 of a layer's 31 saved activations are under 1 MiB (the LoRA shrinks and the adapters' bf16 casts,
    the norms' statistics, rope's tables) and together hold 0.2 % of its saved bytes. So those stay where
    torch put them (the trainer tenant's MemPool on a GPU, which is in the same pool). Tiny models keep
    stashing nearly everything (the threshold scales with the chunk)."""
    return min(STASH_MIN_CAP, max(STASH_MIN_FLOOR, chunk_bytes // STASH_MIN_FRACTION))
