"""Llama-family decoder (Llama 2/3, Mistral, Qwen2 with qkv bias),
shared by the trainer and the decode engine.

Module names follow transformers' `LlamaForCausalLM`, so checkpoints load without renaming and adapters
export under peft's key names. Attention runs through torch SDPA (causal, whole sequences) unless the caller
passes an `attn_ctx` (`attn_ctx.attend(layer_idx, q, k, v) -> o`, all [B, T, heads, head_dim]): the decode
engine's per-step object that stores K/V in its paged cache and attends over it, or the trainer's
`DocumentAttention` for packed rows (block-diagonal causal, with `positions` restarting per document).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from harli_train import kernels
from harli_train.model.attention import causal_attention
from harli_train.model.config import ModelConfig
from harli_train.model.linear import LoRALinear, grouped_forward
from harli_train.model.rope import RotaryEmbedding

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # With a residual, returns (norm(x + residual), x + residual): the add is fused into the norm kernel.
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = LoRALinear(cfg.hidden_size, cfg.q_size, bias=bias)
        self.k_proj = LoRALinear(cfg.hidden_size, cfg.kv_size, bias=bias)
        self.v_proj = LoRALinear(cfg.hidden_size, cfg.kv_size, bias=bias)
        self.o_proj = LoRALinear(cfg.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attn_ctx: AttentionContext | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = grouped_forward(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        q, k = kernels.apply_rope(q, k, cos, sin)
        o = causal_attention(q, k, v) if attn_ctx is None else attn_ctx.attend(self.layer_idx, q, k, v)
        return self.o_proj(o.reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = LoRALinear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = LoRALinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_forward(x, (self.gate_proj, self.up_proj))
        down = self.down_proj
        if down.fusable:
            # down's input, silu(gate) * up, is recomputed in backward rather than kept.
            return kernels.swiglu_lora_linear(
                gate, up, down.weight, down.bias, down.lora_A, down.lora_B, down.scale
            )
        return down(kernels.swiglu(gate, up))


class DecoderLayer(nn.Module):
    """Pre-norm block. Takes and returns (hidden, residual) so each residual add fuses into the next norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, attn_ctx: AttentionContext | None = None):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, attn_ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class LlamaForCausalLM(nn.Module):
    """The whole model. `forward` returns final hidden states; `logits` applies the (frozen) head."""

    tensor_parallel = 1  # ranks the model is split over (harli_train.parallel: this object is one slice)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # Pieces, so that a trainer can run the layers in chunks (micro-steps).
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rotary_emb(positions)

    def run_layers(self, start: int, stop: int, hidden, residual, cos, sin, attn_ctx=None):
        for layer in self.model.layers[start:stop]:
            hidden, residual = layer(hidden, residual, cos, sin, attn_ctx)
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return self.model.norm(hidden)
        return self.model.norm(hidden, residual)[0]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, attn_ctx: Any = None
    ) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        cos, sin = self.rope(positions)
        hidden, residual = self.run_layers(
            0, self.config.num_layers, self.embed(input_ids), None, cos, sin, attn_ctx
        )
        return self.final_norm(hidden, residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def token_loss(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Sum of the token losses (fp32) of hidden [N, H] through the frozen head; labels [N] shifted.
        The fused kernel never materialises the [N, vocab] logits."""
        return kernels.linear_cross_entropy(hidden, self.lm_head.weight, labels, ignore_index)[0]

    def empty_like(self) -> LlamaForCausalLM:
        """A model of this class and shape on the meta device, with no adapter (``base_view`` fills it)."""
        with torch.device("meta"):
            return LlamaForCausalLM(self.config)

    # LoRA management.
    def lora_modules(self, targets=LORA_TARGETS) -> dict[str, LoRALinear]:
        """Projection layers whose short name is in `targets`, keyed by their full module path."""
        return {
            name: m
            for name, m in self.named_modules()
            if isinstance(m, LoRALinear) and name.rsplit(".", 1)[-1] in targets
        }

    def add_lora(self, rank: int, alpha: float, dropout: float, targets=LORA_TARGETS, seed: int = 0) -> None:
        gen = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        for m in self.lora_modules(targets).values():
            m.add_lora(rank, alpha, dropout, generator=gen)

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.lora_modules().values() if m.has_lora for p in (m.lora_A, m.lora_B)]
