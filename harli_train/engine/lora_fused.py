"""The batched LoRA delta of one projection in one launch: delta[t] = scale_s * (x[t] A_s^T) B_s^T, fp32.

The decode forward computes a projection's adapter delta before the projection and hands it to the GEMV
as an addend, so the projection keeps its fused epilogue (SwiGLU, residual add + norm). Tokens are grouped
by slot as in `lora_ops` (`sorted_ids`, `slot_start`; slot 0 is the base). Each program owns (slot, a row
tile of that slot's tokens, a span of one slice's columns): it computes its rows' part = scale_s * x A_s^T
over the whole K itself (A_s is R x K: every span re-reads it, and its rows of x, from L2), then writes
part @ B_s^T over its span in BLOCK_N-column tiles. Programs of slot 0 write zeros (striding over the
base's row tiles), so every row of the delta is written and it needs no memset: every row of the step must
belong to a slot (slot_start[S] = T). Up to three slices share x (q/k/v, gate/up), side by side in the
delta's columns. The grid is sized by `max_rows` (the most rows one adapter slot may hold), not by the
step's content, and the buffers are read by address, so a CUDA graph replays for any mix of adapters. Block
sizes come from `lora_fused_config` (no autotune).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from harli_train.engine.lora_ops import _cdiv, _pow2
from harli_train.kernels.launch_config import num_sms as current_num_sms


@dataclass(frozen=True, slots=True)
class LoRAFusedConfig:
    """Block sizes of one fused launch: a program covers block_m rows and n_sub * block_n columns."""

    block_m: int
    block_r: int
    block_k: int
    block_n: int
    n_sub: int
    num_warps: int
    num_stages: int


@functools.cache
def lora_fused_config(
    max_rows: int, rank: int, k: int, ns: tuple[int, ...], num_sms: int, elem_bytes: int = 2
) -> LoRAFusedConfig:
    """The config for up to `max_rows` rows a slot, rank <= `rank`, x of `k` columns, slices of `ns` columns.

    Rows and rank are padded to 16 (tl.dot's minimum). Row tiles stay at 16: a program's cost is its
    stream of (rows + R) x K from L2, so small row tiles keep it short and spread it over more SMs. A
    program covers n_sub column tiles, n_sub the smallest power of two that keeps the programs of a full
    step within half the SMs: past that, more spans only add re-reads of x and A."""
    block_m = 16
    block_r = max(16, _pow2(rank))
    block_k = min(512 // elem_bytes, max(16, _pow2(k)))  # 256 columns in 16-bit types, 128 in fp32
    block_n = min(256 // elem_bytes, max(16, _pow2(max(ns))))
    row_tiles = _cdiv(max_rows, block_m)
    target = max(1, num_sms // 2)
    n_sub = 1
    while n_sub * block_n < max(ns) and row_tiles * sum(_cdiv(n, n_sub * block_n) for n in ns) > target:
        n_sub *= 2
    return LoRAFusedConfig(block_m, block_r, block_k, block_n, n_sub, 4, 3)


# x: [T, K] (row stride stride_xm, unit column stride); a0..a2: A stacks [S, R, K] contiguous; b0..b2: B
# stacks [S, N_i, R] contiguous (unused slices alias slice 0); sorted_ids: [T] int32; slot_start: [S + 1]
# int32; scales: [S] fp32. delta: [T, *] fp32 (row stride stride_dm, unit column stride), slice i writing
# columns [col_i, col_i + N_i). Grid (cdiv(max_rows, BLOCK_M) * n_spans, n_slices, S), where a span is
# N_SUB * BLOCK_N columns and n_spans = cdiv(max N_i, span).
@triton.jit
def _lora_fused_kernel(
    x_ptr,
    stride_xm,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    delta_ptr,
    stride_dm,
    sorted_ids_ptr,
    slot_start_ptr,
    scales_ptr,
    K,
    R,
    n0,
    n1,
    n2,
    col1,
    col2,
    n_spans,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_SUB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    piece = tl.program_id(1)
    slot = tl.program_id(2)
    m_tile = pid // n_spans
    span = pid % n_spans
    start = tl.load(slot_start_ptr + slot)
    count = tl.load(slot_start_ptr + slot + 1) - start
    a_ptr = a0_ptr
    b_ptr = b0_ptr
    n = n0
    col0 = 0
    if piece == 1:
        a_ptr = a1_ptr
        b_ptr = b1_ptr
        n = n1
        col0 = col1
    elif piece == 2:
        a_ptr = a2_ptr
        b_ptr = b2_ptr
        n = n2
        col0 = col2
    n_first = span * (N_SUB * BLOCK_N)
    if m_tile * BLOCK_M >= count or n_first >= n:
        return
    offs_n = tl.arange(0, BLOCK_N)
    if slot == 0:
        # The base model's rows get a zero delta. They may outnumber max_rows (a step's base rows are not
        # bounded by it): the slot's programs stride over its row tiles.
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        step = (tl.num_programs(0) // n_spans) * BLOCK_M
        for first in range(m_tile * BLOCK_M, count, step):
            offs_m = first + tl.arange(0, BLOCK_M)
            m_mask = offs_m < count
            rows = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
            out_rows = delta_ptr + rows[:, None] * stride_dm + col0
            for j in range(N_SUB):
                cols = n_first + j * BLOCK_N + offs_n
                tl.store(out_rows + cols[None, :], zeros, mask=m_mask[:, None] & (cols < n)[None, :])
    else:
        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        out_rows = delta_ptr + rows[:, None] * stride_dm + col0
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rows[:, None] * stride_xm
        a_base = a_ptr + slot.to(tl.int64) * R * K
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = k0 + offs_k < K
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(  # A^T tile [BLOCK_K, BLOCK_R]
                a_base + offs_r[None, :] * K + (k0 + offs_k)[:, None],
                mask=r_mask[None, :] & k_mask[:, None],
                other=0.0,
            )
            acc = tl.dot(x, at.to(x.dtype), acc, input_precision=PRECISION)
        b_base = b_ptr + slot.to(tl.int64) * n * R
        mid = (acc * tl.load(scales_ptr + slot)).to(b_ptr.dtype.element_ty)
        for j in range(N_SUB):
            cols = n_first + j * BLOCK_N + offs_n
            n_mask = cols < n
            bt = tl.load(  # B^T tile [BLOCK_R, BLOCK_N]
                b_base + cols[None, :] * R + offs_r[:, None],
                mask=n_mask[None, :] & r_mask[:, None],
                other=0.0,
            )
            delta = tl.dot(mid, bt, input_precision=PRECISION)
            tl.store(out_rows + cols[None, :], delta, mask=m_mask[:, None] & n_mask[None, :])


def lora_delta_fused(
    x: torch.Tensor,  # shape [T, K], unit column stride
    a_stacks: Sequence[torch.Tensor],  # 1-3 tensors, shape [S, R, K] contiguous, x's dtype
    b_stacks: Sequence[torch.Tensor],  # one per A, shape [S, N_i, R] contiguous, x's dtype
    sorted_ids: torch.Tensor,  # shape [T] int32 (lora_layout; every row in a slot)
    slot_start: torch.Tensor,  # shape [S + 1] int32 (lora_layout)
    scales: torch.Tensor,  # shape [S] fp32
    max_rows: int,  # the most rows one adapter slot may hold (the grid's bound)
    out: torch.Tensor | None = None,  # shape [T, sum N_i] fp32, unit column stride
    config: LoRAFusedConfig | None = None,
) -> torch.Tensor:
    """The fp32 delta [T, sum N_i] whose slice i (columns from sum_{j<i} N_j) holds scale_s * (x A_i,s^T)
    B_i,s^T for each token of an adapter slot s, and zeros on the base's rows; one launch whatever the mix."""
    n_slices = len(a_stacks)
    assert 1 <= n_slices <= 3 and len(b_stacks) == n_slices, "1-3 slices, an A and a B each"
    assert x.dim() == 2 and x.stride(1) == 1, "x [T, K], unit column stride"
    t, k = x.shape
    s, r, _ = a_stacks[0].shape
    assert sorted_ids.shape == (t,) and slot_start.shape == (s + 1,) and scales.shape == (s,)
    for a, b in zip(a_stacks, b_stacks, strict=True):
        assert a.shape == (s, r, k) and a.is_contiguous() and a.dtype == x.dtype, f"A {tuple(a.shape)}"
        assert b.dim() == 3 and b.shape[::2] == (s, r) and b.is_contiguous() and b.dtype == x.dtype, (
            f"B {tuple(b.shape)}"
        )
    ns = [int(b.shape[1]) for b in b_stacks]
    if out is None:
        out = torch.empty((t, sum(ns)), dtype=torch.float32, device=x.device)
    assert out.shape == (t, sum(ns)) and out.stride(1) == 1 and out.dtype == torch.float32, "delta [T, N]"
    if t == 0:
        return out
    max_rows = max(1, int(max_rows))  # one row tile at least: the base's programs write its zeros
    cfg = config or lora_fused_config(max_rows, r, k, tuple(ns), current_num_sms(), x.element_size())
    # tl.dot needs 16 on every side: the interpreter would take less, the GPU compiler does not.
    assert min(cfg.block_m, cfg.block_r, cfg.block_k, cfg.block_n) >= 16 and cfg.block_r >= r, cfg
    n_spans = _cdiv(max(ns), cfg.block_n * cfg.n_sub)
    a = list(a_stacks) + [a_stacks[0]] * (3 - n_slices)
    b = list(b_stacks) + [b_stacks[0]] * (3 - n_slices)
    n = ns + [0] * (3 - n_slices)
    col = [0, n[0], n[0] + n[1]]  # Python ints: Triton on a GPU refuses numpy ones
    _lora_fused_kernel[(_cdiv(max_rows, cfg.block_m) * n_spans, n_slices, s)](
        x, x.stride(0), a[0], a[1], a[2], b[0], b[1], b[2], out, out.stride(0), sorted_ids, slot_start,
        scales, k, r, n[0], n[1], n[2], col[1], col[2], n_spans,
        BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n, N_SUB=cfg.n_sub,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
