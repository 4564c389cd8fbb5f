"""LoRA linear: y = x W^T + b + s (x A^T) B^T with W, b frozen and A [r, in], B [out, r] trained.

The big GEMMs (x W^T, dY W, dA, dB) stay in cuBLAS. Triton fuses the rank-r parts cuBLAS cannot:
the shrink (x A^T -> [M, r], split over K to fill the SMs we own) and the expand (y += s z B^T over y's
tiles, in place, persistent). A group variant serves q/k/v or gate/up: one shrink reads x once for every
member's A, and the backward adds every member's rank-r term into dx with one expand.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.optim.optimizer import register_optimizer_step_post_hook

from harli_train.kernels.common import check_dtype, compute_dtype, new_output
from harli_train.kernels.launch_config import get_config, launch_gate, num_sms, with_forward_budget
from harli_train.kernels.swiglu import _rows, swiglu_bwd, swiglu_fwd


# X: [M, K] strides (sxm, sxk); W: [R, K] strides (swr, swk), read as W^T [K, R];
# OUT: [SPLIT_K, M, R] fp32 partial sums (strides sos, som, sor) or, with SPLIT_K == 1, [M, R] in its own
# dtype (sos unused). OUT[k] = scale * X[:, k-th share of K] @ W^T. Grid (M tiles, SPLIT_K, R tiles).
@triton.jit
def _lora_shrink_kernel(
    X,
    sxm,
    sxk,
    W,
    swr,
    swk,
    OUT,
    sos,
    som,
    sor,
    M,
    K,
    R,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1)
    pid_r = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    r_mask = offs_r[None, :] < R
    x_ptrs = X + offs_m[:, None] * sxm + offs_k[None, :] * sxk
    w_ptrs = W + offs_r[None, :] * swr + offs_k[:, None] * swk
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # Split s takes K-blocks s, s + SPLIT_K, ...
    for k0 in tl.range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs + k0 * sxk, mask=m_mask & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0 * swk, mask=r_mask & k_mask[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
    out_ptrs = OUT + pid_k * sos + offs_m[:, None] * som + offs_r[None, :] * sor
    tl.store(out_ptrs, (acc * scale).to(OUT.dtype.element_ty), mask=m_mask & r_mask)


# Z: [M, R] strides (szm, szr); W: [R, N] strides (swr, swn); Y: [M, N] row stride sym, column stride 1.
# Y += scale * Z @ W, read-modify-write of each [BLOCK_M, BLOCK_N] tile of Y; persistent over the tiles.
@triton.jit
def _lora_expand_kernel(
    Z,
    szm,
    szr,
    W,
    swr,
    swn,
    Y,
    sym,
    M,
    N,
    R,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    offs_r = tl.arange(0, BLOCK_R)
    for tile in tl.range(pid, n_tiles, tl.num_programs(0)):
        offs_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m[:, None] < M
        n_mask = offs_n[None, :] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in tl.range(0, R, BLOCK_R):
            rr = r0 + offs_r
            r_mask = rr < R
            z_ptrs = Z + offs_m[:, None] * szm + rr[None, :] * szr
            w_ptrs = W + rr[:, None] * swr + offs_n[None, :] * swn
            z = tl.load(z_ptrs, mask=m_mask & r_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=r_mask[:, None] & n_mask, other=0.0)
            acc = tl.dot(z, w, acc)
        y_ptrs = Y + offs_m[:, None] * sym + offs_n[None, :]
        y = tl.load(y_ptrs, mask=m_mask & n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + scale * acc).to(Y.dtype.element_ty), mask=m_mask & n_mask)


def lora_shrink(
    x: torch.Tensor,  # shape [M, K], any strides
    w: torch.Tensor,  # shape [R, K], any strides (A itself, or B^T as a view)
    scale: float,
    out: torch.Tensor | None = None,  # shape [M, R], any strides; x's dtype when allocated here
) -> torch.Tensor:
    """out = scale * x @ w^T, the rank-R projection, reading x once."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], f"lora_shrink: {x.shape} @ {w.shape}^T"
    assert x.dtype == w.dtype, f"lora_shrink: x {x.dtype} and w {w.dtype} must match"
    check_dtype("lora_shrink x", x)
    (m, k), r = x.shape, w.shape[0]
    out = new_output((m, r), x.dtype, x.device) if out is None else out
    assert out.shape == (m, r)
    if m == 0 or r == 0:
        return out
    cfg = get_config("lora_shrink", (m, k, r), num_sms(), x.dtype)
    split = cfg["SPLIT_K"]
    # With several K splits each writes fp32 partials, summed below in a fixed order (deterministic).
    target = out if split == 1 else torch.empty((split, m, r), dtype=torch.float32, device=x.device)
    sos = 0 if split == 1 else target.stride(0)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), split, triton.cdiv(r, cfg["BLOCK_R"]))
    launch_gate()
    _lora_shrink_kernel[grid](
        x,
        *x.stride(),
        w,
        *w.stride(),
        target,
        sos,
        *target.stride()[-2:],
        m,
        k,
        r,
        scale,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_K=cfg["BLOCK_K"],
        BLOCK_R=cfg["BLOCK_R"],
        SPLIT_K=split,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split > 1:
        out.copy_(target.sum(0))
    return out


def lora_expand_(
    y: torch.Tensor,  # shape [M, N], column stride 1; updated in place
    z: torch.Tensor,  # shape [M, R], any strides
    w: torch.Tensor,  # shape [R, N], any strides (B^T as a view, or A)
    scale: float,
) -> torch.Tensor:
    """y += scale * z @ w, in place; returns y."""
    assert y.dim() == 2 and y.stride(1) == 1, "lora_expand_: y must be [M, N] with unit column stride"
    assert z.shape == (y.shape[0], w.shape[0]) and w.shape[1] == y.shape[1], (
        f"lora_expand_: {y.shape} += {z.shape} @ {w.shape}"
    )
    assert z.dtype == w.dtype, f"lora_expand_: z {z.dtype} and w {w.dtype} must match"
    check_dtype("lora_expand_ y", y)
    (m, n), r = y.shape, z.shape[1]
    if y.numel() == 0 or r == 0:
        return y
    cfg = get_config("lora_expand", (m, n, r), num_sms(), z.dtype)
    launch_gate()
    _lora_expand_kernel[(cfg["num_programs"],)](
        z,
        *z.stride(),
        w,
        *w.stride(),
        y,
        y.stride(0),
        m,
        n,
        r,
        scale,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_R=cfg["BLOCK_R"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


class _MasterCasts:
    """The adapters' fp32 masters cast to the compute dtype (A stacked over a group's members, B per member),
    made once per optimizer update rather than in every forward.

    Each forward of a member group launched a cast per A and B plus the stack, 16 small kernels and as many
    allocations per Llama layer, though the masters only change when an optimizer steps. Every optimizer step
    empties the cache (a global post-step hook): fused AdamW updates the masters without bumping their version
    counters. Other in-place edits do bump them, and an entry is used only while it holds the very tensors
    (weak references) at the versions it was made from, so a freed master whose id is reused never matches
    either; a master's death drops its entry. Under CUDA graph capture the cache is neither read nor filled:
    the casts are made inside the graph, so each replay casts the masters as they are then (a cached cast
    lives outside the graph's memory, is freed at the next optimizer step,
    and a graph would go on reading it)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}

    def clear(self, *_: object) -> None:
        self._entries = {}

    def get(self, a_list, b_list, dt: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # Not under inference mode: its tensors could not be saved by a later training forward.
        if torch.is_inference_mode_enabled() or _capturing(a_list[0]):
            return _cast(a_list, b_list, dt)
        masters = (*a_list, *b_list)
        key = (*(id(t) for t in masters), dt)
        versions = tuple(t._version for t in masters)
        hit = self._entries.get(key)
        if (
            hit is not None
            and hit[1] == versions
            and all(r() is t for r, t in zip(hit[0], masters, strict=True))
        ):
            return hit[2], hit[3]
        a_cat, bs = _cast(a_list, b_list, dt)
        # a master is gone: so is its entry
        drop = lambda _ref, key=key: self._entries.pop(key, None)  # noqa: E731
        self._entries[key] = (tuple(weakref.ref(t, drop) for t in masters), versions, a_cat, bs)
        return a_cat, bs


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _cast(a_list, b_list, dt: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    a_cat = torch.cat([a.to(dt) for a in a_list]) if len(a_list) > 1 else a_list[0].to(dt)
    return a_cat, [b.to(dt) for b in b_list]


_master_casts = _MasterCasts()
register_optimizer_step_post_hook(_master_casts.clear)


def forget_master_casts() -> None:
    """Empty the masters' cast cache: for an update of the masters that bypasses ``Optimizer.step``
    (`train.adapter_update`), whose post-step hook empties it otherwise."""
    _master_casts.clear()


class LoRALinearGroupFunction(torch.autograd.Function):
    """Members i = 0..G-1 share the input x:  y_i = x W_i^T + b_i + s_i (x A_i^T) B_i^T.

    With A = [A_0; A_1; ...] stacked [sum r, in], XA = x A^T [M, sum r] and XA_i its column block:
        forward   XA    = x A^T                          (Triton shrink: x read once; saved)
                  y_i   = x W_i^T + b_i                  (cuBLAS)
                  y_i  += s_i XA_i B_i^T                 (Triton expand, in place)
        backward  dYB_i = s_i dY_i B_i                   (Triton shrink) -> dYB = [dYB_0 | dYB_1 | ...]
                  dA    = dYB^T x,   dA_i its row block  (cuBLAS)
                  dB_i  = s_i dY_i^T XA_i                (cuBLAS)
                  dx    = sum_i dY_i W_i                 (cuBLAS, accumulating)
                  dx   += dYB A                          (Triton expand, one pass over dx for all members)
    Only rank-r intermediates (XA, dYB) are kept. W_i and b_i are frozen: they get no gradient.
    GEMMs run in autocast's dtype when it is on (the fp32 A, B masters are cast), else in x's dtype.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scales: tuple[float, ...], *params: torch.Tensor):
        dt = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1]).to(dt)
        outs, xa, a_cat, bs = _group_forward(x2, dt, scales, params)
        weights = params[0::4]
        ctx.save_for_backward(x2, xa, a_cat, *weights, *bs)
        ctx.num_sms = num_sms()
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.scales, ctx.ranks, ctx.x_meta = scales, [a.shape[0] for a in params[2::4]], (x.shape, x.dtype)
        return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in outs)

    @staticmethod
    @with_forward_budget
    def backward(ctx, *dys: torch.Tensor | None):
        x2, xa, a_cat, *rest = ctx.saved_tensors
        n = len(ctx.scales)
        grads, dx = _group_backward(
            dys, lambda _dx: x2, xa, a_cat, rest[:n], rest[n:], ctx.scales, ctx.ranks, ctx.needs_input_grad
        )
        if dx is not None:
            grads[0] = dx.view(ctx.x_meta[0]).to(ctx.x_meta[1])
        return tuple(grads)


def _group_forward(
    x2: torch.Tensor, dt: torch.dtype, scales: tuple[float, ...], params: tuple[torch.Tensor, ...]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The group's forward over x2 [M, in] in ``dt`` (params: (W, b, A, B) per member): (each member's output
    [M, out], XA, the stacked A cast, the B casts)."""
    weights, biases = params[0::4], params[1::4]
    ranks = [a.shape[0] for a in params[2::4]]
    a_cat, bs = _master_casts.get(params[2::4], params[3::4], dt)
    xa = lora_shrink(x2, a_cat, 1.0)
    outs, off = [], 0
    for w, bias, b, s, r in zip(weights, biases, bs, scales, ranks, strict=True):
        y = F.linear(x2, w.to(dt), None if bias is None else bias.to(dt))
        lora_expand_(y, xa[:, off : off + r], b.t(), s)
        outs.append(y)
        off += r
    return outs, xa, a_cat, bs


def _group_backward(
    dys: tuple[torch.Tensor | None, ...],
    x2_of: Callable[[torch.Tensor | None], torch.Tensor],
    xa: torch.Tensor,
    a_cat: torch.Tensor,
    weights: Sequence[torch.Tensor],
    bs: Sequence[torch.Tensor],
    scales: Sequence[float],
    ranks: Sequence[int],
    need: Sequence[bool],
) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """The group's backward: (the gradients in the group function's argument order, dx [M, in] in the
    compute dtype or None when x needs none). ``x2_of(dx)`` gives the forward's input [M, in] (called only
    for dA, last, with dx); ``need`` is the group function's ``needs_input_grad`` (x first)."""
    n = len(scales)
    dt, m = xa.dtype, xa.shape[0]
    dys = [None if d is None else d.reshape(m, d.shape[-1]).to(dt) for d in dys]
    grads: list[torch.Tensor | None] = [None] * (2 + 4 * n)
    if need[0] or any(need[4::4]):  # dYB feeds dx and dA only
        dyb = new_output((m, a_cat.shape[0]), dt, xa.device)
        off = 0
        for dy, b, s, r in zip(dys, bs, scales, ranks, strict=True):
            if dy is None:
                dyb[:, off : off + r].zero_()
            else:
                lora_shrink(dy, b.t(), s, out=dyb[:, off : off + r])
            off += r
    off = 0
    for i, (dy, s, r) in enumerate(zip(dys, scales, ranks, strict=True)):
        if need[5 + 4 * i]:
            grads[5 + 4 * i] = (
                torch.zeros_like(bs[i]) if dy is None else (dy.t() @ xa[:, off : off + r]).mul_(s)
            )
        off += r
    dx = None
    if need[0]:
        for dy, w in zip(dys, weights, strict=True):
            if dy is not None:
                dx = dy @ w.to(dt) if dx is None else dx.addmm_(dy, w.to(dt))
        dx = torch.zeros((m, a_cat.shape[1]), dtype=dt, device=xa.device) if dx is None else dx
        lora_expand_(dx, dyb, a_cat, 1.0)
    if any(need[4::4]):
        for i, da in enumerate((dyb.t() @ x2_of(dx)).split(ranks)):
            grads[4 + 4 * i] = da if need[4 + 4 * i] else None
    return grads, dx


class SwiGLULoRALinearFunction(torch.autograd.Function):
    """y = a W^T + b + s (a A^T) B^T with a = silu(g) u (the MLP's down projection over its SwiGLU), saving
    g and u (which the SwiGLU's backward needs anyway) but not a: the backward recomputes a for dA, in the
    SwiGLU backward's pass over g and u when da is needed. Computes exactly what `swiglu` followed by
    `lora_linear` computes; a [M, intermediate] activation less is kept per layer."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a, lora_b, scale: float):
        g, u = _rows(gate), _rows(up)
        act = swiglu_fwd(g, u)
        dt = compute_dtype(act)
        (y,), xa, a_cat, bs = _group_forward(act.to(dt), dt, (scale,), (weight, bias, lora_a, lora_b))
        ctx.save_for_backward(g, u, xa, a_cat, weight, *bs)
        ctx.num_sms = num_sms()
        ctx.scale, ctx.rank, ctx.act_dtype, ctx.shape = scale, lora_a.shape[0], act.dtype, gate.shape
        return y.view(*gate.shape[:-1], y.shape[-1])

    @staticmethod
    @with_forward_budget
    def backward(ctx, dy: torch.Tensor):
        g, u, xa, a_cat, weight, b = ctx.saved_tensors
        need = ctx.needs_input_grad
        swiglu_grads: list[torch.Tensor] = []

        def x2_of(d_act: torch.Tensor | None) -> torch.Tensor:
            """The forward's input, recomputed; with d_act, by the SwiGLU backward's pass, which it runs."""
            if d_act is None:
                return swiglu_fwd(g, u).to(xa.dtype)
            dg, du, act = swiglu_bwd(d_act.to(ctx.act_dtype), g, u, with_output=True)
            swiglu_grads.extend((dg, du))
            return act.to(xa.dtype)

        group_need = (need[0] or need[1], False, False, False, need[4], need[5])
        grads, d_act = _group_backward(
            (dy,), x2_of, xa, a_cat, (weight,), (b,), (ctx.scale,), (ctx.rank,), group_need
        )
        dg = du = None
        if d_act is not None:
            dg, du = swiglu_grads or swiglu_bwd(d_act.to(ctx.act_dtype), g, u)
            dg, du = dg.view(ctx.shape), du.view(ctx.shape)
        return dg, du, None, None, grads[4], grads[5], None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton LoRA linear of x [..., in]: x W^T + b + scale (x A^T) B^T."""
    return LoRALinearGroupFunction.apply(x, (float(scale),), weight, bias, lora_a, lora_b)[0]


def swiglu_lora_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton LoRA linear of silu(gate) * up (gate, up [..., in] of one shape), the activation not kept."""
    return SwiGLULoRALinearFunction.apply(gate, up, weight, bias, lora_a, lora_b, float(scale))


def lora_linear_group(
    x: torch.Tensor,
    members: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, float]],
) -> list[torch.Tensor]:
    """Triton LoRA linears sharing x, e.g. q/k/v: members are (weight, bias, lora_a, lora_b, scale)."""
    flat = [t for weight, bias, a, b, _ in members for t in (weight, bias, a, b)]
    return list(LoRALinearGroupFunction.apply(x, tuple(float(m[4]) for m in members), *flat))
