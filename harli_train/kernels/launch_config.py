"""Launch configurations of every Triton kernel, from one cached function keyed by shape and SM count.

Importing this module needs torch only (no triton), so the dispatcher works where triton is absent.
The trainer may own only a slice of the GPU (a green context of N SMs). Persistent grids are sized for the
SMs it owns, so it says how many it has: `set_num_sms(n)` process-wide, or `with sm_budget(n):` for the
current thread / task only. The backward of every kernel's autograd Function runs under the budget its
forward saw (see `with_forward_budget`). Configs are fixed (no blanket `@triton.autotune`) so graph
capture and timings stay reproducible.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# H200 / H100 SXM count, used where no CUDA device is visible (CPU tests under the interpreter).
DEFAULT_NUM_SMS = 132
# The fused linear + cross-entropy keeps one [chunk, vocab] logits buffer alive: cap it near 1 GiB.
LOGITS_CHUNK_BYTES = 1 << 30

_process_num_sms: int | None = None
_launch_gate: Callable[[], None] | None = None
_budget: contextvars.ContextVar[int | None] = contextvars.ContextVar("harli_sm_budget", default=None)


@functools.cache
def device_num_sms() -> int:
    """SM count of the current CUDA device, or DEFAULT_NUM_SMS without one."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return DEFAULT_NUM_SMS


def set_num_sms(n: int | None) -> None:
    """Tell every launcher in this process how many SMs the trainer owns (None: the whole device)."""
    global _process_num_sms
    if n is not None and n < 1:
        raise ValueError(f"set_num_sms: need at least 1 SM, got {n}")
    _process_num_sms = n


def num_sms() -> int:
    """SMs the launchers size their grids for: the innermost `sm_budget`, else `set_num_sms`, else all."""
    budget = _budget.get()
    if budget is not None:
        return budget
    return _process_num_sms if _process_num_sms is not None else device_num_sms()


@contextmanager
def sm_budget(n: int) -> Iterator[None]:
    """Size grids for `n` SMs inside the block (thread- and task-local, nests)."""
    if n < 1:
        raise ValueError(f"sm_budget: need at least 1 SM, got {n}")
    token = _budget.set(n)
    try:
        yield
    finally:
        _budget.reset(token)


def set_launch_gate(gate: Callable[[], None] | None) -> Callable[[], None] | None:
    """Install ``gate``, called by every launcher before it launches (None: none); returns the previous one.

    The co-location runtime installs one that holds the trainer's launches back while the decode thread
    launches a step, so that the two threads do not take turns on the GIL inside decode's critical path
    (``harli_train.colocate.host_priority``)."""
    global _launch_gate
    previous, _launch_gate = _launch_gate, gate
    return previous


def launch_gate() -> None:
    """Every launcher calls this right before its kernel launch."""
    gate = _launch_gate
    if gate is not None:
        gate()


def with_forward_budget(backward: Callable) -> Callable:
    """Decorates an autograd Function's backward to run under the SM budget its forward saved in ctx.num_sms.

    Autograd runs each CUDA backward node on its own worker thread (a thread-local budget does not reach
    it) and on the stream its forward ran on, i.e. inside the forward's partition: that budget is the one.
    """

    @functools.wraps(backward)
    def run(ctx, *grads):
        with sm_budget(ctx.num_sms):
            return backward(ctx, *grads)

    return run


def _pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_warps(block: int) -> int:
    # One program streams one row of `block` elements: ~8-16 elements per thread (Liger's settings).
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@functools.cache
def get_config(op: str, shape: tuple, num_sms: int, dtype: torch.dtype) -> dict:
    """Block sizes, warps, stages and grid sizes of `op` at `shape` on `num_sms` SMs (cached; read-only).

    shape per op: rms_norm (rows, H); rope (rows, q_heads, kv_heads, head_dim); swiglu (rows, cols);
    lora_shrink (M, K, R) for [M, K] @ [K, R]; lora_expand (M, N, R) for [M, R] @ [R, N];
    cross_entropy (rows, vocab); linear_cross_entropy (N, H, vocab).
    """
    if op == "rms_norm":
        rows, hidden = shape
        block = _pow2(hidden)
        warps = _row_warps(block)
        # Enough resident programs to hide latency (~32 warps per SM), each looping over its rows.
        return dict(BLOCK_H=block, num_warps=warps, num_programs=max(1, min(rows, num_sms * (32 // warps))))
    if op == "rope":
        rows, q_heads, kv_heads, head_dim = shape
        block_half = _pow2(head_dim // 2)
        warps = 4 if _pow2(q_heads) * block_half <= 2048 else 8
        return dict(
            BLOCK_QH=_pow2(q_heads),
            BLOCK_KH=_pow2(kv_heads),
            BLOCK_HALF=block_half,
            num_warps=warps,
            num_programs=max(1, min(rows, num_sms * 8)),
        )
    if op == "swiglu":
        _, cols = shape
        # Elementwise: a plain grid of (row, column block); the hardware scheduler fills whatever SMs we own.
        return dict(BLOCK_N=min(_pow2(cols), 1024), num_warps=4)
    if op == "lora_shrink":
        m, k, r = shape
        block_m = 16 if m <= 16 else 32 if m <= 8192 else 64
        block_r = min(max(16, _pow2(r)), 128)
        block_k = 64 if dtype == torch.float32 else 128 if block_r <= 32 else 64
        tiles = _cdiv(m, block_m) * _cdiv(r, block_r)
        # Under half a wave of tiles (few tokens, or many SMs), split K (the long `in` dimension) to fill
        # about one wave, each split keeping >= 4 K-blocks; the fp32 partials are summed in a fixed order
        # (deterministic). Training-sized M needs no split, which saves the two reduction ops.
        k_blocks = _cdiv(k, block_k)
        split_k = max(1, min(_cdiv(num_sms, tiles), k_blocks // 4)) if 2 * tiles < num_sms else 1
        return dict(
            BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, SPLIT_K=split_k, num_warps=4, num_stages=3
        )
    if op == "lora_expand":
        m, n, r = shape
        block_m, block_n, warps = (16, 64, 4) if m <= 16 else (64, 128, 8)
        tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
        # ~80 registers a thread at 8 warps (sm_90): 2-3 programs fit per SM, so 2 per SM stay resident.
        return dict(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_R=min(max(16, _pow2(r)), 64),
            num_warps=warps,
            num_stages=2,
            num_programs=max(1, min(tiles, num_sms * 2)),
        )
    if op == "cross_entropy":
        rows, vocab = shape
        block = min(_pow2(vocab), 8192)
        warps = _row_warps(block)
        return dict(BLOCK_V=block, num_warps=warps, num_programs=max(1, min(rows, num_sms * (32 // warps))))
    if op == "linear_cross_entropy":
        n, _, vocab = shape
        row_bytes = vocab * torch.empty((), dtype=dtype).element_size()
        chunk = max(16, 1 << max(0, (LOGITS_CHUNK_BYTES // row_bytes).bit_length() - 1))
        return dict(CHUNK_N=min(chunk, _pow2(n)))
    raise KeyError(f"get_config: unknown op {op!r}")
