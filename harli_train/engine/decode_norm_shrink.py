"""The norms of an adapter step's decode forward that carry LoRA work (the kernel is
`decode_reduce_kernels._rms_norm_shrink_kernel`).

`rms_norm_shrink` norms a projection's input and computes, in the same launch, the shrink of the LoRA of
the projection that reads the normed rows, so that projection's GEMV adds the expand in its own epilogue.
`norm_launch` is the one launcher behind it and behind `decode_linear_add_rms_norm` with a LoRA: there the
norm also takes the projection's fp32 split sums and adds each row's expand of that projection's LoRA
before the residual add (`SplitSums`), so the projection, its adapter, the add, the norm and the next
projection's shrink take two launches. Up to SPLIT_NORM_ROWS rows that norm splits each row's columns over
programs (`decode_split_norm_kernel`), so that no program reads a slot's whole B^T or A.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch

from harli_train.engine.decode_reduce_kernels import _rms_norm_shrink_kernel
from harli_train.engine.decode_split_norm_kernel import _split_norm_kernel
from harli_train.engine.lora_ops import _cdiv, _pow2
from harli_train.kernels.launch_config import num_sms as current_num_sms

if TYPE_CHECKING:
    from harli_train.engine.decode_linear import GemvLoRA

# Up to this many rows the norm after a projection with its LoRA in the launch splits each row over
# programs of SPLIT_NORM_COLUMNS columns (the last of a row's programs to arrive finishes the row); past
# them, one program a row's shrink tile reads the whole row and its slot's B^T. 0: never.
SPLIT_NORM_ROWS = 0
SPLIT_NORM_COLUMNS = 256
COUNTER_ROWS = 1024  # rows of the split norm's arrival counters, made once per device
_counters: dict[torch.device, torch.Tensor] = {}


def reserve_row_counters(device: torch.device) -> torch.Tensor:
    """The split norm's arrival counters on `device` (int32 [COUNTER_ROWS], zero between launches: each
    row's last program resets its own). One tensor per device for the process's life, since CUDA graphs
    keep its address: make it before any capture (`DecodeForward` does); launches that use it must not
    overlap on the device (an engine's steps never do)."""
    have = _counters.get(device)
    if have is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split norm's counters must be made before CUDA-graph capture")
        have = _counters[device] = torch.zeros(COUNTER_ROWS, dtype=torch.int32, device=device)
    return have


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
    if sums is not None and m <= SPLIT_NORM_ROWS:
        _split_norm(sums, residual, weight, eps, h, y, ahead, shrunk, slices, block_h)
        return replace(ahead, shrunk=shrunk) if ahead is not None else None
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


def _split_norm(
    sums: SplitSums,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    h: torch.Tensor,
    y: torch.Tensor,
    ahead: GemvLoRA | None,
    shrunk: torch.Tensor | None,
    slices: int,
    block_h: int,
) -> None:
    """`norm_launch`'s work with split sums, each row's columns split over programs (see
    `decode_split_norm_kernel`): h, y and (with `ahead`) `shrunk` written."""
    m, n = h.shape
    counters = reserve_row_counters(h.device)
    assert m <= counters.numel(), f"the split norm takes at most {counters.numel()} rows"
    block_c = min(SPLIT_NORM_COLUMNS, block_h)
    programs = _cdiv(n, block_c)
    lo = sums.lora
    block_sa = _pow2(slices * lo.rank) if ahead is not None else 1
    ss = torch.empty((m, programs), dtype=torch.float32, device=h.device)
    sh = (
        torch.empty((m, programs, block_sa), dtype=torch.float32, device=h.device)
        if ahead is not None
        else ss
    )
    dummy = lo.scales
    _split_norm_kernel[(m, programs)](
        sums.part, sums.stride, residual, residual.stride(0), h, h.stride(0), weight, y, y.stride(0),
        lo.bt, lo.scales, sums.col0, sums.p_like,
        ahead.a if ahead is not None else dummy, ahead.scales if ahead is not None else dummy,
        shrunk if shrunk is not None else dummy, shrunk.stride(0) if shrunk is not None else 0, slices,
        lo.sorted_ids, lo.slot_start, ss, sh, counters, m, n, eps, lo.rank, lo.num_slots,
        SPLIT_K=sums.split, BLOCK_C=block_c, BLOCK_H=block_h, BLOCK_R=max(16, _pow2(lo.rank)),
        BLOCK_S=_pow2(lo.num_slots), BLOCK_SA=block_sa, BLOCK_P=_pow2(programs), HAS_SHRINK=ahead is not None,
        num_warps=4 if block_sa <= 32 else 8,
    )  # fmt: skip
