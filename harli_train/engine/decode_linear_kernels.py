"""The GEMV kernel behind `decode_linear` (launchers, configs and the contract live there; the kernels that
sum its splits and the norms that follow it are in `decode_reduce_kernels`).

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
def _lora_expand_epilogue(
    acc,
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
    the accumulator: [BLOCK_N, BLOCK_M] (dot) or [BLOCK_N] (FMA, row 0). BLOCK_SR >= S * R, a power of two
    of at least 32."""
    if USE_DOT:
        # In chunks of 32 (slot, rank) pairs:
        # B's [BLOCK_N, 32] tiles beside the accumulator stay in registers.
        offs_m = tl.arange(0, BLOCK_M)
        for j0 in tl.static_range(0, BLOCK_SR, 32):
            j = j0 + tl.arange(0, 32)
            j_mask = (j >= lora_rank) & (j < lora_slots * lora_rank)
            b = tl.load(
                bt_ptr + j[None, :] * width + bt_cols[:, None],
                mask=col_mask[:, None] & j_mask[None, :],
                other=0.0,
            )
            xat = tl.load(
                xa_ptr + offs_m[None, :] * stride_xa + (piece * lora_slots * lora_rank + j)[:, None],
                mask=j_mask[:, None] & (offs_m < M)[None, :],
                other=0.0,
            )
            acc = tl.dot(b, xat.to(b.dtype), acc, input_precision=PRECISION)
    else:
        j = tl.arange(0, BLOCK_SR)  # (slot, rank) pairs; slot 0 (the base) is never read
        j_mask = (j >= lora_rank) & (j < lora_slots * lora_rank)
        xa_cols = piece * lora_slots * lora_rank + j
        b_rows = bt_ptr + j * width  # < 2**31: S, R and W are small
        b = tl.load(b_rows[:, None] + bt_cols[None, :], mask=j_mask[:, None] & col_mask[None, :], other=0.0)
        xa = tl.load(xa_ptr + xa_cols, mask=j_mask, other=0.0)
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
        g = _accumulate(
            x_ptr, stride_xm, w0_ptr, rows, n0, M, K, k_start, k_end,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, EVEN_N, EVEN_K, PRECISION,
        )  # fmt: skip
        u = _accumulate(
            x_ptr, stride_xm, w1_ptr, rows, n0, M, K, k_start, k_end,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, EVEN_N, EVEN_K, PRECISION,
        )  # fmt: skip
        col_mask = rows < n0
        if not PARTIAL:
            if HAS_ADDEND:
                g += _load_tile(add_ptr, stride_am, rows, col_mask, M, BLOCK_M, USE_DOT)
                u += _load_tile(add_ptr, stride_am, rows + n0, col_mask, M, BLOCK_M, USE_DOT)
            if LORA_EPILOGUE:
                g = _lora_expand_epilogue(
                    g, xa_ptr, stride_xa, bt_ptr, rows, col_mask, 0, 2 * n0, lora_rank, lora_slots, M,
                    BLOCK_M, BLOCK_SR, USE_DOT, PRECISION,
                )  # fmt: skip
                u = _lora_expand_epilogue(
                    u, xa_ptr, stride_xa, bt_ptr, rows + n0, col_mask, 1, 2 * n0, lora_rank, lora_slots, M,
                    BLOCK_M, BLOCK_SR, USE_DOT, PRECISION,
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
        acc = _accumulate(
            x_ptr, stride_xm, w_ptr, rows, n_rows, M, K, k_start, k_end,
            BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, EVEN_N, EVEN_K, PRECISION,
        )  # fmt: skip
        col_mask = rows < n_rows
        if not PARTIAL:
            if HAS_ADDEND:
                acc += _load_tile(add_ptr, stride_am, col0 + rows, col_mask, M, BLOCK_M, USE_DOT)
            if LORA_EPILOGUE:
                acc = _lora_expand_epilogue(
                    acc, xa_ptr, stride_xa, bt_ptr, col0 + rows, col_mask, piece, n0 + n1 + n2, lora_rank,
                    lora_slots, M, BLOCK_M, BLOCK_SR, USE_DOT, PRECISION,
                )  # fmt: skip
            _store_tile(out_ptr, stride_om, acc, col0 + rows, col_mask, M, BLOCK_M, USE_DOT)
        else:
            _store_tile(part, stride_om, acc, col0 + rows, col_mask, M, BLOCK_M, USE_DOT)
