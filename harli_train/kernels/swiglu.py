"""SwiGLU: y = silu(gate) * up. The backward recomputes silu from the saved gate (no silu(gate) is kept)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harli_train.kernels.common import check_dtype, new_output
from harli_train.kernels.launch_config import get_config, launch_gate, num_sms, with_forward_budget


# G, U: [rows, N] row strides stride_g / stride_u, column stride 1; Y: [rows, N] contiguous.
# Grid (rows, cdiv(N, BLOCK_N)): elementwise, so the hardware scheduler spreads it over whatever SMs we own.
@triton.jit
def _swiglu_fwd_kernel(G, stride_g, U, stride_u, Y, n_cols, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


# DY: [rows, N] row stride stride_dy; G, U as in the forward; DG, DU: [rows, N] contiguous; with STORE_Y,
# Y [rows, N] contiguous gets the forward's output, computed as the forward computes it.
@triton.jit
def _swiglu_bwd_kernel(
    DY, stride_dy, G, stride_g, U, stride_u, DG, DU, Y, n_cols, BLOCK_N: tl.constexpr, STORE_Y: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + row * n_cols + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * n_cols + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    if STORE_Y:
        tl.store(Y + row * n_cols + cols, (silu * u).to(Y.dtype.element_ty), mask=mask)


def _grid(rows: int, cols: int, dtype: torch.dtype) -> tuple[tuple[int, int], dict]:
    cfg = get_config("swiglu", (rows, cols), num_sms(), dtype)
    return (rows, triton.cdiv(cols, cfg["BLOCK_N"])), cfg


def swiglu_fwd(
    gate: torch.Tensor,  # shape [rows, N], column stride 1
    up: torch.Tensor,  # shape [rows, N], column stride 1
) -> torch.Tensor:
    """Returns silu(gate) * up, [rows, N] contiguous in the promoted dtype."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1
    check_dtype("swiglu gate", gate)
    check_dtype("swiglu up", up)
    rows, cols = gate.shape
    y = new_output((rows, cols), torch.promote_types(gate.dtype, up.dtype), gate.device)
    if y.numel():
        grid, cfg = _grid(rows, cols, gate.dtype)
        launch_gate()
        _swiglu_fwd_kernel[grid](
            gate,
            gate.stride(0),
            up,
            up.stride(0),
            y,
            cols,
            BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"],
        )
    return y


def swiglu_bwd(
    dy: torch.Tensor,  # shape [rows, N], column stride 1
    gate: torch.Tensor,  # shape [rows, N]
    up: torch.Tensor,  # shape [rows, N]
    with_output: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Returns (d gate, d up), contiguous, in gate's and up's dtypes; ``with_output``: (d gate, d up, y), y
    the forward's output (``swiglu_fwd(gate, up)``, bit for bit) from the same pass over gate and up."""
    assert dy.shape == gate.shape and dy.stride(1) == 1
    rows, cols = gate.shape
    dg = new_output((rows, cols), gate.dtype, gate.device)
    du = new_output((rows, cols), up.dtype, up.device)
    y = (
        new_output((rows, cols), torch.promote_types(gate.dtype, up.dtype), gate.device)
        if with_output
        else dg
    )
    if dg.numel():
        grid, cfg = _grid(rows, cols, gate.dtype)
        launch_gate()
        _swiglu_bwd_kernel[grid](
            dy,
            dy.stride(0),
            gate,
            gate.stride(0),
            up,
            up.stride(0),
            dg,
            du,
            y,
            cols,
            BLOCK_N=cfg["BLOCK_N"],
            STORE_Y=with_output,
            num_warps=cfg["num_warps"],
        )
    return (dg, du, y) if with_output else (dg, du)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


class SwiGLUFunction(torch.autograd.Function):
    """y = silu(g) u;  dg = dy u silu'(g),  du = dy silu(g)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = _rows(gate), _rows(up)
        ctx.save_for_backward(g, u)
        ctx.num_sms = num_sms()
        return swiglu_fwd(g, u).view(gate.shape)

    @staticmethod
    @with_forward_budget
    def backward(ctx, dy: torch.Tensor):
        g, u = ctx.saved_tensors
        dg, du = swiglu_bwd(_rows(dy), g, u)
        return dg.view(dy.shape), du.view(dy.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton silu(gate) * up for gate, up [..., N] of one shape."""
    return SwiGLUFunction.apply(gate, up)
