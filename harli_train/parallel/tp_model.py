"""One rank's slice of a Llama model, with its collectives: the trainer's and the engine's model under TP.

``TPLlamaForCausalLM`` is a ``LlamaForCausalLM`` of the local shape (``sharding.local_config``) whose
attention and MLP blocks sum their row-parallel outputs over the rank group (``collectives``), whose LM head
holds this rank's vocabulary rows (``logits`` gathers them; ``token_loss`` is the vocab-parallel
cross-entropy), and whose LoRA factors live with their base layer's slice (``sharding.lora_shard_dim``).
The trainer and the engine each get a module tree over the same weight tensors,
bound to their own group (``empty_like``).

The adapter equals the single-process one: ``add_lora`` draws every full factor in the same order with the
same generator and keeps this rank's slice, gradients of the factors every rank holds whole are summed over
the ranks after the backward (each rank saw only its slice's part), and the gradient norm sums the squares
of the split factors over the ranks and counts the whole ones once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from harli_train.model.config import ModelConfig
from harli_train.model.linear import LoRALinear
from harli_train.model.llama import LORA_TARGETS, MLP, Attention, LlamaForCausalLM
from harli_train.parallel.collectives import all_gather_last, all_reduce, copy_to_ranks, reduce_from_ranks
from harli_train.parallel.group import TPGroups
from harli_train.parallel.sharding import (
    load_shards,
    local_config,
    lora_shard_dim,
    take_shard,
    vocab_shard,
)
from harli_train.parallel.vocab_loss import vocab_parallel_loss


class TPAttention(Attention):
    """Column-parallel q/k/v over this rank's heads, row-parallel o, summed over ``group``."""

    group: Any = None

    def forward(self, x, cos, sin, attn_ctx=None):
        return reduce_from_ranks(
            super().forward(copy_to_ranks(x, self.group), cos, sin, attn_ctx), self.group
        )


class TPMLP(MLP):
    """Column-parallel gate/up over this rank's slice of the intermediate size, row-parallel down."""

    group: Any = None

    def forward(self, x):
        return reduce_from_ranks(super().forward(copy_to_ranks(x, self.group)), self.group)


class TPLlamaForCausalLM(LlamaForCausalLM):
    """Rank ``tp.rank``'s slice; ``config`` is the local shape, ``full_config`` the model's."""

    def __init__(self, full_config: ModelConfig, tp: TPGroups, group: Any):
        super().__init__(local_config(full_config, tp.world))
        self.full_config, self.tp, self.group = full_config, tp, group
        self.tensor_parallel = tp.world
        rows = vocab_shard(full_config.vocab_size, tp.world)
        self.vocab_start = tp.rank * rows
        self.vocab_valid = max(0, min(rows, full_config.vocab_size - self.vocab_start))
        self.lm_head = nn.Linear(full_config.hidden_size, rows, bias=False)
        self.lm_head.weight.requires_grad_(False)
        for layer in self.model.layers:
            layer.self_attn.__class__, layer.mlp.__class__ = TPAttention, TPMLP
            layer.self_attn.group = layer.mlp.group = group

    def empty_like(self) -> TPLlamaForCausalLM:
        """The same slice on the meta device, bound to the *engine*'s group: the serving view
        (``colocate.shared_model.base_view``) runs its collectives apart from the trainer's."""
        with torch.device("meta"):
            return TPLlamaForCausalLM(self.full_config, self.tp, self.tp.engine)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [..., V] on every rank (an all-gather of the ranks' rows)."""
        local = self.lm_head(hidden)
        if local.numel() == 0:  # no row samples (the same on every rank): nothing to exchange
            return local.new_empty((*local.shape[:-1], self.full_config.vocab_size))
        return all_gather_last(local, self.group, self.tp.world)[..., : self.full_config.vocab_size]

    def token_loss(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        return vocab_parallel_loss(
            hidden,
            self.lm_head.weight,
            labels,
            self.vocab_start,
            self.vocab_valid,
            self.tp.train,
            ignore_index,
        )

    # ---- LoRA across ranks -----------------------------------------------------------------------------
    def add_lora(self, rank: int, alpha: float, dropout: float, targets=LORA_TARGETS, seed: int = 0) -> None:
        """The single-process adapter's slices: A ~ kaiming-uniform drawn whole (bound 1/sqrt(full in)),
        module by module in the same order, B = 0."""
        gen = torch.Generator(device=self.lm_head.weight.device).manual_seed(seed)
        for name, m in self.lora_modules(targets).items():
            full_in = m.in_features * (self.tp.world if lora_shard_dim(name, "lora_A") == 1 else 1)
            m.add_lora(rank, alpha, dropout)
            a = torch.empty(rank, full_in, dtype=torch.float32, device=m.weight.device)
            bound = 1.0 / math.sqrt(full_in)
            a.uniform_(-bound, bound, generator=gen)
            m.lora_A = nn.Parameter(
                take_shard(a, lora_shard_dim(name, "lora_A"), self.tp.rank, self.tp.world).clone()
            )

    def lora_factors(self) -> list[tuple[str, str, nn.Parameter]]:
        """(module name, 'lora_A' | 'lora_B', parameter) of every attached factor, in parameter order."""
        return [
            (name, which, getattr(m, which))
            for name, m in self.lora_modules().items()
            if m.has_lora
            for which in ("lora_A", "lora_B")
        ]

    def sync_lora_grads(self) -> None:
        """Sum over the ranks the gradients of the factors every rank holds whole (one all-reduce)."""
        grads = [
            p.grad for n, w, p in self.lora_factors() if lora_shard_dim(n, w) is None and p.grad is not None
        ]
        if not grads:
            return
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.tp.train)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    def clip_lora_grads(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the whole adapter: its global norm (the split factors'
        squares summed over the ranks, the whole ones once), every factor scaled by the same coefficient."""
        factors = [
            (lora_shard_dim(n, w) is not None, p) for n, w, p in self.lora_factors() if p.grad is not None
        ]
        device = self.lm_head.weight.device
        split = torch.zeros((), dtype=torch.float32, device=device)
        whole = torch.zeros((), dtype=torch.float32, device=device)
        for is_split, p in factors:
            sq = p.grad.detach().float().pow(2).sum()
            split, whole = (split + sq, whole) if is_split else (split, whole + sq)
        total = (all_reduce(split, self.tp.train) + whole).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for _, p in factors:
            p.grad.mul_(coef.to(p.grad.dtype))
        return total

    def gather_factor(self, name: str, which: str, t: torch.Tensor) -> torch.Tensor:
        """The whole factor (or a tensor of its shape, e.g. an optimizer moment) from the ranks' slices."""
        dim = lora_shard_dim(name, which)
        if dim is None:
            return t
        if dim == 1:
            return all_gather_last(t.contiguous(), self.tp.train, self.tp.world)
        return all_gather_last(t.t().contiguous(), self.tp.train, self.tp.world).t().contiguous()

    def full_adapter_view(self) -> LlamaForCausalLM:
        """A meta-device model of the full shape carrying the whole adapter (gathered from every rank:
        collective), for the single-process adapter and checkpoint writers."""
        with torch.device("meta"):
            view = LlamaForCausalLM(self.full_config)
        full = view.lora_modules()
        for name, m in self.lora_modules().items():
            if not m.has_lora:
                continue
            target: LoRALinear = full[name]
            target.rank, target.alpha, target.dropout = m.rank, m.alpha, m.dropout
            target.lora_A = nn.Parameter(self.gather_factor(name, "lora_A", m.lora_A.detach()))
            target.lora_B = nn.Parameter(self.gather_factor(name, "lora_B", m.lora_B.detach()))
        return view


def load_tp_model(
    source: str, dtype: torch.dtype, tp: TPGroups, seed: int = 0, serving: bool = False
) -> TPLlamaForCausalLM:
    """Rank ``tp.rank``'s slice of ``source`` (preset or HF directory) on its device, frozen, in eval mode,
    bound to the trainer's group, or with ``serving`` the engine's (``empty_like`` gives a serving view)."""
    from harli_train.model.loader import model_config

    full_cfg = model_config(source)
    with torch.device("meta"):
        model = TPLlamaForCausalLM(full_cfg, tp, tp.engine if serving else tp.train)
    model = model.to_empty(device=tp.device).to(dtype)
    model.model.rotary_emb.__init__(model.config)
    model.model.rotary_emb.to(tp.device)
    load_shards(model, full_cfg, source, seed, tp.rank, tp.world)
    if full_cfg.tie_word_embeddings:
        rows = vocab_shard(full_cfg.vocab_size, tp.world)
        with torch.no_grad():
            model.lm_head.weight.copy_(
                take_shard(model.model.embed_tokens.weight, 0, tp.rank, tp.world, rows)
            )
    return model.eval()
