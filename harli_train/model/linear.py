"""The model's projection layer: a frozen linear map that can carry a LoRA adapter."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from harli_train import kernels


class LoRALinear(nn.Module):
    """y = x W^T + b + (alpha / r) * dropout(x) A^T B^T,
    with W and b frozen and A [r, in], B [out, r] trained.

    Without an adapter it is a plain frozen linear layer. Adapter parameters are kept in fp32 (master
    weights); the computation runs in the activation dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora_A: nn.Parameter | None = None
        self.lora_B: nn.Parameter | None = None
        self.rank, self.alpha, self.dropout = 0, 0.0, 0.0

    @property
    def has_lora(self) -> bool:
        return self.lora_A is not None

    @property
    def fusable(self) -> bool:
        """Whether it carries an adapter the Triton LoRA kernels run: any adapter but one whose dropout is
        active (training with dropout > 0 takes the plain path)."""
        return self.has_lora and not (self.dropout > 0.0 and self.training)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def add_lora(
        self, rank: int, alpha: float, dropout: float = 0.0, generator: torch.Generator | None = None
    ):
        """Attach a fresh adapter initialised as peft does: A ~ kaiming-uniform(a=sqrt(5)), B = 0."""
        device = self.weight.device
        self.rank, self.alpha, self.dropout = rank, float(alpha), float(dropout)
        a = torch.empty(rank, self.in_features, dtype=torch.float32, device=device)
        # kaiming_uniform_(a=sqrt(5)) bound on a [r, in] tensor: 1 / sqrt(in).
        bound = 1.0 / math.sqrt(self.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=torch.float32, device=device))

    def remove_lora(self) -> None:
        self.lora_A = self.lora_B = None
        self.rank, self.alpha, self.dropout = 0, 0.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_A is None:
            return F.linear(x, self.weight, self.bias)
        if not self.fusable:
            # The fused kernel has no dropout; the rare dropout case takes the plain path.
            h = F.dropout(x, self.dropout, training=True)
            lora = F.linear(F.linear(h, self.lora_A.to(h.dtype)), self.lora_B.to(h.dtype))
            return F.linear(x, self.weight, self.bias) + lora * self.scale
        return kernels.lora_linear(x, self.weight, self.bias, self.lora_A, self.lora_B, self.scale)

    def extra_repr(self) -> str:
        lora = f", lora_rank={self.rank}, lora_alpha={self.alpha}" if self.has_lora else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{lora}"


def grouped_forward(x: torch.Tensor, layers: tuple[LoRALinear, ...]) -> list[torch.Tensor]:
    """Apply several projections of the same input (q/k/v, gate/up); fused when all carry plain adapters."""
    if not all(m.fusable for m in layers):
        return [m(x) for m in layers]
    return kernels.lora_linear_group(x, [(m.weight, m.bias, m.lora_A, m.lora_B, m.scale) for m in layers])
