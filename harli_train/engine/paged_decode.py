"""Decode attention over the paged KV cache: one query token per sequence, ragged context lengths.

Flash-decoding: the grid is (sequence, KV head, split). A program attends the GQA group of query heads that
share its KV head (so K/V are read once per group) over its slice of the context, split evenly at run time
between `num_splits` programs; a second kernel merges the splits by their log-sum-exp. The split count
depends only on the batch and the SMs the engine owns, never on lengths, so one CUDA graph per batch
bucket serves every mix of lengths. With one split the first kernel writes the output directly.

In a decode step the newest token's K/V can be handed over directly (`new_kv`): the last split attends it
from registers and writes it to its cache slot, which saves the separate KV-store launch per layer. No
program reads that slot in the same step, so the write races with nothing. With `rope` = (cos, sin) the
kernel also rotates q and the new k itself (half-split layout, fp32 math, cast back as the rope op does),
which saves the rope launch per layer.

In a varlen step (decode rows beside prefill chunks, packed as the prefill kernel takes them), the rows of
one new token come here too (`paged_decode_varlen`): row b's query is packed token cu_seqlens[b], rows of
more tokens are left to the prefill kernel, and a row's split count follows its own context (one split per
`SPLIT_TOKENS` cached tokens, at most `MAX_VARLEN_SPLITS`), since one graph serves every mix of rows there.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from harli_train.engine.reference import NewKV

MAX_SPLITS = 32
MAX_VARLEN_SPLITS = 16


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32 (0: padding row, output 0)
    k_new_ptr,
    v_new_ptr,  # [B, Hkv, D] the newest token's K/V (NEW_KV), unit stride over D
    slot_ptr,  # [B] int64 its cache slot (-1: not stored)
    cos_ptr,
    sin_ptr,  # [B, D] fp32 rotary tables of each sequence's new position (ROPE), row stride stride_rope
    out_ptr,  # [B, Hq, D] (written when NUM_SPLITS == 1)
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32, each split's normalised output
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32, each split's log2-sum-exp2 of scores
    cu_seqlens_ptr,  # [B + 1] int32 (VARLEN): row b owns packed tokens cu[b]:cu[b + 1] of q and out
    scale_log2,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_rope,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NEW_KV: tl.constexpr,
    ROPE: tl.constexpr,
    PRECISION: tl.constexpr,
    VARLEN: tl.constexpr = False,  # rows of a varlen step: one-token rows only, splits by context
    SPLIT_TOKENS: tl.constexpr = 256,  # VARLEN: cached tokens per split
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    cached = ctx  # tokens read from the cache
    if NEW_KV:
        cached = tl.maximum(ctx - 1, 0)
    token = b  # the row's query and output in q and out
    splits = NUM_SPLITS
    if VARLEN:
        token = tl.load(cu_seqlens_ptr + b).to(tl.int64)
        q_len = tl.load(cu_seqlens_ptr + b + 1) - token
        splits = context_splits(cached, SPLIT_TOKENS, NUM_SPLITS)
        if (q_len != 1) | (split >= splits):
            return
    tiles_per_split = tl.cdiv(tl.cdiv(cached, BLOCK_N), splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, cached)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    hd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q_row = q_ptr + token * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_row + d[None, :], mask=hd_mask, other=0.0)
    if ROPE:
        # x * cos + rotate_half(x) * sin, rotate_half(x)[d] = -x[d + D/2] (d < D/2), x[d - D/2] (after).
        half: tl.constexpr = HEAD_DIM // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + b * stride_rope + d, mask=d < HEAD_DIM, other=0.0)
        sin = tl.load(sin_ptr + b * stride_rope + d, mask=d < HEAD_DIM, other=0.0) * sign
        q2 = tl.load(q_row + partner[None, :], mask=hd_mask, other=0.0).to(tl.float32)
        q = (q.to(tl.float32) * cos[None, :] + q2 * sin[None, :]).to(q_ptr.dtype.element_ty)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        t_mask = toks < end
        page = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        off = page * stride_cb + (toks % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = t_mask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    if NEW_KV:
        if split == NUM_SPLITS - 1:
            if ctx > 0:
                k_row = k_new_ptr + b * stride_kb + kvh * stride_kh
                k_new = tl.load(k_row + d, mask=d < HEAD_DIM, other=0.0)
                if ROPE:
                    k2 = tl.load(k_row + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
                    k_new = (k_new.to(tl.float32) * cos + k2 * sin).to(k_new_ptr.dtype.element_ty)
                v_new = tl.load(v_new_ptr + b * stride_vb + kvh * stride_vh + d, mask=d < HEAD_DIM, other=0.0)
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale_log2
                m_new = tl.maximum(m, s_new)
                alpha = tl.exp2(m - m_new)
                p_new = tl.exp2(s_new - m_new)
                l = l * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m = m_new
                slot = tl.load(slot_ptr + b)
                if slot >= 0:
                    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kvh * stride_ch
                    tl.store(k_cache_ptr + dst + d, k_new, mask=d < HEAD_DIM)
                    tl.store(v_cache_ptr + dst + d, v_new, mask=d < HEAD_DIM)

    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # an empty split (or context) leaves zeros
    if splits == 1:
        o_ptrs = out_ptr + token * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        row = (b * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=hd_mask)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def context_splits(keys, SPLIT_TOKENS: tl.constexpr, MAX: tl.constexpr):
    """How many programs split `keys` cached tokens: one per SPLIT_TOKENS, at least 1, at most MAX (the
    attention and merge kernels of a split must agree on it)."""
    return tl.minimum(tl.maximum(tl.cdiv(keys, SPLIT_TOKENS), 1), MAX)


@triton.jit
def merge_splits(part_out_ptr, part_lse_ptr, row, s_mask, d, HEAD_DIM: tl.constexpr):
    """One output row from its splits' normalised outputs (rows `row` of part_out [*, HEAD_DIM] fp32, those
    in `s_mask`) weighted by their log2-sum-exp2 (part_lse): zeros when every split is empty."""
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (a padding row)
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    return tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] fp32
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] fp32
    out_ptr,  # [B, Hq, D]
    cu_seqlens_ptr,  # [B + 1] int32 (VARLEN)
    context_lens_ptr,  # [B] int32 (VARLEN)
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VARLEN: tl.constexpr = False,
    SPLIT_TOKENS: tl.constexpr = 256,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    token = b
    splits = NUM_SPLITS
    if VARLEN:  # the same row choice and split count as the attention kernel's
        token = tl.load(cu_seqlens_ptr + b).to(tl.int64)
        q_len = tl.load(cu_seqlens_ptr + b + 1) - token
        ctx = tl.load(context_lens_ptr + b)
        splits = context_splits(ctx, SPLIT_TOKENS, NUM_SPLITS)
        if (q_len != 1) | (splits == 1):
            return
    out = merge_splits(
        part_out_ptr, part_lse_ptr, (b * NUM_HEADS + h) * NUM_SPLITS + s, s < splits, d, HEAD_DIM
    )
    o_ptrs = out_ptr + token * stride_ob + h * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def decode_config(batch: int, num_kv_heads: int, head_dim: int, num_sms: int, dtype: torch.dtype) -> dict:
    """Launch config keyed by shape and the SMs the engine owns (fixed, so graphs capture one config).

    Splits are added until the grid has ~3 programs per SM: at batch x KV heads >= 3 x SMs one split each.
    """
    block_n = 32 if dtype == torch.float32 or head_dim > 128 else 64
    splits = max(1, min(MAX_SPLITS, -(-3 * num_sms // (batch * num_kv_heads))))
    return dict(BLOCK_N=block_n, NUM_SPLITS=splits, num_warps=4, num_stages=2)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_sms: int,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    new_kv: NewKV | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence over its context. Returns [B, Hq, D].

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int32;
    context_lens [B] int32, the new token included. Without `new_kv` every token is read from the cache
    (the new one already stored); with it, the new token's K/V come from `new_kv` and are stored here.
    `rope` = (cos, sin) [B, D] fp32: q and the new k arrive unrotated and are rotated here (needs `new_kv`).
    """
    b, _, d = q.shape
    hkv = k_cache.shape[2]
    assert block_tables.shape[0] >= b and context_lens.shape[0] >= b
    cfg = dict(decode_config(b, hkv, d, num_sms, q.dtype))
    if num_splits is not None:
        cfg["NUM_SPLITS"] = num_splits
    out = torch.empty_like(q) if out is None else out
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        assert k_new.shape == (b, hkv, d) and v_new.shape == k_new.shape and slots.shape[0] >= b
        assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1 and k_new.dtype == k_cache.dtype
    if rope is not None:
        assert new_kv is not None, "rope rotates the new k: pass new_kv too"
        cos, sin = rope
        assert (
            cos.shape[0] >= b and cos.shape[-1] == d and sin.stride() == cos.stride() and cos.stride(-1) == 1
        )
        assert cos.dtype == sin.dtype == torch.float32 and d % 2 == 0
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale, out, b, cfg, new_kv, rope)


def varlen_split_tokens(head_dim: int, dtype: torch.dtype) -> int:
    """Cached tokens per split of a varlen step's one-token rows: four of the kernel's tiles, so that a
    program's serial walk stays short on any context while the grid grows with the step's total context."""
    block_n = decode_config(1, 1, head_dim, 1, dtype)["BLOCK_N"]
    return 4 * block_n


def paged_decode_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_rows: int | None = None,
) -> torch.Tensor:
    """Attention of the one-token rows of a packed varlen step, written into their rows of `out`; rows of
    more (or no) tokens are not touched (the prefill kernel's, with ``skip_single``). Every token is read
    from the cache (the step's kv-store has written the new ones). Returns `out`.

    q, out [T, Hq, D] packed as the prefill kernel takes them; k_cache, v_cache [num_blocks, block_size,
    Hkv, D]; block_tables [S, max_blocks] int32; cu_seqlens [S + 1] int32; context_lens [S] int32, the new
    tokens included. `num_rows` (default S) bounds the rows looked at: a graph passes the most rows a step
    of its token bucket can have. Launches depend on shapes only, so one CUDA graph serves every mix of rows.
    """
    d = q.shape[-1]
    rows = context_lens.shape[0] if num_rows is None else min(num_rows, context_lens.shape[0])
    assert out.shape == q.shape and out.stride(-1) == 1
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.shape[0] == context_lens.shape[0] + 1
    cfg = dict(decode_config(1, k_cache.shape[2], d, 1, q.dtype), NUM_SPLITS=MAX_VARLEN_SPLITS)
    varlen = (cu_seqlens, varlen_split_tokens(d, q.dtype))
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale, out, rows, cfg, varlen=varlen)


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    rows: int,
    cfg: dict,
    new_kv: NewKV | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    varlen: tuple[torch.Tensor, int] | None = None,  # (cu_seqlens, cached tokens a split)
) -> torch.Tensor:
    # The attention kernel over (rows, KV heads, splits) and, with splits, the merge over (rows, heads).
    _, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    assert hq % hkv == 0 and k_cache.shape[-1] == d and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    cfg = dict(cfg)
    splits = cfg.pop("NUM_SPLITS")
    if splits > 1:
        part_out = torch.empty((rows, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows, hq, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, q)  # q: unused
    cos, sin = rope if rope is not None else (q, q)
    cu_seqlens, split_tokens = varlen if varlen is not None else (context_lens, 0)
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16
    _paged_decode_kernel[(rows, hkv, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        k_new,
        v_new,
        slots,
        cos,
        sin,
        out,
        part_out,
        part_lse,
        cu_seqlens,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos.stride(0),
        NUM_HEADS=hq,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=splits,
        NEW_KV=new_kv is not None,
        ROPE=rope is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        VARLEN=varlen is not None,
        SPLIT_TOKENS=max(split_tokens, 1),
        **cfg,
    )
    if splits > 1:
        _paged_decode_reduce_kernel[(rows, hq)](
            part_out,
            part_lse,
            out,
            cu_seqlens,
            context_lens,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=hq,
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            HEAD_DIM=d,
            BLOCK_D=block_d,
            VARLEN=varlen is not None,
            SPLIT_TOKENS=max(split_tokens, 1),
            num_warps=4,
        )
    return out
