"""Prefill attention over the paged KV cache: packed ragged chunks of new tokens, causal, after a prefix.

Each sequence contributes `q_len` new tokens (its whole prompt, or one chunk of it) whose K/V the KV-store
kernel has already written; they attend causally to the sequence's `context_len` cached tokens, the last
`q_len` of which are themselves. So one kernel serves plain, chunked and recomputed (preempted) prefills.
With `skip_single`, rows of one new token are left alone: in a mixed step they are decode rows, which the
split decode kernel (`paged_decode_varlen`) attends faster than a query tile of which one row is used.

A short chunk over a long context gives few programs (one per query head) each walking the whole context:
with `split_context` (steps of at most SPLIT_MAX_TOKENS tokens, a mixed step's small buckets), a row of one
query tile splits its keys between programs, one per SPLIT_TOKENS keys (at most MAX_SPLITS), and a second
kernel merges each token's splits by their log-sum-exp, as flash-decoding does. Rows of several tiles are not
split (their tiles already fill the grid).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from harli_train.engine.paged_decode import context_splits, merge_splits

MAX_SPLITS = 8
SPLIT_TOKENS = 256  # keys a split of a one-tile row walks, at least
SPLIT_MAX_TOKENS = (
    128  # the most packed tokens of a step whose rows may split (the merge's grid is per token)
)


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [T, Hq, D] new tokens of all sequences, packed
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [S, max_blocks] int32
    cu_seqlens_ptr,  # [S + 1] int32: sequence s owns rows cu[s]:cu[s+1] of q and out
    context_lens_ptr,  # [S] int32: cached tokens after this step (prefix + new)
    out_ptr,  # [T, Hq, D]
    part_out_ptr,  # [T, Hq, NUM_SPLITS, D] fp32 (NUM_SPLITS > 1): each split's normalised output
    part_lse_ptr,  # [T, Hq, NUM_SPLITS] fp32: each split's log2-sum-exp2
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    SKIP_SINGLE: tl.constexpr = False,
    NUM_SPLITS: tl.constexpr = 1,
    SPLIT_TOKENS: tl.constexpr = 256,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    if SKIP_SINGLE:
        if q_len == 1:
            return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len
    kvh = h // GROUP
    kv_end = tl.minimum(ctx, prefix + (m_block + 1) * BLOCK_M)
    splits = 1
    if NUM_SPLITS > 1:
        splits = _row_splits(q_len, ctx, BLOCK_M, NUM_SPLITS, SPLIT_TOKENS)
        if split >= splits:
            return
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), splits)
    kv_start = split * tiles_per_split * BLOCK_N
    kv_stop = tl.minimum(kv_start + tiles_per_split * BLOCK_N, kv_end)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    r_mask = rows < q_len
    q_pos = prefix + rows
    q_rows = (q_start + rows).to(tl.int64)
    qd_mask = r_mask[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=qd_mask, other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    for n0 in range(kv_start, kv_stop, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        t_mask = toks < kv_stop
        page = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        off = page * stride_cb + (toks % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = t_mask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(t_mask[None, :] & (toks[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if splits == 1:
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
    else:
        part = (q_rows * NUM_HEADS + h) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=qd_mask)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=r_mask)


@triton.jit
def _row_splits(q_len, ctx, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_TOKENS: tl.constexpr):
    # A row of one query tile splits its keys, one split per SPLIT_TOKENS; longer rows do not split.
    return tl.where(q_len <= BLOCK_M, context_splits(ctx, SPLIT_TOKENS, NUM_SPLITS), 1)


@triton.jit
def _paged_prefill_merge_kernel(
    part_out_ptr,  # [T, Hq, NUM_SPLITS, D] fp32
    part_lse_ptr,  # [T, Hq, NUM_SPLITS] fp32
    cu_seqlens_ptr,  # [S + 1] int32
    context_lens_ptr,  # [S] int32
    out_ptr,  # [T, Hq, D]
    num_seqs,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,  # ceil(log2(S + 1))
    SKIP_SINGLE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    h = tl.program_id(1)
    # The token's row: the first s with cu_seqlens[s + 1] > token (binary search; padding tokens find none).
    lo = num_seqs * 0
    hi = num_seqs + 0
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        after = tl.load(cu_seqlens_ptr + mid + 1, mask=active, other=0) <= token  # the row ends by token
        lo = tl.where(active & after, mid + 1, lo)
        hi = tl.where(active & (after == 0), mid, hi)
    if lo >= num_seqs:
        return
    q_len = tl.load(cu_seqlens_ptr + lo + 1) - tl.load(cu_seqlens_ptr + lo)
    if SKIP_SINGLE:
        if q_len == 1:
            return
    splits = _row_splits(q_len, tl.load(context_lens_ptr + lo), BLOCK_M, NUM_SPLITS, SPLIT_TOKENS)
    if splits == 1:
        return
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    row = (token.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + s
    out = merge_splits(part_out_ptr, part_lse_ptr, row, s < splits, d, HEAD_DIM)
    o_ptrs = out_ptr + token.to(tl.int64) * stride_ot + h * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def prefill_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes; prefill is never graph-captured and its grid covers the tokens, not the SMs."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    block = 64 if head_dim <= 128 else 32
    return dict(BLOCK_M=block, BLOCK_N=block, num_warps=4, num_stages=2)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    skip_single: bool = False,
    split_context: bool = False,
) -> torch.Tensor:
    """Causal attention of packed new tokens q [T, Hq, D] over each sequence's cache. block_tables
    [S, max_blocks] int32, cu_seqlens [S + 1] int32, context_lens [S] int32. Returns [T, Hq, D]; with
    `skip_single` the rows of one token are not written; with `split_context` (taken when T <=
    SPLIT_MAX_TOKENS) one-tile rows split their keys between programs (two launches). The launches depend on
    shapes only, so one CUDA graph serves every mix of rows."""
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    assert hq % hkv == 0 and k_cache.shape[-1] == d and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and cu_seqlens.dtype == torch.int32
    assert context_lens.dtype == torch.int32 and cu_seqlens.shape == (num_seqs + 1,)
    out = torch.empty_like(q) if out is None else out
    cfg = prefill_config(d, q.dtype)
    splits = MAX_SPLITS if split_context and t <= SPLIT_MAX_TOKENS else 1
    if splits > 1:
        part_out = torch.empty((t, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((t, hq, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    grid = (triton.cdiv(max_q_len, cfg["BLOCK_M"]), num_seqs, hq * splits)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens,
        context_lens,
        out,
        part_out,
        part_lse,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        NUM_HEADS=hq,
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),  # tl.dot needs K >= 16
        BLOCK_SIZE=block_size,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 caches: no tf32 rounding
        SKIP_SINGLE=skip_single,
        NUM_SPLITS=splits,
        SPLIT_TOKENS=SPLIT_TOKENS,
        **cfg,
    )
    if splits > 1:
        _paged_prefill_merge_kernel[(t, hq)](
            part_out,
            part_lse,
            cu_seqlens,
            context_lens,
            out,
            num_seqs,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=hq,
            NUM_SPLITS=splits,
            SPLIT_TOKENS=SPLIT_TOKENS,
            BLOCK_M=cfg["BLOCK_M"],
            SEARCH_STEPS=max(1, (num_seqs + 1).bit_length()),
            SKIP_SINGLE=skip_single,
            HEAD_DIM=d,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            num_warps=4,
        )
    return out
