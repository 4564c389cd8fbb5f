"""Fused ops of the training step. Each name dispatches to the Triton kernel or to the torch reference.

Backends: "auto" (default) runs Triton on CUDA tensors when triton imports and the reference elsewhere
(CPU tensors always take the reference under "auto", interpreter or not, so CPU model tests stay fast);
"triton" always runs Triton (CPU tensors then need TRITON_INTERPRET=1, set before the first kernel call);
"torch" always runs the reference. Choose with `set_backend`, `use_backend` (scoped) or the HARLI_KERNELS
environment variable (read at import). The switch is process-wide, so a convergence test can train one
model with and without kernels. Cases a kernel does not cover (an unsupported dtype, a weight that
requires grad) take the reference under every backend.

The Triton modules are imported on first use, so TRITON_INTERPRET still takes effect when it is set after
this package is imported. Op files are named after their ops (rms_norm.py holds rms_norm): the package
keeps `kernels.rms_norm` the dispatching function even after the module `harli_train.kernels.rms_norm` is
imported. Reach Triton internals with `from harli_train.kernels.rms_norm import ...`.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from harli_train.kernels import reference
from harli_train.kernels.common import SUPPORTED_DTYPES
from harli_train.kernels.launch_config import get_config, num_sms, set_num_sms, sm_budget

BACKENDS = ("auto", "triton", "torch")

__all__ = [
    "BACKENDS",
    "add_rms_norm",
    "apply_rope",
    "get_backend",
    "get_config",
    "linear_cross_entropy",
    "lora_linear",
    "lora_linear_group",
    "num_sms",
    "rms_norm",
    "set_backend",
    "set_num_sms",
    "sm_budget",
    "swiglu",
    "triton_available",
    "triton_unavailable",
    "use_backend",
]


def _checked(name: str, source: str) -> str:
    backend = name.strip().lower()
    if backend not in BACKENDS:
        raise ValueError(f"{source}: unknown kernel backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return backend


_backend = _checked(os.environ.get("HARLI_KERNELS", "auto") or "auto", "environment variable HARLI_KERNELS")
_import_lock = threading.Lock()
_impls: dict[str, types.ModuleType] = {}


def set_backend(name: str) -> None:
    """Select "auto", "triton" or "torch" for every thread of the process."""
    global _backend
    _backend = _checked(name, "set_backend")


def get_backend() -> str:
    return _backend


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Select a backend inside the block (process-wide), restoring the previous one after."""
    global _backend
    prev = _backend
    set_backend(name)
    try:
        yield
    finally:
        _backend = prev


@functools.cache
def triton_available() -> bool:
    try:
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_unavailable(on_cuda: bool) -> str | None:
    """Why Triton kernels cannot run here on CUDA tensors (`on_cuda`) or CPU ones; None when they can: triton
    imports, and the tensors are on a GPU or TRITON_INTERPRET=1 runs Triton's CPU interpreter."""
    if not triton_available():
        return "triton cannot be imported (install it, or use 'auto' or 'torch')"
    if not on_cuda and not _interpreting():
        return (
            "there is no GPU for it: Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1, "
            "set before the first kernel call)"
        )
    return None


def _use_triton(x: torch.Tensor) -> bool:
    backend = _backend
    if backend == "torch":
        return False
    if backend == "auto":
        return x.is_cuda and triton_available()
    problem = triton_unavailable(x.is_cuda)
    if problem is not None:
        raise RuntimeError(f"kernel backend 'triton' was selected but {problem}")
    return True


def _supported(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype in SUPPORTED_DTYPES for t in tensors)


def _trainable(*tensors: torch.Tensor | None) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def _impl(name: str) -> types.ModuleType:
    mod = _impls.get(name)
    if mod is None:
        with _import_lock:
            mod = _impls[name] = importlib.import_module(f"{__name__}.{name}")
    return mod


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] by weight [H], statistics in fp32 (transformers' rounding)."""
    if _use_triton(x) and _supported(x, weight):
        return _impl("rms_norm").rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the next block's input and the residual stream."""
    if _use_triton(x) and _supported(x, residual, weight) and residual.shape == x.shape:
        return _impl("rms_norm").add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [B, T, Hq, D] and k [B, T, Hk, D] by cos/sin [B or 1, T, D] (half-split)."""
    if _use_triton(q) and _supported(q, k, cos, sin) and q.shape[-1] % 2 == 0 and cos.dim() == 3:
        return _impl("rope").apply_rope(q, k, cos, sin)
    return reference.apply_rope(q, k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    if _use_triton(gate) and _supported(gate, up) and gate.shape == up.shape:
        return _impl("swiglu").swiglu(gate, up)
    return reference.swiglu(gate, up)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """x W^T + b + scale (x A^T) B^T; W, b frozen, grads to x, A, B."""
    if _use_triton(x) and _supported(x, weight, bias, lora_a, lora_b) and not _trainable(weight, bias):
        return _impl("lora_linear").lora_linear(x, weight, bias, lora_a, lora_b, scale)
    return reference.lora_linear(x, weight, bias, lora_a, lora_b, scale)


def swiglu_lora_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``lora_linear(swiglu(gate, up), weight, bias, lora_a, lora_b, scale)``, the same values and gradients;
    on the Triton path the activation silu(gate) * up is not kept for backward (recomputed there for dA)."""
    if (
        _use_triton(gate)
        and _supported(gate, up, weight, bias, lora_a, lora_b)
        and gate.shape == up.shape
        and not _trainable(weight, bias)
    ):
        return _impl("lora_linear").swiglu_lora_linear(gate, up, weight, bias, lora_a, lora_b, scale)
    return lora_linear(swiglu(gate, up), weight, bias, lora_a, lora_b, scale)


def lora_linear_group(
    x: torch.Tensor,
    members: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, float]],
) -> list[torch.Tensor]:
    """LoRA linears sharing x (q/k/v, gate/up), members (weight, bias, lora_a, lora_b, scale): one shrink."""
    tensors = [t for m in members for t in m[:4]]
    frozen = [t for m in members for t in m[:2]]
    if _use_triton(x) and _supported(x, *tensors) and not _trainable(*frozen):
        return _impl("lora_linear").lora_linear_group(x, members)
    return reference.lora_linear_group(x, members)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses fp32, #valid tokens) of hidden [N, H] through the frozen head weight [V, H]."""
    if _use_triton(hidden) and _supported(hidden, weight) and not weight.requires_grad:
        return _impl("linear_cross_entropy").linear_cross_entropy(hidden, weight, labels, ignore_index)
    return reference.linear_cross_entropy(hidden, weight, labels, ignore_index)


class _KernelsModule(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # The import system binds a loaded submodule as an attribute of its package; for the op files
        # that would replace the dispatching function of the same name, so keep the function.
        if isinstance(value, types.ModuleType) and isinstance(self.__dict__.get(name), types.FunctionType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsModule
