"""The norm after a decode projection that carries its LoRA in its launch, each row split over programs by
columns (launched by `decode_norm_shrink.norm_launch`; `_rms_norm_shrink_kernel` is the one-program-a-row
form of the same step).

A row's sum of squares needs all its columns, and its columns need the expand: one program a row reads the
slot's whole B^T (and, with the shrink ahead, a tile of A over every column). Here a row's programs each
take BLOCK_C columns: they write their part of h and their partial sums, and the last of them to arrive
(an atomic counter a row) reduces the partials, writes the row's y and the next projection's shrink, and
resets the counter. No program waits for another, so the grid may exceed what the SMs hold at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from harli_train.engine.decode_reduce_kernels import _slot_and_row, _sum_with_expand


# part: a projection's fp32 GEMV workspace [SPLIT_K, M, stride_part] with its LoRA in the launch: columns
# [0, N) the split sums, columns e_col0 + slot * R + r the unscaled shrink of its slot. res, h, y: [M, N] (row
# strides given); w: [N]; bt: [S, R, N]; e_scales: [S]. Grid (M, cdiv(N, BLOCK_C)): program (p, j) takes the
# row at position p of the slot layout (sorted_ids; positions past slot_start[S] are their own base rows)
# and its columns [j * BLOCK_C, (j + 1) * BLOCK_C). Each value is rounded as `_rms_norm_shrink_kernel`'s
# FROM_PARTIAL rounds it: the splits' sum plus the slot's expand (the shrink summed over the splits, scaled
# and rounded to bt's dtype) rounded to p_like's dtype, the residual added in h's dtype, fp32 statistics.
# HAS_SHRINK: a is the next projection's stacked LoRA A [n_slices * S * R, N], rows (slice, slot, r); xa
# [M, n_slices * S * R] (row stride stride_xa) gets each row's scale_s * (y A_s^T), with y's rounding left out
# of the shrink (the norm's scale applied to the sum of h * w * A over the columns), in its slot's columns
# and zeros in the other adapter slots' columns. ss [M, P], sh [M, P, BLOCK_SA] fp32: the partial sums;
# count: int32 [>= M], zero before the launch and after it.
@triton.jit
def _split_norm_kernel(
    part_ptr,
    stride_part,
    res_ptr,
    stride_r,
    h_ptr,
    stride_h,
    w_ptr,
    y_ptr,
    stride_y,
    bt_ptr,
    e_scales_ptr,
    e_col0,
    p_like_ptr,
    a_ptr,
    scales_ptr,
    xa_ptr,
    stride_xa,
    n_slices,
    sorted_ids_ptr,
    slot_start_ptr,
    ss_ptr,
    sh_ptr,
    count_ptr,
    M,
    N,
    eps,
    lora_rank,
    lora_slots,
    SPLIT_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_SA: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_SHRINK: tl.constexpr,
):
    p = tl.program_id(0)
    j = tl.program_id(1)
    num_p = tl.num_programs(1)
    slot, row = _slot_and_row(p, sorted_ids_ptr, slot_start_ptr, lora_slots, BLOCK_S)
    cols = j * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < N
    if HAS_SHRINK:  # the A tile's load does not wait on the sums (base rows load nothing)
        sa = tl.arange(0, BLOCK_SA)
        piece = sa // lora_rank
        ra = sa % lora_rank
        live = (sa < n_slices * lora_rank) & ((tl.zeros_like(sa) + slot) > 0)
        a_rows = a_ptr + ((piece * lora_slots + slot) * lora_rank + ra).to(tl.int64)[:, None] * N
        a = tl.load(a_rows + cols[None, :], mask=live[:, None] & mask[None, :], other=0.0)
    x = _sum_with_expand(
        part_ptr, stride_part, M, row, slot, cols, mask, N, e_col0, bt_ptr, e_scales_ptr, lora_rank, p_like_ptr,
        SPLIT_K, BLOCK_R, BLOCK_C,
    )  # fmt: skip
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    tl.store(ss_ptr + p * num_p + j, tl.sum(hf * hf, axis=0))
    if HAS_SHRINK:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        partial = tl.sum(a.to(tl.float32) * (hf * w)[None, :], axis=1)
        tl.store(sh_ptr + (p * num_p + j) * BLOCK_SA + sa, partial)
    # Every thread's stores are issued before one thread's release of the arrival (the CTA barrier makes
    # that release cover them); the last to arrive acquires, and its loads bypass L1.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + p, 1, sem="acq_rel", scope="gpu")
    if arrived == num_p - 1:
        tl.debug_barrier()
        ps = tl.arange(0, BLOCK_P)
        ss = tl.load(ss_ptr + p * num_p + ps, mask=ps < num_p, other=0.0, cache_modifier=".cg")
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / N + eps)
        all_cols = tl.arange(0, BLOCK_H)
        row_mask = all_cols < N
        whole = tl.load(h_ptr + row * stride_h + all_cols, mask=row_mask, other=0.0, cache_modifier=".cg")
        normed = (whole.to(tl.float32) * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
        w_row = tl.load(w_ptr + all_cols, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(
            y_ptr + row * stride_y + all_cols, (normed * w_row).to(y_ptr.dtype.element_ty), mask=row_mask
        )
        if HAS_SHRINK:
            parts = tl.load(
                sh_ptr + (p * num_p + ps)[:, None] * BLOCK_SA + sa[None, :],
                mask=(ps < num_p)[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            acc = tl.sum(parts, axis=0) * rstd * tl.load(scales_ptr + slot)
            out = xa_ptr + row * stride_xa + piece * lora_slots * lora_rank + ra
            a_mask = sa < n_slices * lora_rank
            for jj in range(1, lora_slots):
                value = tl.where(slot == jj, acc, 0.0)
                tl.store(out + jj * lora_rank, value.to(xa_ptr.dtype.element_ty), mask=a_mask)
        tl.atomic_xchg(count_ptr + p, 0)
