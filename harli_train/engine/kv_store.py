"""Write the new tokens' K and V into their slots of the paged cache (Triton kernel and launcher)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(
    k_ptr,
    v_ptr,  # [T, Hkv * D] (row stride stride_kt / stride_vt, unit column stride)
    k_cache_ptr,
    v_cache_ptr,  # [num_blocks * block_size, Hkv * D] (a layer's cache, slot-major)
    slot_ptr,  # [T] int64: slot of each token, -1 = padding (nothing written)
    stride_kt,
    stride_vt,
    stride_slot,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    slots = tl.full([BLOCK], 0, tl.int64) + slot
    mask = (cols < ROW) & (slots >= 0)
    dst = tl.maximum(slots, 0) * stride_slot + cols
    k = tl.load(k_ptr + t * stride_kt + cols, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + cols, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def kv_store(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [T, Hkv, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; slot_mapping [T] (-1: skip)."""
    t, hkv, d = k.shape
    assert v.shape == k.shape and k_cache.shape[-2:] == (hkv, d) and v_cache.shape == k_cache.shape
    assert k.dtype == k_cache.dtype, f"kv_store: k is {k.dtype}, cache is {k_cache.dtype}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (t,)
    if t == 0:
        return
    k2, v2 = k.reshape(t, hkv * d), v.reshape(t, hkv * d)
    if k2.stride(1) != 1:
        k2 = k2.contiguous()
    if v2.stride(1) != 1:
        v2 = v2.contiguous()
    row = hkv * d
    _kv_store_kernel[(t,)](
        k2,
        v2,
        k_cache,
        v_cache,
        slot_mapping,
        k2.stride(0),
        v2.stride(0),
        row,
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        num_warps=4 if row <= 2048 else 8,
    )
