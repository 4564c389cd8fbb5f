"""Rotary position embedding of q and k in the half-split (rotate_half) layout, forward and backward.

The kernel only rotates: Llama-3 frequency scaling lives in the cos/sin tables the model computes.
q and k may be strided views of a projection output; each program handles all heads of one token at a
time, so cos/sin are read once per token. The public op is functional (fresh outputs); the launcher can
also rotate in place (`inplace=True`), which is safe only when the caller owns q and k (decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harli_train.kernels.common import check_dtype, new_output
from harli_train.kernels.launch_config import get_config, launch_gate, num_sms, with_forward_budget


@triton.jit
def _rotate_heads(
    X,
    sxb,
    sxt,
    sxh,
    XO,
    sob,
    sot,
    soh,
    b,
    t,
    n_heads,
    half,
    c1,
    c2,
    s1,
    s2,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One token's [heads, D] slab as two [BLOCK_H, BLOCK_HALF] halves; c*/s* are [1, BLOCK_HALF].
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (d < half)
    x_ptr = X + b * sxb + t * sxt + heads * sxh + d
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transposed rotation
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    o_ptr = XO + b * sob + t * sot + heads * soh + d
    tl.store(o_ptr, o1.to(XO.dtype.element_ty), mask=mask)
    tl.store(o_ptr + half, o2.to(XO.dtype.element_ty), mask=mask)


# Q, QO: [B, T, Hq, D] strides (s*b, s*t, s*h, 1); K, KO: [B, T, Hk, D] likewise; COS, SIN: [B or 1, T, D]
# strides (scb, sct, 1), scb = 0 when shared by the batch. Persistent over the B*T tokens.
# One kernel serves forward and backward (BACKWARD constexpr), as Liger's rope does: the two differ in a sign.
@triton.jit
def _rope_kernel(
    Q,
    sqb,
    sqt,
    sqh,
    QO,
    sqob,
    sqot,
    sqoh,
    K,
    skb,
    skt,
    skh,
    KO,
    skob,
    skot,
    skoh,
    COS,
    SIN,
    scb,
    sct,
    n_rows,
    seq_len,
    n_qh,
    n_kh,
    half,
    BACKWARD: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    for row in tl.range(pid, n_rows, tl.num_programs(0)):
        b = row // seq_len
        t = row % seq_len
        cs_off = b * scb + t * sct + d
        c1 = tl.load(COS + cs_off, mask=dmask, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(COS + cs_off + half, mask=dmask, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(SIN + cs_off, mask=dmask, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(SIN + cs_off + half, mask=dmask, other=0.0).to(tl.float32)[None, :]
        _rotate_heads(
            Q,
            sqb,
            sqt,
            sqh,
            QO,
            sqob,
            sqot,
            sqoh,
            b,
            t,
            n_qh,
            half,
            c1,
            c2,
            s1,
            s2,
            BACKWARD,
            BLOCK_QH,
            BLOCK_HALF,
        )
        _rotate_heads(
            K,
            skb,
            skt,
            skh,
            KO,
            skob,
            skot,
            skoh,
            b,
            t,
            n_kh,
            half,
            c1,
            c2,
            s1,
            s2,
            BACKWARD,
            BLOCK_KH,
            BLOCK_HALF,
        )


def rope_launch(
    q: torch.Tensor,  # shape [B, T, Hq, D], last stride 1
    k: torch.Tensor,  # shape [B, T, Hk, D], last stride 1
    cos: torch.Tensor,  # shape [B or 1, T, D], last stride 1
    sin: torch.Tensor,  # shape [B or 1, T, D], last stride 1
    backward: bool = False,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k (backward: by the transposed rotation). Returns fresh contiguous tensors, or q, k."""
    assert q.dim() == 4 and k.dim() == 4 and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
    batch, seq_len, n_qh, head_dim = q.shape
    assert head_dim % 2 == 0, "rope: head_dim must be even"
    assert q.stride(3) == 1 and k.stride(3) == 1, "rope: q and k need unit stride on head_dim"
    assert cos.shape == sin.shape and cos.shape[1:] == (seq_len, head_dim) and cos.shape[0] in (1, batch)
    if sin.stride() != cos.stride():  # the kernel walks both tables with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    assert cos.stride(2) == 1
    check_dtype("rope q", q)
    check_dtype("rope k", k)
    qo = q if inplace else new_output(q.shape, q.dtype, q.device)
    ko = k if inplace else new_output(k.shape, k.dtype, k.device)
    rows = batch * seq_len
    if rows == 0:
        return qo, ko
    cfg = get_config("rope", (rows, n_qh, k.shape[2], head_dim), num_sms(), q.dtype)
    batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    launch_gate()
    _rope_kernel[(cfg["num_programs"],)](
        q,
        *q.stride()[:3],
        qo,
        *qo.stride()[:3],
        k,
        *k.stride()[:3],
        ko,
        *ko.stride()[:3],
        cos,
        sin,
        batch_stride,
        cos.stride(1),
        rows,
        seq_len,
        n_qh,
        k.shape[2],
        head_dim // 2,
        BACKWARD=backward,
        BLOCK_QH=cfg["BLOCK_QH"],
        BLOCK_KH=cfg["BLOCK_KH"],
        BLOCK_HALF=cfg["BLOCK_HALF"],
        num_warps=cfg["num_warps"],
    )
    return qo, ko


class RopeFunction(torch.autograd.Function):
    """(q', k') = R(cos, sin) (q, k); the backward applies R^T to the incoming gradients."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ctx.save_for_backward(cos, sin)
        ctx.num_sms = num_sms()
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.q_meta, ctx.k_meta = (q.shape, q.dtype), (k.shape, k.dtype)
        return rope_launch(q, k, cos, sin)

    @staticmethod
    @with_forward_budget
    def backward(ctx, dq: torch.Tensor | None, dk: torch.Tensor | None):
        cos, sin = ctx.saved_tensors
        if dq is None:  # q' or k' unused downstream
            dq = torch.zeros(ctx.q_meta[0], dtype=ctx.q_meta[1], device=cos.device)
        if dk is None:
            dk = torch.zeros(ctx.k_meta[0], dtype=ctx.k_meta[1], device=cos.device)
        dq, dk = rope_launch(_unit_last(dq), _unit_last(dk), cos, sin, backward=True)
        return dq, dk, None, None


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rope of q [B, T, Hq, D] and k [B, T, Hk, D] with cos/sin [B or 1, T, D] (half-split)."""
    return RopeFunction.apply(_unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin))
