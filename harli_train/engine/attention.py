"""The model's `attn_ctx` inside the engine: store the new K/V in the paged cache, attend over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harli_train import kernels
from harli_train.engine import reference
from harli_train.engine.kv_cache import KVStorage


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of every attention layer, prepared once by the runner (device tensors).

    Prefill packs all sequences' new tokens into one row (B = 1, T = total); decode has one token per
    sequence (B = sequences, T = 1), padded to a graph bucket with slot -1 and context length 0.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [tokens] int64: cache slot of each new token (-1: padding)
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    context_lens: torch.Tensor  # [seqs] int32: cached tokens after this step, new ones included
    cu_seqlens_q: torch.Tensor | None = None  # [seqs + 1] int32, prefill only
    max_q_len: int = 0  # prefill only: the longest chunk (sizes the grid)
    num_sms: int = 132  # SMs of the partition the step runs on (sizes the decode grid)
    # Prefill only, Triton kernels: short rows' work is split. Rows of one new token (a mixed step's decode
    # rows) go to the split decode kernel, which looks at the first `decode_rows` rows (None: all); the
    # prefill kernel takes the rest and, in a small step, splits a one-tile row's keys.
    split_rows: bool = False
    decode_rows: int | None = None


class PagedAttention:
    """Implements the model's `AttentionContext` over a `KVStorage`; `meta` is set by the runner each step."""

    def __init__(self, storage: KVStorage, head_dim: int, use_triton: bool):
        self.storage = storage
        self.scale = head_dim**-0.5
        self.use_triton = use_triton
        self.meta: AttentionMetadata | None = None
        if use_triton:
            # Imported here: a kernel is decorated (compiled or interpreted) when its module is imported.
            from harli_train.engine.kv_store import kv_store
            from harli_train.engine.paged_decode import paged_decode, paged_decode_varlen
            from harli_train.engine.paged_prefill import paged_prefill

            self._store, self._prefill, self._decode = kv_store, paged_prefill, paged_decode
            self._decode_varlen = paged_decode_varlen
        else:
            self._store, self._prefill = reference.kv_store_reference, reference.paged_prefill_reference
            self._decode = reference.paged_decode_reference

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> o [B, T, Hq, D]. q and k come rotated, or unrotated with
        `rope` = (cos, sin) [B, D] of a decode step's positions (the decode kernel rotates them)."""
        meta = self.meta
        assert meta is not None, "PagedAttention.attend called outside an engine step"
        if rope is not None and (meta.is_prefill or q.shape[1] != 1):
            q, k = kernels.apply_rope(q, k, rope[0][:, None], rope[1][:, None])
            rope = None
        b, t, hq, d = q.shape
        k_cache, v_cache = self.storage.k_cache(layer_idx), self.storage.v_cache(layer_idx)
        k, v = k.reshape(b * t, -1, d), v.reshape(b * t, -1, d)
        if meta.is_prefill:
            self._store(k, v, k_cache, v_cache, meta.slot_mapping)
            q = q.reshape(b * t, hq, d)
            split = meta.split_rows and self.use_triton  # the reference attends every row, whole
            options = {"skip_single": True, "split_context": True} if split else {}
            o = self._prefill(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.cu_seqlens_q,
                meta.context_lens,
                meta.max_q_len,
                self.scale,
                **options,
            )
            if split:
                self._decode_varlen(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.cu_seqlens_q,
                    meta.context_lens,
                    self.scale,
                    o,
                    meta.decode_rows,
                )
        else:
            assert t == 1, "decode steps carry one token per sequence"
            # The decode kernel stores the new token's K/V itself (one launch less per layer).
            o = self._decode(
                q.reshape(b, hq, d),
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                self.scale,
                meta.num_sms,
                new_kv=(k, v, meta.slot_mapping),
                rope=rope,
            )
        return o.view(b, t, hq, d)
