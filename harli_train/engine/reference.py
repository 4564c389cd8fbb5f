"""Plain-torch references of the engine kernels: the numerics the Triton ops must match, and the CPU path.

Same contracts as `kv_store.kv_store`, `paged_decode.paged_decode` and `paged_prefill.paged_prefill`. This
module imports no Triton, so the engine (and everything importing it) leaves the kernels undecorated until
the Triton backend is chosen; TRITON_INTERPRET set by a test after `import harli_train.engine` still counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harli_train.kernels.reference import apply_rope as _rope

# The newest token of each sequence: K [B, Hkv, D], V [B, Hkv, D], cache slot [B] int64 (-1: not stored).
NewKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def kv_store_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as `kv_store`, in plain torch."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[-2:])[slots] = k[valid]
    v_cache.view(-1, *v_cache.shape[-2:])[slots] = v[valid]


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's K or V, unpaged: [length, Hkv, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_sms: int = 0,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    new_kv: NewKV | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Same contract as `paged_decode`: rotate q and the new k by `rope`, store `new_kv`, then SDPA per
    sequence over its gathered context."""
    if rope is not None:
        assert new_kv is not None, "rope rotates the new k: pass new_kv too"
        cos, sin = (t[: q.shape[0], None] for t in rope)  # [B, 1, D]: one position per sequence
        q_rot, k_rot = _rope(q[:, None], new_kv[0][:, None], cos, sin)
        q, new_kv = q_rot[:, 0], (k_rot[:, 0], new_kv[1], new_kv[2])
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        kv_store_reference(k_new, v_new, k_cache, v_cache, slots[: q.shape[0]])
    out = torch.zeros_like(q) if out is None else out.zero_()
    for i, n in enumerate(context_lens.tolist()[: q.shape[0]]):
        if n == 0:
            continue
        k = gather_context(k_cache, block_tables[i], n).transpose(0, 1).float()
        v = gather_context(v_cache, block_tables[i], n).transpose(0, 1).float()
        o = F.scaled_dot_product_attention(q[i, :, None].float(), k, v, scale=scale, enable_gqa=True)
        out[i] = o[:, 0].to(q.dtype)
    return out


def paged_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `paged_prefill`: SDPA per sequence with the causal mask shifted by its prefix."""
    out = torch.empty_like(q) if out is None else out
    cu = cu_seqlens.tolist()
    for i, n in enumerate(context_lens.tolist()):
        lo, hi = cu[i], cu[i + 1]
        prefix = n - (hi - lo)
        k = gather_context(k_cache, block_tables[i], n).transpose(0, 1).float()
        v = gather_context(v_cache, block_tables[i], n).transpose(0, 1).float()
        q_pos = torch.arange(prefix, n, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1).float(), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[lo:hi] = o.transpose(0, 1).to(q.dtype)
    return out
