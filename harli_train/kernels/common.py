"""Helpers shared by the launchers: output allocation (poisonable in tests) and the compute-dtype rule."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_poison = False


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer the kernel fully overwrites: uninitialised, or NaN inside `poison_outputs()`."""
    if _poison and dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@contextmanager
def poison_outputs() -> Iterator[None]:
    """Tests: fill every kernel-written buffer with NaN first, so a missed element shows up."""
    global _poison
    prev, _poison = _poison, True
    try:
        yield
    finally:
        _poison = prev


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype GEMMs run in: autocast's for x's device type when it is on, else x's own."""
    device_type = x.device.type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, in compile_check)
        return x.dtype
    return torch.get_autocast_dtype(device_type) if enabled else x.dtype


def check_dtype(name: str, t: torch.Tensor) -> None:
    assert t.dtype in SUPPORTED_DTYPES, f"{name}: dtype {t.dtype} not supported (fp32, fp16, bf16)"
