"""The kernels after `decode_linear`'s GEMV (launchers and the contract live in `decode_linear`).

`_split_reduce_kernel` sums the GEMV's fp32 split partials in a fixed order (with an addend, the SwiGLU);
`_split_reduce_lora_kernel` does so with the batched LoRA's expand, rows grouped by adapter slot;
`_split_reduce_add_rms_norm_kernel` adds the residual and norms the sum; `_rms_norm_shrink_kernel` is a
norm whose programs also compute the shrink of the next projection's LoRA, so that its GEMV adds the expand
in its own epilogue, and which may take a projection's split sums with that projection's own LoRA expand
(one launch for the sum, the expand, the residual add, the norm and the next shrink).
"""

from __future__ import annotations

import triton
import triton.language as tl


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


@triton.jit
def _slot_and_row(p, sorted_ids_ptr, slot_start_ptr, lora_slots, BLOCK_S: tl.constexpr):
    """(slot, row) at position `p` of a step's slot layout (sorted_ids; positions past slot_start[S] are
    their own base rows, slot 0)."""
    laid = p < tl.load(slot_start_ptr + lora_slots)
    js = tl.arange(0, BLOCK_S)
    starts = tl.load(slot_start_ptr + js, mask=(js >= 1) & (js < lora_slots), other=2147483647)
    slot = tl.where(laid, tl.sum((starts <= p).to(tl.int32), axis=0), 0)
    row = tl.where(laid, tl.load(sorted_ids_ptr + p, mask=laid, other=0), p).to(tl.int64)
    return slot, row


@triton.jit
def _sum_with_expand(
    part_ptr,
    stride_part,
    M,
    row,
    slot,
    cols,
    mask,
    N,
    e_col0,
    bt_ptr,
    e_scales_ptr,
    lora_rank,
    p_like_ptr,
    SPLIT_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """fp32 [BLOCK]: a projection's output at `cols` of `row` from its GEMV workspace with its LoRA in the
    launch (see `_rms_norm_shrink_kernel`'s FROM_PARTIAL): the splits' sum plus the slot's expand (the
    shrink summed over the splits, scaled, rounded to bt's dtype), rounded to p_like's dtype. The expand
    takes 16 ranks at a time: [16, BLOCK] tiles of B^T, each thread summing its columns' ranks."""
    x = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        x += tl.load(part_ptr + (s * M + row) * stride_part + cols, mask=mask, other=0.0)
    scale = tl.load(e_scales_ptr + slot)
    for r0 in tl.static_range(0, BLOCK_R, 16):
        rr = r0 + tl.arange(0, 16)
        r_live = (rr < lora_rank) & ((tl.zeros_like(rr) + slot) > 0)
        sr = tl.zeros((16,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            shrink = part_ptr + (s * M + row) * stride_part + e_col0 + slot * lora_rank
            sr += tl.load(shrink + rr, mask=r_live, other=0.0)
        sr = (sr * scale).to(bt_ptr.dtype.element_ty).to(tl.float32)
        b_rows = bt_ptr + (slot * lora_rank + rr).to(tl.int64)[:, None] * N
        b = tl.load(b_rows + cols[None, :], mask=r_live[:, None] & mask[None, :], other=0.0)
        x += tl.sum(sr[:, None] * b.to(tl.float32), axis=0)
    return x.to(p_like_ptr.dtype.element_ty).to(tl.float32)


# x, res, h, y: [M, N] (row strides given; h aliases x without a residual); w: [N]; a: the stacked LoRA A
# [n_slices * S * R, N] contiguous, rows (slice, slot, r); xa: [M, n_slices * S * R] (row stride stride_xa)
# in the adapters' dtype. Grid (M, n_slices * r_tiles): program (p, t) takes the row at position p of the
# slot layout (sorted_ids; positions past slot_start[S] are their own base rows). It computes the row's norm
# as _rms_norm_fwd_kernel does (t == 0 stores h and y), then, from the same registers, the shrink of slice
# t // r_tiles, ranks BLOCK_A * (t % r_tiles) + [0, BLOCK_A), of the row's slot (one [BLOCK_A, N] tile of A,
# loaded at once): scaled, rounded to the adapters' dtype, stored in that slot's columns, and zeros in the
# other adapter slots' columns. Without HAS_SHRINK (grid (M, 1)) it is the norm alone: a, scales and xa
# are not read.
# FROM_PARTIAL: x is a projection's fp32 GEMV workspace [SPLIT_K, M, stride_x] with its own LoRA in the
# launch (`decode_linear`'s HAS_LORA): the row's value is the sum of its splits over columns [0, N), plus
# its slot's expand, sum_r s_r bt[slot, r, :], where s_r is the shrink in columns e_col0 + slot * R + r
# summed over the splits, scaled by e_scales[slot] and rounded to bt's dtype (bt: [S, R, N]); that value is
# rounded to p_like's dtype (the projection's output as `decode_linear` stores it) before the residual add.
# FROM_PARTIAL takes a residual. Both LoRAs share the step's slot layout, rank and slot count.
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
    M,
    bt_ptr,
    e_scales_ptr,
    e_col0,
    p_like_ptr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SHRINK: tl.constexpr,
    FROM_PARTIAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    p = tl.program_id(0)
    t = tl.program_id(1)
    slot, row = _slot_and_row(p, sorted_ids_ptr, slot_start_ptr, lora_slots, BLOCK_S)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < N
    if HAS_SHRINK:
        piece = t // r_tiles
        ra = (t % r_tiles) * BLOCK_A + tl.arange(0, BLOCK_A)
        a_mask = ra < lora_rank
        # The A tile's load does not wait on the norm (base rows load nothing).
        a_rows = a_ptr + ((piece * lora_slots + slot) * lora_rank + ra).to(tl.int64)[:, None] * N
        live = a_mask & ((tl.zeros_like(ra) + slot) > 0)  # a tensor: the interpreter's masks want one
        a = tl.load(a_rows + cols[None, :], mask=live[:, None] & mask[None, :], other=0.0)
    if FROM_PARTIAL:
        x = _sum_with_expand(
            x_ptr, stride_x, M, row, slot, cols, mask, N, e_col0, bt_ptr, e_scales_ptr, lora_rank, p_like_ptr,
            SPLIT_K, BLOCK_R, BLOCK_H,
        )  # fmt: skip
    else:
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
    if HAS_SHRINK:
        acc = tl.sum(a.to(tl.float32) * y.to(tl.float32)[None, :], axis=1) * tl.load(scales_ptr + slot)
        out = xa_ptr + row * stride_xa + piece * lora_slots * lora_rank + ra
        for j in range(1, lora_slots):
            value = tl.where(slot == j, acc, 0.0)
            tl.store(out + j * lora_rank, value.to(xa_ptr.dtype.element_ty), mask=a_mask)
