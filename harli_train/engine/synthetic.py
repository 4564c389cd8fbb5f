"""Synthetic engine steps for timing (the profiler's grid): the inputs of a decode or mixed step of a given
shape over blocks that already exist. They write no K/V (every slot -1) and draw no token, so any blocks do;
the tables wrap around the cache's blocks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harli_train.engine.block_manager import BlockManager
from harli_train.engine.engine_config import EngineConfig, EngineError


@dataclass(frozen=True, slots=True)
class SyntheticStep:
    """One step's inputs, row-major: ``ids``/``positions``/``slots`` per token, the rest per sequence."""

    ids: list[int]
    positions: np.ndarray
    slots: np.ndarray  # all -1: no K/V written
    context_lens: np.ndarray
    num_tokens: list[int]
    tables: np.ndarray
    # Adapter slots (None: the base): a decode step's per row, a mixed step's per token.
    adapters: np.ndarray | None = None


def _tables(rows: int, max_len: int, bm: BlockManager) -> np.ndarray:
    width = bm.blocks_for(max_len)
    return (np.arange(rows * width).reshape(rows, width) % bm.num_blocks).astype(np.int32)


def _adapter_rows(what: str, rows: int, lora_slots: int, slots_have: int) -> np.ndarray | None:
    """``rows`` rows' adapter slots, ``lora_slots`` adapters in turn (None: the base only)."""
    if not lora_slots:
        return None
    if lora_slots >= slots_have:
        raise EngineError(
            f"{what}: {lora_slots} adapters asked of an engine with {max(slots_have - 1, 0)} slots"
        )
    return (1 + np.arange(rows) % lora_slots).astype(np.int64)


def decode_step(
    batch: int, kv_len: int, cfg: EngineConfig, bm: BlockManager, lora_slots: int = 0, slots_have: int = 0
) -> SyntheticStep:
    """``batch`` decode rows of ``kv_len`` tokens of context each; with ``lora_slots`` the rows run on that
    many adapter slots, in turn (of the ``slots_have`` the engine holds, the base's included)."""
    if not (1 <= batch <= cfg.max_num_seqs and 1 <= kv_len <= cfg.max_model_len):
        raise EngineError(
            f"synthetic_decode: batch {batch} must be in 1..{cfg.max_num_seqs} and "
            f"kv_len {kv_len} in 1..{cfg.max_model_len}"
        )
    adapters = _adapter_rows("synthetic_decode", batch, lora_slots, slots_have)
    lens = np.full(batch, kv_len, dtype=np.int64)
    return SyntheticStep(
        ids=[0] * batch,
        positions=lens - 1,
        slots=np.full(batch, -1, dtype=np.int64),
        context_lens=lens,
        num_tokens=[1] * batch,
        tables=_tables(batch, kv_len, bm),
        adapters=adapters,
    )


def mixed_step(
    batch: int,
    kv_len: int,
    prefill_tokens: int,
    prefill_context: int,
    cfg: EngineConfig,
    bm: BlockManager,
    lora_slots: int = 0,
    slots_have: int = 0,
) -> SyntheticStep:
    """``batch`` decode rows over ``kv_len`` cached tokens each, then one prefill piece of ``prefill_tokens``
    new tokens after ``prefill_context`` cached ones (the varlen path's layout); with ``lora_slots`` the rows
    (the piece one row) run on that many adapter slots in turn, each token on its row's."""
    total = prefill_context + prefill_tokens
    if not (0 <= batch <= cfg.max_num_seqs - 1 and 1 <= prefill_tokens <= cfg.max_num_batched_tokens):
        raise EngineError(
            f"synthetic_mixed: batch {batch} must be in 0..{cfg.max_num_seqs - 1} and prefill_tokens "
            f"{prefill_tokens} in 1..{cfg.max_num_batched_tokens}"
        )
    if not (1 <= kv_len <= cfg.max_model_len and total <= cfg.max_model_len):
        raise EngineError(f"synthetic_mixed: kv_len {kv_len} and context {total} exceed max_model_len")
    context_lens = np.array([kv_len] * batch + [total], dtype=np.int64)
    rows = _adapter_rows("synthetic_mixed", batch + 1, lora_slots, slots_have)
    return SyntheticStep(
        ids=[0] * (batch + prefill_tokens),
        positions=np.concatenate([np.full(batch, kv_len - 1), np.arange(prefill_context, total)]),
        slots=np.full(batch + prefill_tokens, -1, dtype=np.int64),
        context_lens=context_lens,
        num_tokens=[1] * batch + [prefill_tokens],
        tables=_tables(batch + 1, int(context_lens.max()), bm),
        adapters=None if rows is None else np.repeat(rows, [1] * batch + [prefill_tokens]),
    )
