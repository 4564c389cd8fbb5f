"""The Triton kernels behind `decode_linear` (launchers, configs and the contract live there).

`_decode_linear_kernel` streams row tiles of up to three weights against a few rows of x (FMA at M == 1,
"swap AB" tensor-core dots above); with SPLIT_K > 1 it writes fp32 partials that `_split_reduce_kernel` (or
`_split_reduce_add_rms_norm_kernel`) sums in a fixed order. An optional fp32 addend [M, N_total] (a LoRA
delta) joins the fp32 sum before the epilogue (cast, SwiGLU, residual add and norm): in the GEMV kernel's
epilogue without split-K, in the reduce kernel with it. With the LoRA in the launches (HAS_LORA, always
PARTIAL), the GEMV kernel also computes the shrink over the stacked A's row tiles and the expand joins the
sums in `_split_reduce_lora_kernel` (tiles of rows grouped by slot, over column tiles); a residual add and
norm then runs as its own row kernel (`kernels.add_rms_norm`), as it does after a GEMV without split-K.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _accumulate(
    x_ptr,
    stride_xm,
    w_ptr,
    rows,
    n_rows,
    M,
    K,
    k_start,
    k_end,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """fp32 sums over k in [k_start, k_end) of W[rows, k] x[m, k]: [BLOCK_N, BLOCK_M] (dot) or [BLOCK_N]."""
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = rows < n_rows
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    if USE_DOT:
        offs_m = tl.arange(0, BLOCK_M)
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                k_mask = offs_k < BLOCK_K
            else:
                k_mask = offs_k + k0 < K
            if EVEN_N:
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs + k0, mask=k_mask[:, None] & (offs_m < M)[None, :], other=0.0)
            acc = tl.dot(w, xt.to(w.dtype), acc, input_precision=PRECISION)
        return acc
    else:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                k_mask = offs_k < BLOCK_K
            else:
                k_mask = offs_k + k0 < K
            if EVEN_N:
                w = tl.load(w_ptrs + k0, mask=k_mask[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            xv = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0)
            acc2 += w.to(tl.float32) * xv.to(tl.float32)[None, :]
        return tl.sum(acc2, axis=1)


@triton.jit
def _load_tile(ptr, stride_m, cols, col_mask, M, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    # ptr[m, cols] in fp32, laid out as the accumulator: [BLOCK_N, BLOCK_M] (dot) or [BLOCK_N] (FMA, row 0).
    if USE_DOT:
        offs_m = tl.arange(0, BLOCK_M)
        ptrs = ptr + offs_m[None, :] * stride_m + cols[:, None]
        return tl.load(ptrs, mask=col_mask[:, None] & (offs_m < M)[None, :], other=0.0).to(tl.float32)
    else:
        return tl.load(ptr + cols, mask=col_mask, other=0.0).to(tl.float32)


@triton.jit
def _store_tile(out_ptr, stride_om, acc, cols, col_mask, M, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    # acc [BLOCK_N, BLOCK_M] (dot) or [BLOCK_N] (FMA, row 0 only) into out[m, cols].
    if USE_DOT:
        offs_m = tl.arange(0, BLOCK_M)
        ptrs = out_ptr + offs_m[None, :] * stride_om + cols[:, None]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_mask[:, None] & (offs_m < M)[None, :])
    else:
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _lora_pairs(
    xa_ptr,
    stride_xa,
    bt_ptr,
    bt_cols,
    col_mask,
    piece,
    width,
    lora_rank,
    lora_slots,
    M,
    j0,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """The expand's operands for (slot, rank) pairs [j0, j0 + PAIRS) over columns `bt_cols` of B^T
    [S, R, width] and slice `piece` of xa (slot 0, the base, is never read): (B^T tile [BLOCK_N, PAIRS],
    xa^T [PAIRS, BLOCK_M]) for the dot, (B^T tile [PAIRS, BLOCK_N], row 0's xa [PAIRS]) for FMA."""
    j = j0 + tl.arange(0, PAIRS)
    j_mask = (j >= lora_rank) & (j < lora_slots * lora_rank)
    xa_cols = piece * lora_slots * lora_rank + j
    if USE_DOT:
        offs_m = tl.arange(0, BLOCK_M)
        b = tl.load(
            bt_ptr + j[None, :] * width + bt_cols[:, None],
            mask=col_mask[:, None] & j_mask[None, :],
            other=0.0,
        )
        xa = tl.load(
            xa_ptr + offs_m[None, :] * stride_xa + xa_cols[:, None],
            mask=j_mask[:, None] & (offs_m < M)[None, :],
            other=0.0,
        )
    else:
        b_rows = bt_ptr + j * width  # < 2**31: S, R and W are small
        b = tl.load(b_rows[:, None] + bt_cols[None, :], mask=j_mask[:, None] & col_mask[None, :], other=0.0)
        xa = tl.load(xa_ptr + xa_cols, mask=j_mask, other=0.0)
    return b, xa


@triton.jit
def _lora_expand_epilogue(
    acc,
    ahead,
    xa_ptr,
    stride_xa,
    bt_ptr,
    bt_cols,
    col_mask,
    piece,
    width,
    lora_rank,
    lora_slots,
    M,
    BLOCK_M: tl.constexpr,
    BLOCK_SR: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc plus each row's expand over columns `bt_cols` of B^T [S, R, width]: one product over every
    adapter slot's ranks at once, B^T[1:S, :, cols]^T @ xa[:, slice `piece`, 1:S, :]^T, xa being zero on a
    row outside its slot (`rms_norm_shrink`'s layout), so no load waits on the step's slot layout. acc as
    the accumulator: [BLOCK_N, BLOCK_M] (dot) or [BLOCK_N] (FMA, row 0). `ahead`: `_lora_pairs` from j0 = 0,
    loaded before the weight stream so that their latency hides behind it (every pair for FMA, the first 32
    for the dot). BLOCK_SR >= S * R, a power of two of at least 32."""
    if USE_DOT:
        # In chunks of 32 (slot, rank) pairs: B's [BLOCK_N, 32] tiles beside the accumulator stay in registers.
        b, xat = ahead
        acc = tl.dot(b, xat.to(b.dtype), acc, input_precision=PRECISION)
        for j0 in tl.static_range(32, BLOCK_SR, 32):
            b, xat = _lora_pairs(
                xa_ptr, stride_xa, bt_ptr, bt_cols, col_mask, piece, width, lora_rank, lora_slots, M, j0,
                BLOCK_M, 32, USE_DOT,
            )  # fmt: skip
            acc = tl.dot(b, xat.to(b.dtype), acc, input_precision=PRECISION)
    else:
        b, xa = ahead
        acc += tl.sum(b.to(tl.float32) * xa.to(tl.float32)[:, None], axis=0)
    return acc


# x: [M, K] (row stride stride_xm, unit column stride); w0/w1/w2: [N_g, K] contiguous (unused ones alias w0).
# out: [M, N_total] (row stride stride_om) unless PARTIAL, else the fp32 workspace [SPLIT_K, M, stride_om]
# of each split's sums. Columns: weight g's rows go to [col_g, col_g + N_g); with SWIGLU the workspace holds
# gate sums in [0, N_0) and up sums in [N_0, 2 N_0).
# add: fp32 [M, N_total] (2 N_0 with SWIGLU: gate columns, then up; row stride stride_am), read when
# HAS_ADDEND and not PARTIAL (the reduce kernel adds it otherwise).
# HAS_LORA (PARTIAL too): a: the stacked LoRA A [n_a, K] contiguous, rows (slice, slot, r) for
# lora_slots slots of lora_rank rows; programs from tiles_base on compute x a^T into the workspace's
# columns [a_col0, a_col0 + n_a) (the reduce kernel's expand reads them); slot_start [S + 1] int32 as in
# lora_ops.lora_layout.
# Grid (row tiles of all weights [+ row tiles of a], SPLIT_K); tiles_0 / tiles_01: row tiles of weight 0 /
# weights 0 and 1.
@triton.jit
def _decode_linear_kernel(
    x_ptr,
    stride_xm,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    out_ptr,
    stride_om,
    add_ptr,
    stride_am,
    M,
    K,
    n0,
    n1,
    n2,
    tiles_0,
    tiles_01,
    a_col0,
    k_per_split,
    a_ptr,
    n_a,
    tiles_base,
    slot_start_ptr,
    lora_rank,
    lora_slots,
    xa_ptr,
    stride_xa,
    bt_ptr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    HAS_LORA: tl.constexpr,
    LORA_EPILOGUE: tl.constexpr,
    BLOCK_SR: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    AHEAD_PAIRS: tl.constexpr = 32 if USE_DOT else BLOCK_SR  # the epilogue's pairs loaded before the stream
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    part = out_ptr + split.to(tl.int64) * M * stride_om  # PARTIAL: this split's fp32 sums [M, width]
    if HAS_LORA:
        if pid >= tiles_base:
            # The LoRA shrink: rows (slice, slot, r) of the stacked A, stored past the projection's columns.
            # A tile none of whose slots has a row in this step (or only the base's) returns at once.
            rows = (pid - tiles_base) * BLOCK_N + tl.arange(0, BLOCK_N)
            in_a = rows < n_a
            slot = (rows // lora_rank) % lora_slots
            lo = tl.load(slot_start_ptr + slot, mask=in_a, other=0)
            hi = tl.load(slot_start_ptr + slot + 1, mask=in_a, other=0)
            live = in_a & (slot > 0) & (hi > lo)
            if tl.max(live.to(tl.int32), axis=0) == 0:
                return
            acc = _accumulate(
                x_ptr, stride_xm, a_ptr, rows, n_a, M, K, k_start, k_end,
                BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, False, EVEN_K, PRECISION,
            )  # fmt: skip
            _store_tile(part, stride_om, acc, a_col0 + rows, in_a, M, BLOCK_M, USE_DOT)
            return
    if SWIGLU:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = rows < n0
        g_ahead = (0, 0)
        u_ahead = (0, 0)
        if LORA_EPILOGUE and not PARTIAL:
            g_ahead = _lora_pairs(
                xa_ptr, stride_xa, bt_ptr, rows, col_mask, 0, 2 * n0, lora_rank, lora_slots, M, 0,
                BLOCK_M, AHEAD_PAIRS, USE_DOT,
            )  # fmt: skip
            u_ahead = _lora_pairs(
                xa_ptr, stride_xa, bt_ptr, rows + n0, col_mask, 1, 2 * n0, lora_rank, lora_slots, M, 0,
                BLOCK_M, AHEAD_PAIRS, USE_DOT,
            )  # fmt: skip
        g = _accumulate(
            x_ptr, stride_xm, w0_ptr, rows, n0, M, K, k_start, k_end,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, EVEN_N, EVEN_K, PRECISION,
        )  # fmt: skip
        u = _accumulate(
            x_ptr, stride_xm, w1_ptr, rows, n0, M, K, k_start, k_end,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, EVEN_N, EVEN_K, PRECISION,
        )  # fmt: skip
        if not PARTIAL:
            if HAS_ADDEND:
                g += _load_tile(add_ptr, stride_am, rows, col_mask, M, BLOCK_M, USE_DOT)
                u += _load_tile(add_ptr, stride_am, rows + n0, col_mask, M, BLOCK_M, USE_DOT)
            if LORA_EPILOGUE:
                g = _lora_expand_epilogue(
                    g, g_ahead, xa_ptr, stride_xa, bt_ptr, rows, col_mask, 0, 2 * n0, lora_rank, lora_slots,
                    M, BLOCK_M, BLOCK_SR, USE_DOT, PRECISION,
                )  # fmt: skip
                u = _lora_expand_epilogue(
                    u, u_ahead, xa_ptr, stride_xa, bt_ptr, rows + n0, col_mask, 1, 2 * n0, lora_rank,
                    lora_slots, M, BLOCK_M, BLOCK_SR, USE_DOT, PRECISION,
                )  # fmt: skip
            _store_tile(out_ptr, stride_om, g * tl.sigmoid(g) * u, rows, col_mask, M, BLOCK_M, USE_DOT)
        else:
            _store_tile(part, stride_om, g, rows, col_mask, M, BLOCK_M, USE_DOT)
            _store_tile(part, stride_om, u, rows + n0, col_mask, M, BLOCK_M, USE_DOT)
    else:
        # Scalar branches pick the weight; every program then runs the same streaming loop.
        w_ptr = w0_ptr
        n_rows = n0
        col0 = 0
        tile = pid
        piece = 0
        if pid >= tiles_01:
            w_ptr = w2_ptr
            n_rows = n2
            col0 = n0 + n1
            tile = pid - tiles_01
            piece = 2
        elif pid >= tiles_0:
            w_ptr = w1_ptr
            n_rows = n1
            col0 = n0
            tile = pid - tiles_0
            piece = 1
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = rows < n_rows
        ahead = (0, 0)
        if LORA_EPILOGUE and not PARTIAL:
            ahead = _lora_pairs(
                xa_ptr, stride_xa, bt_ptr, col0 + rows, col_mask, piece, n0 + n1 + n2, lora_rank, lora_slots,
                M, 0, BLOCK_M, AHEAD_PAIRS, USE_DOT,
            )  # fmt: skip
        acc = _accumulate(
            x_ptr, stride_xm, w_ptr, rows, n_rows, M, K, k_start, k_end,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, EVEN_N, EVEN_K, PRECISION,
        )  # fmt: skip
        if not PARTIAL:
            if HAS_ADDEND:
                acc += _load_tile(add_ptr, stride_am, col0 + rows, col_mask, M, BLOCK_M, USE_DOT)
            if LORA_EPILOGUE:
                acc = _lora_expand_epilogue(
                    acc, ahead, xa_ptr, stride_xa, bt_ptr, col0 + rows, col_mask, piece, n0 + n1 + n2,
                    lora_rank, lora_slots, M, BLOCK_M, BLOCK_SR, USE_DOT, PRECISION,
                )  # fmt: skip
            _store_tile(out_ptr, stride_om, acc, col0 + rows, col_mask, M, BLOCK_M, USE_DOT)
        else:
            _store_tile(part, stride_om, acc, col0 + rows, col_mask, M, BLOCK_M, USE_DOT)


# part: [SPLIT_K, M, stride_part] fp32 (W = N, or 2 N with SWIGLU, columns of sums first); out: [M, N] row
# stride stride_om; add (when HAS_ADDEND): fp32 [M, W] row stride stride_am, summed with the splits.
@triton.jit
def _split_reduce_kernel(
    part_ptr,
    stride_part,
    out_ptr,
    stride_om,
    add_ptr,
    stride_am,
    M,
    N,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        row = part_ptr + (s * M + m) * stride_part
        acc += tl.load(row + cols, mask=mask, other=0.0)
        if SWIGLU:
            up += tl.load(row + N + cols, mask=mask, other=0.0)
    if HAS_ADDEND:
        acc += tl.load(add_ptr + m * stride_am + cols, mask=mask, other=0.0)
        if SWIGLU:
            up += tl.load(add_ptr + m * stride_am + N + cols, mask=mask, other=0.0)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * up
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lora_shrink_tile(part_ptr, stride_part, M, rows, sel, cols, r_mask, SPLIT_K: tl.constexpr):
    """The shrink's values [BLOCK_M, BLOCK_R] of `rows` (where `sel`) in workspace columns `cols`, their
    splits summed in order."""
    s = tl.zeros((rows.shape[0], cols.shape[0]), dtype=tl.float32)
    for k in tl.static_range(SPLIT_K):
        ptrs = part_ptr + (k * M + rows[:, None]) * stride_part + cols[None, :]
        s += tl.load(ptrs, mask=sel[:, None] & r_mask[None, :], other=0.0)
    return s


# The split sum with the LoRA expand, BLOCK_M positions of the step's rows grouped by slot (lora_layout;
# positions past the layout are their own base rows) by BLOCK_N columns: for each adapter slot in the tile,
# acc[its rows] += scale * (s [rows, R] @ B^T [R, columns]) on the tensor cores, so a slot's B^T tile is read
# once a tile, not once a row. part and out as in _split_reduce_kernel; the shrink in part's columns
# [a_col0, ...) as (slice, slot, r); bt [S, R, W]: B transposed, the projection's columns side by side
# (slices of n0 and n1 columns, then the rest; gate then up with SWIGLU).
@triton.jit
def _split_reduce_lora_kernel(
    part_ptr,
    stride_part,
    out_ptr,
    stride_om,
    M,
    N,
    bt_ptr,
    scales_ptr,
    sorted_ids_ptr,
    slot_start_ptr,
    a_col0,
    n0,
    n1,
    n_slices,
    lora_rank,
    lora_slots,
    xa_ptr,
    stride_xa,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
    PRE_SHRUNK: tl.constexpr,
):
    p = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = p < M
    laid = in_m & (p < tl.load(slot_start_ptr + lora_slots))
    js = tl.arange(0, BLOCK_S)
    starts = tl.load(slot_start_ptr + js, mask=(js >= 1) & (js < lora_slots), other=2147483647)
    slot = tl.where(laid, tl.sum((starts[None, :] <= p[:, None]).to(tl.int32), axis=1), 0)
    rows = tl.where(laid, tl.load(sorted_ids_ptr + p, mask=laid, other=0), p).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < N
    width = 2 * N if SWIGLU else N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tile_mask = in_m[:, None] & c_mask[None, :]
    for k in tl.static_range(SPLIT_K):
        row = part_ptr + (k * M + rows[:, None]) * stride_part
        acc += tl.load(row + cols[None, :], mask=tile_mask, other=0.0)
        if SWIGLU:
            up += tl.load(row + N + cols[None, :], mask=tile_mask, other=0.0)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < lora_rank
    slices = tl.full(r.shape, n_slices, tl.int32)  # a tensor: the interpreter's masks want one
    r_mask1, r_mask2 = r_mask & (slices > 1), r_mask & (slices > 2)
    step = lora_slots * lora_rank  # workspace columns between one slice's shrink and the next's
    lo = tl.min(tl.where(slot > 0, slot, lora_slots), axis=0)
    hi = tl.max(slot, axis=0)
    for j in range(lo, hi + 1):
        sel = slot == j
        scale = tl.load(scales_ptr + j)
        shrink = a_col0 + j * lora_rank + r
        b_rows = bt_ptr + j * lora_rank * width + r[:, None] * width  # < 2**31: S, R and W are small
        b = tl.load(b_rows + cols[None, :], mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        if PRE_SHRUNK:  # scaled and rounded already, zero outside a row's slot (rms_norm_shrink)
            s0 = _lora_shrink_tile(xa_ptr, stride_xa, 0, rows, sel, j * lora_rank + r, r_mask, 1)
            s1 = _lora_shrink_tile(xa_ptr, stride_xa, 0, rows, sel, j * lora_rank + r + step, r_mask1, 1)
        else:
            s0 = _lora_shrink_tile(part_ptr, stride_part, M, rows, sel, shrink, r_mask, SPLIT_K) * scale
            s1 = (
                _lora_shrink_tile(part_ptr, stride_part, M, rows, sel, shrink + step, r_mask1, SPLIT_K)
                * scale
            )
        if SWIGLU:  # gate is slice 0 on columns [0, N), up slice 1 on [N, 2 N)
            b_up = tl.load(b_rows + N + cols[None, :], mask=r_mask[:, None] & c_mask[None, :], other=0.0)
            acc = tl.dot(s0.to(b.dtype), b, acc, input_precision=PRECISION)
            up = tl.dot(s1.to(b.dtype), b_up, up, input_precision=PRECISION)
        else:  # each column's slice: s0 before n0, s1 before n0 + n1, s2 after (zero where absent)
            if PRE_SHRUNK:
                s2 = _lora_shrink_tile(
                    xa_ptr, stride_xa, 0, rows, sel, j * lora_rank + r + 2 * step, r_mask2, 1
                )
            else:
                s2 = (
                    _lora_shrink_tile(
                        part_ptr, stride_part, M, rows, sel, shrink + 2 * step, r_mask2, SPLIT_K
                    )
                    * scale
                )
            c = cols[None, :]
            zero = tl.zeros_like(b)
            acc = tl.dot(s0.to(b.dtype), tl.where(c < n0, b, zero), acc, input_precision=PRECISION)
            b1 = tl.where((c >= n0) & (c < n0 + n1), b, zero)
            acc = tl.dot(s1.to(b.dtype), b1, acc, input_precision=PRECISION)
            b2 = tl.where(c >= n0 + n1, b, zero)
            acc = tl.dot(s2.to(b.dtype), b2, acc, input_precision=PRECISION)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * up
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


# part: [SPLIT_K, M, stride_part] fp32; res, h, y: [M, N] (row strides given); add (when HAS_ADDEND): fp32
# [M, N] row stride stride_am. One program per row: the sum of the splits (and the addend) is the
# projection's output in its dtype (as `decode_linear` would store it); then the residual add and RMSNorm
# round as `kernels.add_rms_norm` does (h in its dtype, fp32 statistics).
@triton.jit
def _split_reduce_add_rms_norm_kernel(
    part_ptr,
    stride_part,
    add_ptr,
    stride_am,
    res_ptr,
    stride_r,
    w_ptr,
    h_ptr,
    stride_h,
    y_ptr,
    stride_y,
    M,
    N,
    eps,
    SPLIT_K: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * stride_part + cols, mask=mask, other=0.0)
    if HAS_ADDEND:
        acc += tl.load(add_ptr + m * stride_am + cols, mask=mask, other=0.0)
    x = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    r = tl.load(res_ptr + m * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + m * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
    normed = (hf * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_y + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


# x, res, h, y: [M, N] (row strides given; h aliases x without a residual); w: [N]; a: the stacked LoRA A
# [n_slices * S * R, N] contiguous, rows (slice, slot, r); xa: [M, n_slices * S * R] (row stride stride_xa)
# in the adapters' dtype. Grid (M, n_slices * r_tiles): program (p, t) takes the row at position p of the
# slot layout (sorted_ids; positions past slot_start[S] are their own base rows). It computes the row's norm
# as _rms_norm_fwd_kernel does (t == 0 stores h and y), then, from the same registers, the shrink of slice
# t // r_tiles, ranks BLOCK_A * (t % r_tiles) + [0, BLOCK_A), of the row's slot (one [BLOCK_A, N] tile of A,
# loaded at once): scaled, rounded to the adapters' dtype, stored in that slot's columns, and zeros in the
# other adapter slots' columns.
@triton.jit
def _rms_norm_shrink_kernel(
    x_ptr,
    stride_x,
    res_ptr,
    stride_r,
    h_ptr,
    stride_h,
    w_ptr,
    y_ptr,
    stride_y,
    a_ptr,
    scales_ptr,
    sorted_ids_ptr,
    slot_start_ptr,
    xa_ptr,
    stride_xa,
    N,
    eps,
    lora_rank,
    lora_slots,
    r_tiles,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    p = tl.program_id(0)
    t = tl.program_id(1)
    laid = p < tl.load(slot_start_ptr + lora_slots)
    js = tl.arange(0, BLOCK_S)
    starts = tl.load(slot_start_ptr + js, mask=(js >= 1) & (js < lora_slots), other=2147483647)
    slot = tl.where(laid, tl.sum((starts <= p).to(tl.int32), axis=0), 0)
    row = tl.where(laid, tl.load(sorted_ids_ptr + p, mask=laid, other=0), p).to(tl.int64)
    piece = t // r_tiles
    ra = (t % r_tiles) * BLOCK_A + tl.arange(0, BLOCK_A)
    a_mask = ra < lora_rank
    cols = tl.arange(0, BLOCK_H)
    mask = cols < N
    # The A tile's load does not wait on the norm (base rows load nothing).
    a_rows = a_ptr + ((piece * lora_slots + slot) * lora_rank + ra).to(tl.int64)[:, None] * N
    live = a_mask & ((tl.zeros_like(ra) + slot) > 0)  # a tensor: the interpreter's masks want one
    a = tl.load(a_rows + cols[None, :], mask=live[:, None] & mask[None, :], other=0.0)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        if t == 0:
            tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(y_ptr.dtype.element_ty)
    if t == 0:
        tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
    acc = tl.sum(a.to(tl.float32) * y.to(tl.float32)[None, :], axis=1) * tl.load(scales_ptr + slot)
    out = xa_ptr + row * stride_xa + piece * lora_slots * lora_rank + ra
    for j in range(1, lora_slots):
        value = tl.where(slot == j, acc, 0.0)
        tl.store(out + j * lora_rank, value.to(xa_ptr.dtype.element_ty), mask=a_mask)
