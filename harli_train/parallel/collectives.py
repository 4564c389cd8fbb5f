"""The two communication operators of Megatron-style tensor parallelism, as autograd functions.

A column-parallel projection takes a replicated input and produces its rank's slice of the output; a
row-parallel one takes a slice and produces a partial sum. So a block (attention, MLP) is
``reduce(block_local(copy(x)))``: ``copy`` is the identity forward and sums the input's gradient over the
ranks backward (each rank's slice contributed a part of it); ``reduce`` sums the partial outputs forward and
is the identity backward (the sum is replicated, so is its gradient).

``local_only()`` turns every collective of this thread into a no-op: a warm-up or a profiling load that
only needs the kernels' work, not their results, then runs on one rank without the others.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

_local = threading.local()


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """Within the block, this thread's tensor-parallel collectives do nothing (results are then wrong)."""
    before = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = before


def collectives_on() -> bool:
    return not getattr(_local, "off", False)


def all_reduce(t: torch.Tensor, group: Any, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place sum (or ``op``) of ``t`` over ``group``; returns ``t``."""
    if collectives_on():
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_last(t: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """The ranks' ``t`` [..., n] concatenated along the last dim in rank order: [..., world * n]."""
    if not collectives_on():
        return torch.cat([t] * world, dim=-1)
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_ranks(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward; the gradient is summed over ``group`` backward
    (the input of column-parallel work)."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return x
    return _Copy.apply(x, group)


def reduce_from_ranks(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over ``group`` forward; identity backward (the output of row-parallel work)."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return all_reduce(x.contiguous(), group)
    return _Reduce.apply(x, group)
