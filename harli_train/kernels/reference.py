"""Plain-torch reference of every fused op: the numerics the Triton kernels must reproduce.

The model calls these through `harli_train.kernels` so that the Triton versions can replace them one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [..., H], weight [H]; statistics in fp32, as transformers' LlamaRMSNorm does.
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # Returns (rms_norm(x + residual), x + residual): the residual stream and the next block's input.
    h = x + residual
    return rms_norm(h, weight, eps), h


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # q [B, T, Hq, D], k [B, T, Hk, D], cos/sin [B or 1, T, D] (the half-split layout of transformers).
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    q_out = (q.float() * cos + _rotate_half(q.float()) * sin).to(q.dtype)
    k_out = (k.float() * cos + _rotate_half(k.float()) * sin).to(k.dtype)
    return q_out, k_out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    # x [..., in], weight [out, in] (frozen), lora_a [r, in], lora_b [out, r]: y = x W^T + b + s (x A^T) B^T.
    y = F.linear(x, weight, bias)
    return y + F.linear(F.linear(x, lora_a.to(x.dtype)), lora_b.to(x.dtype)) * scale


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    # hidden [N, H], weight [V, H], labels [N] already shifted; returns (sum of token losses in fp32, #valid).
    logits = F.linear(hidden, weight).float()
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return loss, (labels != ignore_index).sum()


def lora_linear_group(
    x: torch.Tensor,
    members: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, float]],
) -> list[torch.Tensor]:
    # LoRA linears sharing one input (q/k/v, gate/up); members are (weight, bias, lora_a, lora_b, scale).
    return [lora_linear(x, w, b, a, b_, s) for w, b, a, b_, s in members]
