"""Causal self-attention over whole rows, as training runs it: plain causal, or block-diagonal causal for rows
that pack several documents.

Both go through torch SDPA. With a mask SDPA takes its memory-efficient (or math) kernel instead of
flash-attention, at the cost of a [B, 1, T, T] boolean mask built once per batch and shared by the layers;
it is the path that runs on every torch and device this project supports. The decode engine brings its own
attention (`harli_train.engine.attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of q [B, T, Hq, D] over k, v [B, T, Hk, D] (Hq a multiple of Hk) -> [B, T, Hq, D]: causal, or
    where `mask` [B, 1, T, T] (bool, True = may attend) allows; a mask must allow each token itself."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)


class DocumentAttention:
    """The attention context of packed rows (`LlamaForCausalLM`'s `attn_ctx`): token i of a row attends to
    token j iff j <= i and both belong to the same document.

    `doc_ids` [B, T] (integers) says which document each token belongs to; only equality within a row
    counts, and a document's tokens are contiguous. The mask is built here, once for all layers, by tensor
    operations of fixed shape and no host synchronisation, so that a CUDA graph can capture it with
    `doc_ids` in a static buffer. Costs B * T * T bytes (1 MiB for 4 x 512).
    """

    def __init__(self, doc_ids: torch.Tensor):
        assert doc_ids.dim() == 2, f"doc_ids must be [B, T], got {tuple(doc_ids.shape)}"
        t = doc_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
        self.mask = ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, self.mask)
