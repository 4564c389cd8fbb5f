"""Decode projections: y[M, N] = x[M, K] @ W[N, K]^T for a few rows of x, at the weights' read bandwidth.

A decode step reads every weight once for M = batch (1..64) rows, so it is a stream over W. Each program
streams BLOCK_N consecutive rows of a row-major W (the model's own tensor, no transposed copy) over its K
range. Two formulations:
  * FMA (M == 1 on most of the GPU): a [BLOCK_N, BLOCK_K] fp32 partial-product tile accumulated in
    registers, reduced over K once.
  * dot (M >= 2, or a partition's few SMs): "swap AB": acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T, so the
    weight rows fill the MMA's M side and the batch (padded to 16/32/64) its N side.
One launch covers up to three weights that share x (q/k/v, gate/up): program ids map to row tiles of weight
0, then 1, then 2, and each weight's rows land in their column range of one output. With `swiglu`, a program
reads the same rows of gate (weight 0) and up (weight 1) and writes silu(g) * u. When the row tiles alone
cannot fill the SMs, K is split: fp32 partials go to a workspace and a second kernel sums them in a fixed
order (deterministic) and applies the cast (and the SwiGLU). An fp32 `addend` (the step's LoRA delta) joins
the sums before that epilogue, so adapters keep the SwiGLU and add-norm fusions. The kernels are in
`decode_linear_kernels` (the GEMV) and `decode_reduce_kernels` (what follows it).

Configs are fixed per (M bucket, N's, K, SMs) by `decode_linear_config` (no autotune: CUDA graphs capture
one kernel per bucket).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from harli_train import kernels
from harli_train.engine.decode_linear_kernels import _decode_linear_kernel
from harli_train.engine.decode_norm_shrink import SplitSums, norm_launch
from harli_train.engine.decode_reduce_kernels import (
    _split_reduce_add_rms_norm_kernel,
    _split_reduce_kernel,
    _split_reduce_lora_kernel,
)
from harli_train.engine.lora_ops import _cdiv, _pow2
from harli_train.kernels.launch_config import num_sms as current_num_sms

SMEM_PER_SM = 228 * 1024
# M == 1 streams with FMAs only on at least this many SMs. Its programs keep fewer bytes in flight than the
# tensor-core tiles, which is enough when the whole GPU's SMs share HBM's bandwidth but not when a partition's
# few SMs must each draw more of it (docs/design.md, "Measured facts behind the defaults").
FMA_MIN_SMS = 96
# Up to this many rows a projection with its LoRA in its launches, followed by the residual add and norm
# (o, down), adds each row's expand in the norm's launch (`norm_launch` with its split sums): one launch
# less than the expand in the split-sum kernel's column tiles, at the cost of each norm program reading its
# row's B^T. 0: never.
EXPAND_IN_NORM_ROWS = 64


@dataclass(frozen=True, slots=True)
class DecodeLinearConfig:
    """Block sizes and grid of one decode projection launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    use_dot: bool


@dataclass(frozen=True, slots=True)
class GemvLoRA:
    """A projection's batched LoRA, run by its own launches (`lora_kernel` "gemv"): the shrink as extra row
    tiles of the GEMV, the expand in the split-sum kernel's epilogue (or, before a residual add and norm, in
    the norm's launch: `decode_norm_shrink.norm_launch`). With `shrunk` (made by the norm that
    made the projection's input, `rms_norm_shrink`) the GEMV computes no shrink: without split-K it adds the
    expand in its own epilogue and writes its output directly (no launch more than the base projection),
    with split-K the split-sum kernel reads the shrink from `shrunk`.

    `a` [n_slices * S * R, K] contiguous: the slices' A stacks (slot 0 the base, unused), rows (slice, slot,
    r); `bt` [S, R, W] contiguous: B transposed, the slices' columns side by side as in the projection's
    output (gate then up with SwiGLU); `scales` [S] fp32; `sorted_ids` [M] and `slot_start` [S + 1] int32
    (`lora_ops.lora_layout`, every row of the step in a slot); `shrunk` [M, n_slices * S * R] in `a`'s
    dtype, unit column stride: row m's scaled shrink in its slot's columns (slice, slot, r), zeros in the
    other adapter slots' columns."""

    a: torch.Tensor
    bt: torch.Tensor
    scales: torch.Tensor
    sorted_ids: torch.Tensor
    slot_start: torch.Tensor
    rank: int
    num_slots: int
    shrunk: torch.Tensor | None = None


@functools.cache
def decode_linear_config(
    m: int,
    ns: tuple[int, ...],
    k: int,
    num_sms: int,
    swiglu: bool = False,
    elem_bytes: int = 2,
    fma_min_sms: int = FMA_MIN_SMS,
) -> DecodeLinearConfig:
    """The launch config for x [m, k] against weights of `ns` rows (m: the graph's batch bucket).

    M == 1 on at least `fma_min_sms` SMs (FMA_MIN_SMS; other values are for measuring the rule) streams
    with FMAs (8 rows x 512 columns a program, ~4 programs resident per SM); larger M, or fewer SMs, uses
    the tensor cores with the weight rows on the MMA's M side (64 rows a program, M padded to 16). Stages
    are sized so two programs fit an SM's shared memory. K is split only when the row tiles fill less than
    one wave of resident programs, and then by the count that best fills whole waves.
    """
    if m == 1 and num_sms >= fma_min_sms:
        block_m, block_n, block_k, warps, stages, use_dot, per_sm = 1, 8, 512, 4, 2, False, 4
    else:
        # 64 weight rows a tile keep the x tile (re-read from L2 by every program) small beside W's.
        block_m, block_n = max(16, _pow2(m)), 64
        block_k = 128 * 2 // elem_bytes  # fp32 (tests): half the columns
        # The SwiGLU kernel's two loops run one after the other and reuse the same buffers.
        stage_bytes = (block_n + block_m) * block_k * elem_bytes
        stages = max(2, min(4, (SMEM_PER_SM // 2 - 8192) // stage_bytes))
        warps, use_dot, per_sm = 4, True, 2
    block_k = min(block_k, max(16, _pow2(k)))
    tiles = _cdiv(ns[0], block_n) if swiglu else sum(_cdiv(n, block_n) for n in ns)
    k_blocks = _cdiv(k, block_k)
    slots = num_sms * per_sm
    split = 1
    candidates = range(1, max(1, min(4, k_blocks // 4)) + 1)
    if tiles < slots and not use_dot:

        def fill(s: int) -> float:
            programs = tiles * s
            return programs / (_cdiv(programs, slots) * slots)

        best = max(fill(s) for s in candidates)
        split = min(s for s in candidates if fill(s) >= best - 0.05)
    elif tiles < slots:
        # Tensor-core tiles: bytes moved over the share of HBM bandwidth the programs draw. HBM saturates
        # once about `saturate` of the resident slots stream (more at M = 64: each program computes longer
        # per byte); every extra split writes and re-reads an fp32 [M, N] partial. Fitted on the H200
        # (bench_decode's GEMV sweep): qkv/o/down at M = 16 and 64.
        n_out = 2 * ns[0] if swiglu else sum(ns)
        weight_bytes = n_out * k * elem_bytes
        saturate = 0.35 if m <= 16 else 0.7

        def cost(s: int) -> float:
            programs = tiles * s
            if programs <= slots:
                share = min(1.0, programs / slots / saturate)
            else:
                share = programs / (_cdiv(programs, slots) * slots)
            return (weight_bytes + (8 * s * m * n_out if s > 1 else 0)) / share

        split = min((s for s in candidates if s & (s - 1) == 0), key=cost)  # 1, 2, 4: the measured ones
    split = _cdiv(k_blocks, _cdiv(k_blocks, split))  # no empty splits
    return DecodeLinearConfig(block_m, block_n, block_k, split, warps, stages, use_dot)


def decode_linear(
    x: torch.Tensor,  # shape [M, K], unit column stride
    weights: Sequence[torch.Tensor],  # 1-3 tensors, shape [N_g, K] contiguous, x's dtype
    swiglu: bool = False,
    out: torch.Tensor | None = None,  # shape [M, N_out], unit column stride
    num_sms: int | None = None,
    config: DecodeLinearConfig | None = None,
    addend: torch.Tensor | None = None,  # shape [M, sum N_g] fp32, unit column stride
    lora: GemvLoRA | None = None,
) -> torch.Tensor:
    """x @ concat(weights)^T (+ addend) -> [M, sum N_g]; with `swiglu` (weights = gate, up): silu(g) * u of
    g = x gate^T, u = x up^T -> [M, N], the addend's first N columns added to g and the next N to u. The
    addend joins the fp32 sums before the cast (in the GEMV's epilogue, or the split-K sum's): no launch
    more. `lora` (not with an addend) adds each row's adapter delta the same way, computed by the same two
    launches: the GEMV and, even without split-K, the split-sum kernel. `num_sms` defaults to the current
    SM budget; `config` overrides the chosen launch config."""
    return _decode_linear(x, weights, swiglu, out, num_sms, config, addend, lora=lora)


def decode_linear_add_rms_norm(
    x: torch.Tensor,  # shape [M, K], unit column stride
    weight: torch.Tensor,  # shape [N, K] contiguous, x's dtype
    residual: torch.Tensor,  # shape [M, N], unit column stride
    norm_weight: torch.Tensor,  # shape [N]
    eps: float,
    num_sms: int | None = None,
    config: DecodeLinearConfig | None = None,
    addend: torch.Tensor | None = None,  # shape [M, N] fp32, unit column stride
    lora: GemvLoRA | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.add_rms_norm(p, residual, norm_weight, eps)` -> (normed, p + residual) of the projection
    p = x @ weight^T (+ addend, or `lora`'s delta, in fp32 before p's cast). When K is split without `lora`
    the split-sum kernel does the add and the norm too: one launch less. With `lora`, up to
    EXPAND_IN_NORM_ROWS rows, the norm's launch sums the splits and adds each row's expand (a program a row,
    reading its slot's B^T); past them the split sum and the expand run over column tiles, then the add and
    norm as their own launch."""
    h, y = _add_norm_outputs(x, weight, residual, norm_weight)
    y, h, _ = _decode_linear(
        x, (weight,), False, None, num_sms, config, addend, (residual, norm_weight, eps, y, h, None), lora
    )
    return y, h


def decode_linear_add_rms_norm_shrink(
    x: torch.Tensor,  # shape [M, K], unit column stride
    weight: torch.Tensor,  # shape [N, K] contiguous, x's dtype
    residual: torch.Tensor,  # shape [M, N], unit column stride
    norm_weight: torch.Tensor,  # shape [N]
    eps: float,
    lora: GemvLoRA,  # the projection's own LoRA, without `shrunk`
    ahead: GemvLoRA,  # the LoRA of the projection that reads the normed rows
    num_sms: int | None = None,
    config: DecodeLinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, GemvLoRA]:
    """(y, h, `ahead` with `shrunk`): `decode_linear_add_rms_norm` with `lora`, whose norm also computes
    the shrink of y for the next projection as `rms_norm_shrink` does. Up to EXPAND_IN_NORM_ROWS rows
    in two launches (the GEMV with the shrink of `lora` in it, then one norm launch for the split sum,
    the expand, the add, the norm and the next shrink); past them the expand runs in the split-sum
    kernel and the norm after it."""
    assert lora.shrunk is None, "the projection computes its own shrink here"
    h, y = _add_norm_outputs(x, weight, residual, norm_weight)
    return _decode_linear(
        x, (weight,), False, None, num_sms, config, None, (residual, norm_weight, eps, y, h, ahead), lora
    )


def _add_norm_outputs(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y) for the residual add and norm after the projection x @ weight^T: h [M, N] in the residual's
    dtype, y in its promotion with the norm weight's."""
    m, n = x.shape[0], weight.shape[0]
    assert residual.shape == (m, n) and residual.stride(1) == 1 and norm_weight.shape == (n,)
    h = torch.empty((m, n), dtype=residual.dtype, device=x.device)
    y = torch.empty((m, n), dtype=torch.promote_types(residual.dtype, norm_weight.dtype), device=x.device)
    return h, y


def _k_split(k: int, cfg: DecodeLinearConfig) -> tuple[int, int]:
    """(columns of K a split covers, splits) of a launch with `cfg` over K = `k`: no split is empty."""
    k_per_split = _cdiv(_cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    return k_per_split, _cdiv(k, k_per_split)


def expands_in_epilogue(
    m: int, weights: Sequence[torch.Tensor], swiglu: bool = False, num_sms: int | None = None
) -> bool:
    """Whether the projection of `m` rows by `weights` runs its GEMV without split-K, so that a shrink made
    ahead by the norm (`rms_norm_shrink`) lets the GEMV add the expand in its own epilogue: the projection
    with LoRA then takes no launch more than without."""
    ns = tuple(w.shape[0] for w in weights)
    k = weights[0].shape[1]
    cfg = decode_linear_config(
        _pow2(m) if m > 1 else 1, ns, k, num_sms or current_num_sms(), swiglu, weights[0].element_size()
    )
    return _k_split(k, cfg)[1] == 1


def _decode_linear(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    swiglu: bool,
    out: torch.Tensor | None,
    num_sms: int | None,
    config: DecodeLinearConfig | None,
    addend: torch.Tensor | None,
    add_norm: tuple | None = None,  # (residual, norm weight, eps, y out, h out, the LoRA ahead or None)
    lora: GemvLoRA | None = None,
):
    assert 1 <= len(weights) <= 3 and x.dim() == 2 and x.stride(1) == 1, "x [M, K] and 1-3 weights"
    m, k = x.shape
    ns = tuple(w.shape[0] for w in weights)
    for w in weights:
        assert w.dim() == 2 and w.shape[1] == k and w.is_contiguous() and w.dtype == x.dtype, (
            f"weight {tuple(w.shape)} {w.dtype} must be contiguous [N, {k}] {x.dtype}"
        )
    if swiglu:
        assert len(weights) == 2 and ns[0] == ns[1], "swiglu takes gate and up of one shape"
    n_out = ns[0] if swiglu else sum(ns)
    if addend is not None:
        assert addend.shape == (m, sum(ns)) and addend.stride(1) == 1 and addend.dtype == torch.float32, (
            f"addend {tuple(addend.shape)} {addend.dtype} must be fp32 [{m}, {sum(ns)}], unit column stride"
        )
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n_out) and out.stride(1) == 1, f"out must be [{m}, {n_out}]"
    cfg = config or decode_linear_config(
        _pow2(m) if m > 1 else 1, ns, k, num_sms or current_num_sms(), swiglu, x.element_size()
    )
    assert cfg.block_m >= m, f"config block_m {cfg.block_m} < M {m}"
    if add_norm is not None:
        assert add_norm[5] is None or lora is not None, "a shrink ahead comes with the projection's LoRA"
    if m == 0 or n_out == 0:
        if add_norm is None:
            return out
        ahead = add_norm[5]
        if ahead is not None:
            ahead = replace(ahead, shrunk=ahead.a.new_empty(0, ahead.a.shape[0]))
        return add_norm[3], add_norm[4], ahead
    w = list(weights) + [weights[0]] * (3 - len(weights))
    tiles = [_cdiv(n, cfg.block_n) for n in ns] + [0, 0]
    grid_n = tiles[0] if swiglu else sum(tiles[:3])
    k_per_split, split = _k_split(k, cfg)
    even_n = all(n % cfg.block_n == 0 for n in ns)
    even_k = k % cfg.block_k == 0
    width = 2 * n_out if swiglu else n_out  # the fp32 sums' columns in the workspace
    pre = lora is not None and lora.shrunk is not None  # the shrink came with the input: none here
    partial = split > 1 or (lora is not None and not pre)
    n_a = 0
    if lora is not None:
        assert addend is None, "a LoRA delta comes as an addend or as `lora`, not both"
        n_a, slices = lora.a.shape[0], lora.a.shape[0] // (lora.num_slots * lora.rank)
        if pre:
            assert lora.shrunk.shape[0] >= m and lora.shrunk.shape[1] == n_a, (
                f"LoRA shrink {tuple(lora.shrunk.shape)} must be [{m}, {n_a}]"
            )
            assert lora.shrunk.stride(1) == 1 and lora.shrunk.dtype == lora.bt.dtype, "LoRA shrink layout"
            n_a = 0
        assert lora.a.shape == (slices * lora.num_slots * lora.rank, k) and lora.a.is_contiguous(), (
            f"LoRA A {tuple(lora.a.shape)} must be [slices x {lora.num_slots} x {lora.rank}, {k}]"
        )
        assert lora.bt.shape == (lora.num_slots, lora.rank, width) and lora.bt.is_contiguous(), (
            f"LoRA B^T {tuple(lora.bt.shape)} must be [{lora.num_slots}, {lora.rank}, {width}]"
        )
        assert lora.sorted_ids.shape[0] >= m and slices == (2 if swiglu else len(ns)), "LoRA slices"
    if partial:
        dest = torch.empty((split, m, width + n_a), dtype=torch.float32, device=x.device)
        stride = dest.stride(1)
    else:
        dest, stride = out, out.stride(0)
    # Without an addend (or LoRA) the kernels never read it: x stands in for the pointer.
    add, add_stride = (x, 0) if addend is None else (addend, addend.stride(0))
    la = lora or GemvLoRA(x, x, x, x, x, 1, 1)
    xa = la.shrunk if pre else x
    # The epilogue's expand takes every slot's ranks at once (32 stands in where it does not run).
    block_sr = max(32, _pow2(la.num_slots * la.rank)) if pre and not partial else 32
    n_padded = (ns + (0, 0))[:3]
    _decode_linear_kernel[(grid_n + _cdiv(n_a, cfg.block_n), split)](
        x, x.stride(0), w[0], w[1], w[2], dest, stride, add, add_stride, m, k,
        n_padded[0], n_padded[1], n_padded[2], tiles[0], tiles[0] + tiles[1], width, k_per_split,
        la.a, n_a, grid_n, la.slot_start, la.rank, la.num_slots, xa, xa.stride(0), la.bt,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, PARTIAL=partial,
        SWIGLU=swiglu, HAS_ADDEND=addend is not None, HAS_LORA=lora is not None and not pre,
        LORA_EPILOGUE=pre and not partial, BLOCK_SR=block_sr, USE_DOT=cfg.use_dot,
        EVEN_N=even_n, EVEN_K=even_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if add_norm is not None and lora is None:
        residual, norm_weight, eps, y, h, _ = add_norm
        if not partial:
            return (*kernels.add_rms_norm(out, residual, norm_weight, eps), None)
        block = _pow2(n_out)
        _split_reduce_add_rms_norm_kernel[(m,)](
            dest, stride, add, add_stride, residual, residual.stride(0), norm_weight, h, h.stride(0),
            y, y.stride(0), m, n_out, eps, SPLIT_K=split, HAS_ADDEND=addend is not None, BLOCK=block,
            num_warps=max(4, min(16, block // 512)),
        )  # fmt: skip
        return y, h, None
    if add_norm is not None and partial and not pre and m <= EXPAND_IN_NORM_ROWS:
        residual, norm_weight, eps, y, h, ahead = add_norm
        sums = SplitSums(dest, stride, split, width, la, x)
        return y, h, norm_launch(dest, stride, residual, norm_weight, eps, h, y, ahead, num_sms, sums)
    if lora is not None and partial:
        # BLOCK_M sorted rows by block_n columns a program, its accumulators (two with SwiGLU) within 4096.
        block_m = min(64, max(16, _pow2(m)))
        block_n = max(16, min(4096 // block_m, _pow2(n_out)))
        n0, n1 = (ns + (0, 0))[:2]
        _split_reduce_lora_kernel[(_cdiv(m, block_m), _cdiv(n_out, block_n))](
            dest, stride, out, out.stride(0), m, n_out, la.bt, la.scales, la.sorted_ids, la.slot_start, width,
            n0, n1, len(ns), la.rank, la.num_slots, xa, xa.stride(0), SPLIT_K=split, SWIGLU=swiglu,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, _pow2(la.rank)), BLOCK_S=_pow2(la.num_slots),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PRE_SHRUNK=pre, num_warps=4,
        )  # fmt: skip
    elif partial:
        block = min(1024, _pow2(n_out))
        _split_reduce_kernel[(m, _cdiv(n_out, block))](
            dest, stride, out, out.stride(0), add, add_stride, m, n_out,
            SPLIT_K=split, SWIGLU=swiglu, HAS_ADDEND=addend is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    if add_norm is not None:  # with `lora`: the expand ran over column tiles above, then the add and norm
        residual, norm_weight, eps, y, h, ahead = add_norm
        if ahead is None:
            return (*kernels.add_rms_norm(out, residual, norm_weight, eps), None)
        return y, h, norm_launch(out, out.stride(0), residual, norm_weight, eps, h, y, ahead, num_sms)
    return out


def decode_linear_reference(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    swiglu: bool = False,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same op in torch, fp32 math (the addend added to the fp32 sums), cast to x's dtype."""
    y = torch.cat([F.linear(x.float(), w.float()) for w in weights], dim=-1)
    if addend is not None:
        y = y + addend.float()
    if swiglu:
        n = weights[0].shape[0]
        y = F.silu(y[:, :n]) * y[:, n:]
    return y.to(x.dtype)


def with_config(cfg: DecodeLinearConfig, **changes) -> DecodeLinearConfig:
    """A copy of `cfg` with fields changed (for benchmarks comparing variants)."""
    return replace(cfg, **changes)
