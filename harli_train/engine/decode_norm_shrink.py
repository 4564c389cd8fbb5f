"""The norms of an adapter step's decode forward that carry LoRA work (the kernel is
`decode_reduce_kernels._rms_norm_shrink_kernel`).

`rms_norm_shrink` norms a projection's input and computes, in the same launch, the shrink of the LoRA of
the projection that reads the normed rows, so that projection's GEMV adds the expand in its own epilogue.
`norm_launch` is the one launcher behind it and behind `decode_linear_add_rms_norm` with a LoRA: there the
norm also takes the projection's fp32 split sums and adds each row's expand of that projection's LoRA
before the residual add (`SplitSums`), so the projection, its adapter, the add, the norm and the next
projection's shrink take two launches.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from harli_train.engine.decode_reduce_kernels import _rms_norm_shrink_kernel
from harli_train.engine.lora_ops import _cdiv, _pow2
from harli_train.kernels.launch_config import num_sms as current_num_sms

if TYPE_CHECKING:
    from harli_train.engine.decode_linear import GemvLoRA


class SplitSums(NamedTuple):
    """A projection's GEMV workspace with its LoRA in the launch: fp32 [split, M, >= col0 + S * R] (row stride
    `stride`), the sums of columns [0, N) then the unscaled shrink of slice 0 in columns col0 + (slot, r);
    `lora` the projection's LoRA (its `bt` [S, R, N] and `scales`); `p_like` a tensor of the projection's
    output dtype, such as its input (the sum plus the expand is rounded to it before the residual add)."""

    part: torch.Tensor
    stride: int
    split: int
    col0: int
    lora: GemvLoRA
    p_like: torch.Tensor


def rms_norm_shrink(
    x: torch.Tensor,  # shape [M, K], unit column stride
    residual: torch.Tensor | None,  # shape [M, K], unit column stride, or None
    weight: torch.Tensor,  # shape [K]
    eps: float,
    lora: GemvLoRA,  # the LoRA of the projection that takes the normed rows as its input
    num_sms: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, GemvLoRA]:
    """(y, h, `lora` with `shrunk`): y and h as `kernels.add_rms_norm(x, residual, weight, eps)` gives them
    (`kernels.rms_norm(x, weight, eps)` and x itself without a residual), and the shrink of y for the
    projection that reads it, scale_s * (y A_s^T) rounded to the adapters' dtype in each row's slot s, so
    that its GEMV adds the expand in its own epilogue. One launch: the norm's, whose programs each also
    compute a few ranks of one slice of the shrink (enough programs a row to spread A's read over the
    SMs); base rows get zeros."""
    m, k = x.shape
    assert x.stride(1) == 1 and weight.shape == (k,), f"x [{m}, {k}] with unit column stride, weight [{k}]"
    if residual is not None:
        assert residual.shape == (m, k) and residual.stride(1) == 1, "residual [M, K], unit column stride"
        h = torch.empty((m, k), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    else:
        h = x
    y = torch.empty((m, k), dtype=torch.promote_types(h.dtype, weight.dtype), device=x.device)
    return y, h, norm_launch(x, x.stride(0), residual, weight, eps, h, y, lora, num_sms)


def norm_launch(
    src: torch.Tensor,  # [M, N] rows (row stride `stride`), or SplitSums' workspace
    stride: int,
    residual: torch.Tensor | None,  # [M, N], unit column stride (required with `sums`)
    weight: torch.Tensor,  # [N]
    eps: float,
    h: torch.Tensor,  # out [M, N]: src (+ expand) + residual; src itself without a residual
    y: torch.Tensor,  # out [M, N]: the norm of h
    ahead: GemvLoRA | None,  # the next projection's LoRA, whose shrink of y this launch computes
    num_sms: int | None = None,
    sums: SplitSums | None = None,  # src is a projection's split sums with its own LoRA
) -> GemvLoRA | None:
    """Write h and y of the rows of `src` (with `sums`: each row's sum over the splits plus its expand,
    rounded to the projection's dtype) and return `ahead` with its `shrunk` [M, n_a] (None without
    `ahead`). One launch, grid (M, programs a row): each of a row's programs norms the whole row and
    computes a [block_a, N] tile of the shrink."""
    m, n = h.shape
    lead = ahead if ahead is not None else sums.lora if sums is not None else None
    assert lead is not None, "norm_launch norms for a shrink ahead or a projection's expand"
    s_slots, rank = lead.num_slots, lead.rank
    shrunk, slices, block_a, r_tiles = None, 1, 1, 1
    if ahead is not None:
        n_a = ahead.a.shape[0]
        assert ahead.a.shape[1] == n and n_a % (s_slots * rank) == 0 and ahead.a.is_contiguous(), (
            "LoRA A stack"
        )
        slices = n_a // (s_slots * rank)
        shrunk = torch.empty((m, n_a), dtype=ahead.a.dtype, device=h.device)
        # A program loads its [block_a, N] tile of A at once beside the row: 2-4 ranks, about one program
        # per SM over the step (a row's programs re-read it from L2, which costs less than a longer A
        # stream). With `sums` each program also reads its row's whole B^T tile: 4 ranks, fewer programs.
        block_a = min(_pow2(rank), 4)
        if sums is None:
            rows_a = slices * _pow2(rank)
            per_row = _cdiv(num_sms or current_num_sms(), m)
            block_a = min(block_a, max(2, 1 << max(0, (rows_a // per_row).bit_length() - 1)))
        r_tiles = _cdiv(rank, block_a)
    if sums is not None:
        lo = sums.lora
        assert residual is not None, "the split sums' norm takes a residual"
        assert (lo.num_slots, lo.rank) == (s_slots, rank), "both LoRAs come from one step's slots"
        assert lo.bt.shape == (s_slots, rank, n) and lo.bt.is_contiguous(), f"LoRA B^T {tuple(lo.bt.shape)}"
    if m == 0:
        return replace(ahead, shrunk=shrunk) if ahead is not None else None
    block_h = _pow2(n)
    p_like = sums.p_like if sums is not None else src
    dummy = lead.scales
    _rms_norm_shrink_kernel[(m, slices * r_tiles)](
        src, stride, residual if residual is not None else src,
        residual.stride(0) if residual is not None else 0, h, h.stride(0), weight, y, y.stride(0),
        ahead.a if ahead is not None else dummy, ahead.scales if ahead is not None else dummy,
        lead.sorted_ids, lead.slot_start, shrunk if shrunk is not None else dummy,
        shrunk.stride(0) if shrunk is not None else 0, n, eps, rank, s_slots, r_tiles,
        m, sums.lora.bt if sums is not None else dummy, sums.lora.scales if sums is not None else dummy,
        sums.col0 if sums is not None else 0, p_like,
        HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, BLOCK_A=block_a, BLOCK_S=_pow2(s_slots),
        HAS_SHRINK=ahead is not None, FROM_PARTIAL=sums is not None,
        SPLIT_K=sums.split if sums is not None else 1, BLOCK_R=max(16, _pow2(rank)),
        # With the expand a thread holds 16 ranks of its columns of B^T: more threads a row.
        num_warps=max(4, min(16, block_h // (256 if sums is not None else 512))),
    )  # fmt: skip
    return replace(ahead, shrunk=shrunk) if ahead is not None else None
