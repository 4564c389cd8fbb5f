"""Batched LoRA for the decode engine (punica / S-LoRA style): y += scale_s * (x A_s^T) B_s^T, where each
token's adapter slot s is its own, and many adapters run in one launch.

Adapters live stacked in one buffer per projection: A [S, R, K] and B [S, N, R] (slot 0 is the base model:
its tokens are skipped). A step's tokens are grouped by slot once (`lora_layout`): `sorted_ids` lists the
token rows slot by slot and `slot_start[s]` is where slot s's rows begin. Two kernels, as in vLLM's lora/ops:
  * shrink: part[split, slice, t, :] = scale_s * x[t] A_s^T over one K range (split-K for a few tokens and a
    long K); programs of slot 0, and past a slot's rows, return at once.
  * expand: y[t, col_i : col_i + N_i] += (sum over splits of part[split, i, t, :]) B_s^T, the splits summed in
    a fixed order (deterministic) and the add done in fp32 before the one cast to y's dtype.
Up to three slices share x (q/k/v, gate/up), each with its own A and B stacks and its own output: a column
range of one y (the projections side by side), or a tensor of its own (gate and up, which the SwiGLU reads
apart). `lora_add` adds into y (the model's own forward, through hooks; cuBLAS's outputs past the GEMV's
rows); `lora_delta_split` stores the delta into an fp32 buffer instead (zeros on the base's rows), as
`lora_fused.lora_delta_fused` does in one launch.
The grids are sized by `max_rows` (the most rows one slot may hold), not by the step's content, so a CUDA
graph captured for a bucket replays for any mix of adapters; the kernels read the buffers by address, so
writing an adapter's weights needs no re-capture. Block sizes come from `lora_config` (no autotune).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from harli_train.kernels.launch_config import num_sms as current_num_sms


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Block sizes of one shrink + expand pair."""

    block_m: int
    block_r: int
    block_k: int  # shrink: columns of x per iteration
    split_k: int  # shrink: K ranges summed by the expand
    block_n: int  # expand: columns of y per program
    num_warps: int


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def lora_config(max_rows: int, rank: int, k: int, num_sms: int, elem_bytes: int = 2) -> LoRAConfig:
    """The config for up to `max_rows` rows a slot, adapters of rank <= `rank` and x of `k` columns.

    tl.dot needs 16 on every side, so rows and rank are padded to 16 at least. The shrink reads an [R, K]
    slice of A per program: a few rows and a long K would leave most SMs idle, so K is split into up to 16
    ranges of >= 4 blocks (at most a quarter of the SMs' count, for a small partition)."""
    block_m = min(64, max(16, _pow2(max_rows)))
    block_r = max(16, _pow2(rank))
    block_k = min(256 // elem_bytes, max(16, _pow2(k)))  # 128 columns in 16-bit types, 64 in fp32
    k_blocks = _cdiv(k, block_k)
    split_k = max(1, min(16, k_blocks // 4, max(num_sms // 4, 1)))
    block_n = 128 if elem_bytes <= 2 else 64
    return LoRAConfig(block_m, block_r, block_k, split_k, block_n, 4)


def lora_layout(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted_ids [T] int32, slot_start [num_slots + 1] int32) of a step whose token t runs on adapter slot
    `token_slots[t]` (0: the base): the token rows grouped slot by slot,
    and where each slot's group begins."""
    slots = np.asarray(token_slots, dtype=np.int64)
    sorted_ids = np.argsort(slots, kind="stable").astype(np.int32)
    slot_start = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(np.bincount(slots, minlength=num_slots)[:num_slots], out=slot_start[1:])
    return sorted_ids, slot_start


# x: [T, K] (row stride stride_xm, unit column stride); a0..a2: A stacks [S, R, K] contiguous, one per slice
# (unused ones alias a0); sorted_ids: [T] int32; slot_start: [S + 1] int32; scales: [S] fp32.
# part: [SPLIT_K, n_slices, T, R] fp32 dense; only the rows of adapter tokens are written.
# Grid (cdiv(max_rows, BLOCK_M) * SPLIT_K, n_slices, S).
@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    stride_xm,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    part_ptr,
    sorted_ids_ptr,
    slot_start_ptr,
    scales_ptr,
    T,
    K,
    R,
    n_slices,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    piece = tl.program_id(1)
    slot = tl.program_id(2)
    if slot == 0:
        return  # the base model's tokens
    m_tile = pid // SPLIT_K
    split = pid % SPLIT_K
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_start_ptr + slot + 1) - start
    if m_tile * BLOCK_M >= count:
        return
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    a_ptr = a0_ptr
    if piece == 1:
        a_ptr = a1_ptr
    elif piece == 2:
        a_ptr = a2_ptr
    a_base = a_ptr + slot.to(tl.int64) * R * K
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = k0 + offs_k < k_end
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        at = tl.load(  # A^T tile [BLOCK_K, BLOCK_R]
            a_base + offs_r[None, :] * K + (k0 + offs_k)[:, None],
            mask=r_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        acc = tl.dot(x, at.to(x.dtype), acc, input_precision=PRECISION)
    acc = acc * tl.load(scales_ptr + slot)
    out = part_ptr + (split * n_slices + piece).to(tl.int64) * T * R
    tl.store(out + rows[:, None] * R + offs_r[None, :], acc, mask=m_mask[:, None] & r_mask[None, :])


# part: as the shrink wrote it; b0..b2: B stacks [S, N_i, R] contiguous (unused ones alias b0); y0..y2: [T, *]
# (row strides stride_y0..2, unit column stride), slice i adding into columns [col_i, col_i + N_i) of y_i (the
# slices' outputs may be one tensor); with STORE, y is an fp32 delta that the delta is stored into instead,
# zeros on slot 0's rows. Grid (cdiv(max_rows, BLOCK_M) * n_tiles, n_slices, S), n_tiles = cdiv(max N_i,
# BLOCK_N).
@triton.jit
def _lora_expand_kernel(
    part_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y0_ptr,
    y1_ptr,
    y2_ptr,
    stride_y0,
    stride_y1,
    stride_y2,
    sorted_ids_ptr,
    slot_start_ptr,
    T,
    R,
    n_slices,
    n0,
    n1,
    n2,
    col0_,
    col1,
    col2,
    n_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STORE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    piece = tl.program_id(1)
    slot = tl.program_id(2)
    if not STORE:
        if slot == 0:
            return
    m_tile = pid // n_tiles
    n_tile = pid % n_tiles
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_start_ptr + slot + 1) - start
    b_ptr = b0_ptr
    y_ptr = y0_ptr
    stride_ym = stride_y0
    n = n0
    col0 = col0_
    if piece == 1:
        b_ptr = b1_ptr
        y_ptr = y1_ptr
        stride_ym = stride_y1
        n = n1
        col0 = col1
    elif piece == 2:
        b_ptr = b2_ptr
        y_ptr = y2_ptr
        stride_ym = stride_y2
        n = n2
        col0 = col2
    if m_tile * BLOCK_M >= count or n_tile * BLOCK_N >= n:
        return
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    if slot == 0:
        # Only with STORE: the base model's rows get a zero delta. They may outnumber max_rows, so the
        # slot's programs stride over its row tiles.
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        step = (tl.num_programs(0) // n_tiles) * BLOCK_M
        for first in range(m_tile * BLOCK_M, count, step):
            offs_m = first + tl.arange(0, BLOCK_M)
            m_mask = offs_m < count
            rows = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
            y_ptrs = y_ptr + rows[:, None] * stride_ym + (col0 + offs_n)[None, :]
            tl.store(y_ptrs, zeros, mask=m_mask[:, None] & n_mask[None, :])
    else:
        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        mid = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            src = part_ptr + (s * n_slices + piece).to(tl.int64) * T * R
            mid += tl.load(
                src + rows[:, None] * R + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0
            )
        bt = tl.load(  # B^T tile [BLOCK_R, BLOCK_N]
            b_ptr + slot.to(tl.int64) * n * R + offs_n[None, :] * R + offs_r[:, None],
            mask=n_mask[None, :] & r_mask[:, None],
            other=0.0,
        )
        delta = tl.dot(mid.to(bt.dtype), bt, input_precision=PRECISION)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + (col0 + offs_n)[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if STORE:
            tl.store(y_ptrs, delta, mask=mask)
        else:
            y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, (y + delta).to(y0_ptr.dtype.element_ty), mask=mask)


def lora_add(
    y: torch.Tensor | Sequence[torch.Tensor],  # [T, N_out] (or one per slice), unit column stride: in place
    x: torch.Tensor,  # shape [T, K], unit column stride
    a_stacks: Sequence[torch.Tensor],  # 1-3 tensors, shape [S, R, K] contiguous, x's dtype
    b_stacks: Sequence[torch.Tensor],  # one per A, shape [S, N_i, R] contiguous
    columns: Sequence[int],  # first column of its output each slice adds into
    sorted_ids: torch.Tensor,  # shape [T] int32 (lora_layout)
    slot_start: torch.Tensor,  # shape [S + 1] int32 (lora_layout)
    scales: torch.Tensor,  # shape [S] fp32
    max_rows: int,  # the most rows one slot may hold (the grid's bound)
    config: LoRAConfig | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """y_i[:, col_i : col_i + N_i] += scale_s * (x A_i,s^T) B_i,s^T for each token of an adapter slot s != 0
    (slot 0's rows are not touched), where y_i is `y` itself, or `y[i]` when a sequence gives each slice its
    own output (of one dtype); returns `y`. Two launches (shrink, expand) whatever the mix."""
    outs = [y] * len(a_stacks) if isinstance(y, torch.Tensor) else list(y)
    _shrink_expand(
        outs, x, a_stacks, b_stacks, columns, sorted_ids, slot_start, scales, max_rows, config, False
    )
    return y


def lora_delta_split(
    x: torch.Tensor,  # shape [T, K], unit column stride
    a_stacks: Sequence[torch.Tensor],  # 1-3 tensors, shape [S, R, K] contiguous, x's dtype
    b_stacks: Sequence[torch.Tensor],  # one per A, shape [S, N_i, R] contiguous
    sorted_ids: torch.Tensor,  # shape [T] int32 (lora_layout; every row in a slot)
    slot_start: torch.Tensor,  # shape [S + 1] int32 (lora_layout)
    scales: torch.Tensor,  # shape [S] fp32
    max_rows: int,  # the most rows one adapter slot may hold (the grid's bound)
    out: torch.Tensor | None = None,  # shape [T, sum N_i] fp32, unit column stride
    config: LoRAConfig | None = None,
) -> torch.Tensor:
    """The fp32 delta [T, sum N_i] of `lora_delta_fused` (slices side by side, zeros on the base's rows)
    by the shrink and the expand: two launches whatever the mix."""
    t, ns = x.shape[0], [int(b.shape[1]) for b in b_stacks]
    if out is None:
        out = torch.empty((t, sum(ns)), dtype=torch.float32, device=x.device)
    assert out.shape == (t, sum(ns)) and out.dtype == torch.float32, f"delta must be fp32 [{t}, {sum(ns)}]"
    columns = [sum(ns[:i]) for i in range(len(ns))]
    _shrink_expand(
        [out] * len(ns),
        x,
        a_stacks,
        b_stacks,
        columns,
        sorted_ids,
        slot_start,
        scales,
        max_rows,
        config,
        True,
    )
    return out


def _shrink_expand(
    outs, x, a_stacks, b_stacks, columns, sorted_ids, slot_start, scales, max_rows, config, store
):
    # The launches of lora_add (store False: y_i += delta_i) and lora_delta_split (store True: y = delta).
    n_slices = len(a_stacks)
    assert 1 <= n_slices <= 3 and len(b_stacks) == n_slices == len(columns) == len(outs), (
        "1-3 slices, an A, B, column and output each"
    )
    assert x.dim() == 2 and x.stride(1) == 1, "x [T, K], unit column stride"
    t, k = x.shape
    s, r, _ = a_stacks[0].shape
    assert sorted_ids.shape == (t,), "one sorted id per token"
    assert slot_start.shape == (s + 1,) and scales.shape == (s,), "slot_start [S + 1], scales [S]"
    ns = []
    for a, b, col, y in zip(a_stacks, b_stacks, columns, outs, strict=True):
        assert a.shape == (s, r, k) and a.is_contiguous() and a.dtype == x.dtype, f"A {tuple(a.shape)}"
        assert b.dim() == 3 and b.shape[0] == s and b.shape[2] == r and b.is_contiguous(), (
            f"B {tuple(b.shape)}"
        )
        assert y.dim() == 2 and y.shape[0] == t and y.stride(1) == 1, "an output [T, N], unit column stride"
        assert y.dtype == outs[0].dtype, "the slices' outputs share one dtype"
        assert 0 <= col and col + b.shape[1] <= y.shape[1], "a slice's columns must lie inside its output"
        ns.append(int(b.shape[1]))
    if t == 0 or (max_rows == 0 and not store):
        return
    max_rows = max(1, int(max_rows))  # storing: one row tile at least, for the base's zeros
    cfg = config or lora_config(max_rows, r, k, current_num_sms(), x.element_size())
    assert min(cfg.block_m, cfg.block_r, cfg.block_k, cfg.block_n) >= 16, f"tl.dot needs 16 a side: {cfg}"
    m_tiles = _cdiv(max_rows, cfg.block_m)
    k_per_split = _cdiv(_cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    split = _cdiv(k, k_per_split)  # no empty range
    part = torch.empty((split, n_slices, t, r), dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pad = 3 - n_slices  # unused slices alias the first (Triton specializes Python ints only)
    a = list(a_stacks) + [a_stacks[0]] * pad
    b = list(b_stacks) + [b_stacks[0]] * pad
    y = list(outs) + [outs[0]] * pad
    n = ns + [0] * pad
    col = [int(c) for c in columns] + [0] * pad
    _lora_shrink_kernel[(m_tiles * split, n_slices, s)](
        x, x.stride(0), a[0], a[1], a[2], part, sorted_ids, slot_start, scales, t, k, r, n_slices,
        k_per_split, BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, SPLIT_K=split,
        PRECISION=precision, num_warps=cfg.num_warps,
    )  # fmt: skip
    n_tiles = _cdiv(max(ns), cfg.block_n)
    _lora_expand_kernel[(m_tiles * n_tiles, n_slices, s)](
        part, b[0], b[1], b[2], y[0], y[1], y[2], y[0].stride(0), y[1].stride(0), y[2].stride(0),
        sorted_ids, slot_start, t, r, n_slices, n[0], n[1], n[2], col[0], col[1], col[2], n_tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r, SPLIT_K=split, STORE=store,
        PRECISION=precision, num_warps=cfg.num_warps,
    )  # fmt: skip


def lora_add_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacks: Sequence[torch.Tensor],
    b_stacks: Sequence[torch.Tensor],
    columns: Sequence[int],
    token_slots: torch.Tensor,  # shape [T] int64, each token's slot (0: the base)
    scales: torch.Tensor,
) -> torch.Tensor:
    """The same op in plain torch, slot by slot, fp32 math, cast once to y's dtype; returns a new tensor.
    As in the kernels (and peft, whose lora_A output is in the weights' dtype), the scaled shrink is rounded
    to the adapter's dtype before the expand."""
    out = y.float().clone()
    xf = x.float()
    for slot in torch.unique(token_slots).tolist():
        if slot == 0:
            continue
        rows = (token_slots == slot).nonzero().flatten()
        scale = scales[slot].float()
        for a, b, col in zip(a_stacks, b_stacks, columns, strict=True):
            shrink = ((xf[rows] @ a[slot].float().t()) * scale).to(b.dtype).float()
            delta = shrink @ b[slot].float().t()
            out[rows, col : col + b.shape[1]] += delta
    return out.to(y.dtype)
