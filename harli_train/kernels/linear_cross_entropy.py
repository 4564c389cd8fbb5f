"""Fused, chunked linear + cross-entropy (Liger's fused_linear_cross_entropy design).

The [N, vocab] logits never exist at once: rows are taken in chunks sized by the launch config (about
1 GiB of logits). Per chunk, cuBLAS computes the logits, a Triton kernel turns them in place into the
loss rows and d loss / d logits (softmax - onehot), and cuBLAS maps that back to d loss / d hidden, all
inside the forward. The backward only scales the stored gradient by the incoming one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harli_train.kernels.common import check_dtype, compute_dtype, new_output
from harli_train.kernels.launch_config import get_config, launch_gate, num_sms


# LOGITS: [rows, V] row stride stride_l, column stride 1; overwritten with d loss / d logits (COMPUTE_GRAD).
# LABELS: [rows] int; LOSS: [rows] fp32, logsumexp - logit[label], 0 where label == ignore_index.
# Persistent over rows; each row is read twice (online max / sum-exp, then the gradient).
@triton.jit
def _cross_entropy_fwd_kernel(
    LOGITS,
    stride_l,
    LABELS,
    LOSS,
    n_rows,
    n_cols,
    ignore_index,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        ptr = LOGITS + row * stride_l
        label = tl.load(LABELS + row).to(tl.int64)
        if label == ignore_index:
            tl.store(LOSS + row, 0.0)
            if COMPUTE_GRAD:
                for v0 in tl.range(0, n_cols, BLOCK_V):
                    zero = tl.zeros([BLOCK_V], dtype=LOGITS.dtype.element_ty)
                    tl.store(ptr + v0 + offs, zero, mask=v0 + offs < n_cols)
        else:
            m = float("-inf")
            d = 0.0
            for v0 in tl.range(0, n_cols, BLOCK_V):
                x = tl.load(ptr + v0 + offs, mask=v0 + offs < n_cols, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                m = m_new
            lse = m + tl.log(d)
            # Read the label's logit before the gradient pass overwrites it.
            tl.store(LOSS + row, lse - tl.load(ptr + label).to(tl.float32))
            if COMPUTE_GRAD:
                for v0 in tl.range(0, n_cols, BLOCK_V):
                    cols = v0 + offs
                    x = tl.load(ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
                    g = tl.exp(x - lse)
                    g = tl.where(cols == label, g - 1.0, g)
                    tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=cols < n_cols)


def cross_entropy_fwd_(
    logits: torch.Tensor,  # shape [rows, V], column stride 1; becomes d loss / d logits if compute_grad
    labels: torch.Tensor,  # shape [rows], integer, contiguous
    loss: torch.Tensor,  # shape [rows] fp32, contiguous; written
    ignore_index: int,
    compute_grad: bool,
) -> None:
    """Per-row cross-entropy of logits against labels; the gradient replaces the logits in place."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "cross_entropy: logits must be [rows, V], unit stride"
    assert labels.shape == (logits.shape[0],) and labels.is_contiguous() and not labels.is_floating_point()
    assert loss.shape == labels.shape and loss.dtype == torch.float32 and loss.is_contiguous()
    check_dtype("cross_entropy logits", logits)
    rows, vocab = logits.shape
    if rows == 0:
        return
    cfg = get_config("cross_entropy", (rows, vocab), num_sms(), logits.dtype)
    launch_gate()
    _cross_entropy_fwd_kernel[(cfg["num_programs"],)](
        logits,
        logits.stride(0),
        labels,
        loss,
        rows,
        vocab,
        ignore_index,
        COMPUTE_GRAD=compute_grad,
        BLOCK_V=cfg["BLOCK_V"],
        num_warps=cfg["num_warps"],
    )


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss = sum over rows n with y_n != ignore of  logsumexp(Z_n) - Z_n[y_n],  Z = H W^T.

    Chain rule: dZ = softmax(Z) - onehot(y) (0 on ignored rows), dH = dZ W, computed per chunk of rows in
    the forward: Z_c = H_c W^T (cuBLAS) -> kernel (loss rows; Z_c <- dZ_c in place) -> dH_c = dZ_c W (cuBLAS).
    backward: dH * dloss. W is the frozen head: it gets no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, chunk_rows: int | None):
        dt = compute_dtype(hidden)
        h, w = hidden.to(dt), weight.to(dt)
        (n, hid), vocab = h.shape, w.shape[0]
        need_grad = ctx.needs_input_grad[0]
        labels = labels.contiguous()
        loss_rows = new_output((n,), torch.float32, h.device)
        dh = new_output((n, hid), dt, h.device) if need_grad else None
        chunk = chunk_rows or get_config("linear_cross_entropy", (n, hid, vocab), num_sms(), dt)["CHUNK_N"]
        logits = torch.empty((min(chunk, n), vocab), dtype=dt, device=h.device)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            z = logits[: stop - start]
            torch.mm(h[start:stop], w.t(), out=z)
            cross_entropy_fwd_(z, labels[start:stop], loss_rows[start:stop], ignore_index, need_grad)
            if need_grad:
                torch.mm(z, w, out=dh[start:stop])
        n_valid = (labels != ignore_index).sum()
        ctx.mark_non_differentiable(n_valid)
        ctx.save_for_backward(dh)
        ctx.hidden_dtype = hidden.dtype
        return loss_rows.sum(), n_valid

    @staticmethod
    def backward(ctx, dloss: torch.Tensor, _dn_valid):
        (dh,) = ctx.saved_tensors
        return (dh * dloss).to(ctx.hidden_dtype), None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton (sum of token losses fp32, #valid) of hidden [N, H] @ weight [V, H]^T against labels [N]."""
    return LinearCrossEntropyFunction.apply(hidden, weight, labels, ignore_index, chunk_rows)
