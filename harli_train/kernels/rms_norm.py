"""RMSNorm with an optional fused residual add: y = w * rms_normalise(x [+ residual]).

Rounding follows transformers' LlamaRMSNorm: statistics in fp32, the normalised row cast back to the
input dtype before the weight multiplies it. Each program of a persistent grid (sized by the SM budget)
loops over rows; the backward accumulates the (optional) weight gradient per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harli_train.kernels.common import check_dtype, new_output
from harli_train.kernels.launch_config import get_config, launch_gate, num_sms, with_forward_budget


# X, R, HOUT, Y: [rows, H] with row strides stride_*, column stride 1; W: [H]; RSTD: [rows] fp32.
# HOUT receives x + residual (HAS_RESIDUAL) in its own dtype; Y = W * (h * rstd).to(h dtype).
@triton.jit
def _rms_norm_fwd_kernel(
    X,
    stride_x,
    R,
    stride_r,
    HOUT,
    stride_h,
    W,
    Y,
    stride_y,
    RSTD,
    n_rows,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Persistent: program p handles rows p, p + P, ...; the int64 row index keeps offsets from overflowing.
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(HOUT.dtype.element_ty)
            tl.store(HOUT + row * stride_h + cols, h, mask=mask)
            x = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(RSTD + row, rstd)
        normed = (x * rstd).to(HOUT.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * stride_y + cols, (normed * w).to(Y.dtype.element_ty), mask=mask)


# DY: [rows, H] (dtype of y); H: [rows, H] the normalised input; DH: [rows, H] incoming gradient of the
# residual output (HAS_DH); DX: [rows, H] output; DW: [programs, H] fp32 per-program partial weight grads.
@triton.jit
def _rms_norm_bwd_kernel(
    DY,
    stride_dy,
    H,
    stride_h,
    DH,
    stride_dh,
    W,
    RSTD,
    DX,
    stride_dx,
    DW,
    n_rows,
    n_cols,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        hhat = h * rstd
        dn = dy * w
        # d/dh of h * rstd(h): rstd * (dn - hhat * mean(dn * hhat)); the cast to h's dtype passes straight.
        dx = rstd * (dn - hhat * (tl.sum(dn * hhat, axis=0) / n_cols))
        if HAS_DH:
            dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            dw += dy * hhat.to(H.dtype.element_ty).to(tl.float32)
    if COMPUTE_DW:
        tl.store(DW + pid * n_cols + cols, dw, mask=mask)


def rms_norm_fwd(
    x: torch.Tensor,  # shape [rows, H], column stride 1
    residual: torch.Tensor | None,  # shape [rows, H] or None
    weight: torch.Tensor,  # shape [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y [rows, H], h [rows, H] = x + residual (x itself without one), rstd [rows] fp32)."""
    assert x.dim() == 2 and x.stride(1) == 1, "rms_norm: x must be [rows, H] with unit column stride"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    check_dtype("rms_norm x", x)
    check_dtype("rms_norm weight", weight)
    rows, cols = x.shape
    has_residual = residual is not None
    if has_residual:
        assert residual.shape == x.shape and residual.stride(1) == 1
        check_dtype("rms_norm residual", residual)
        h = new_output((rows, cols), torch.promote_types(x.dtype, residual.dtype), x.device)
    else:
        residual, h = x, x
    y = new_output((rows, cols), torch.promote_types(h.dtype, weight.dtype), x.device)
    rstd = new_output((rows,), torch.float32, x.device)
    if rows == 0:
        return y, h, rstd
    cfg = get_config("rms_norm", (rows, cols), num_sms(), x.dtype)
    launch_gate()
    _rms_norm_fwd_kernel[(cfg["num_programs"],)](
        x,
        x.stride(0),
        residual,
        residual.stride(0),
        h,
        h.stride(0),
        weight,
        y,
        y.stride(0),
        rstd,
        rows,
        cols,
        eps,
        HAS_RESIDUAL=has_residual,
        BLOCK_H=cfg["BLOCK_H"],
        num_warps=cfg["num_warps"],
    )
    return y, h, rstd


def rms_norm_bwd(
    dy: torch.Tensor,  # shape [rows, H]
    h: torch.Tensor,  # shape [rows, H], the normalised input saved by the forward
    weight: torch.Tensor,  # shape [H]
    rstd: torch.Tensor,  # shape [rows] fp32
    dh: torch.Tensor | None,  # shape [rows, H]: gradient reaching h directly (the residual stream), or None
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (dx [rows, H] in h's dtype, dweight [H] or None)."""
    assert dy.shape == h.shape and dy.stride(1) == 1 and h.stride(1) == 1
    assert rstd.dtype == torch.float32 and rstd.is_contiguous()
    rows, cols = h.shape
    dx = new_output((rows, cols), h.dtype, h.device)
    if rows == 0:
        return dx, torch.zeros_like(weight) if compute_dw else None
    if dh is not None:
        assert dh.shape == h.shape and dh.stride(1) == 1
    cfg = get_config("rms_norm", (rows, cols), num_sms(), h.dtype)
    programs = cfg["num_programs"]
    dw = torch.empty((programs, cols), dtype=torch.float32, device=h.device) if compute_dw else rstd
    launch_gate()
    _rms_norm_bwd_kernel[(programs,)](
        dy,
        dy.stride(0),
        h,
        h.stride(0),
        dh if dh is not None else dy,
        dh.stride(0) if dh is not None else 0,
        weight,
        rstd,
        dx,
        dx.stride(0),
        dw,
        rows,
        cols,
        HAS_DH=dh is not None,
        COMPUTE_DW=compute_dw,
        BLOCK_H=cfg["BLOCK_H"],
        num_warps=cfg["num_warps"],
    )
    return dx, dw.sum(0).to(weight.dtype) if compute_dw else None


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


class RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x) * w; grads to x (and to w when it requires grad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, h, rstd = rms_norm_fwd(_rows(x), None, weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.num_sms = num_sms()
        return y.view(x.shape)

    @staticmethod
    @with_forward_budget
    def backward(ctx, dy: torch.Tensor):
        h, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(_rows(dy), h, weight, rstd, None, ctx.needs_input_grad[1])
        return dx.view(dy.shape), dw, None


class AddRMSNormFunction(torch.autograd.Function):
    """(y, h) = (rms_norm(h) * w, h) with h = x + residual; x and residual get the same gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        y, h, rstd = rms_norm_fwd(_rows(x), _rows(residual), weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        ctx.x_shape = x.shape
        ctx.num_sms = num_sms()
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    @with_forward_budget
    def backward(ctx, dy: torch.Tensor | None, dh: torch.Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the residual stream was used: the norm branch adds nothing
            dx = dh.reshape(ctx.x_shape)
            return dx, dx, torch.zeros_like(weight) if ctx.needs_input_grad[2] else None, None
        dh = None if dh is None else _rows(dh)
        dx, dw = rms_norm_bwd(_rows(dy), h, weight, rstd, dh, ctx.needs_input_grad[2])
        dx = dx.view(ctx.x_shape)
        return dx, dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm of x [..., H] with weight [H]."""
    return RMSNormFunction.apply(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton (rms_norm(x + residual), x + residual)."""
    return AddRMSNormFunction.apply(x, residual, weight, eps)
