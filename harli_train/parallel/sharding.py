"""Which slice of each weight a rank holds, and loading a model's weights straight into those slices.

Megatron's split: q/k/v and gate/up are column-parallel (their output rows split, heads in contiguous blocks,
so rank r holds query heads [r H/N, (r+1) H/N) and the KV heads they read); o and down are row-parallel (their
input columns split the same way); norms and the embedding are replicated; the LM head is vocab-parallel
(its rows split, the vocabulary padded to a multiple of N with rows of zeros whose logits are masked).
A rank's model is then an ordinary ``LlamaForCausalLM`` of the *local* shape (``local_config``), so every
kernel runs on it unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from harli_train.model.config import PRESETS, ModelConfig, ModelError
from harli_train.model.llama import LlamaForCausalLM

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output split: weight dim 0, bias
ROW = ("o_proj", "down_proj")  # input split: weight dim 1


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shape of one rank's slice of ``cfg`` (the vocabulary stays whole: the embedding is replicated)."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        intermediate_size=cfg.intermediate_size // world,
        head_dim=cfg.head_dim,
        where="model config",
    )


def vocab_shard(vocab: int, world: int) -> int:
    """Rows of the LM head per rank: the vocabulary padded up to a multiple of ``world``."""
    return -(-vocab // world)


def shard_dim(name: str) -> int | None:
    """The dim of full tensor ``name`` (a base weight or bias) that ranks split, or None: replicated."""
    parts = name.split(".")
    leaf, owner = parts[-1], parts[-2] if len(parts) > 1 else ""
    if name == "lm_head.weight":
        return 0
    if owner in COLUMN:
        return 0
    if owner in ROW and leaf == "weight":
        return 1
    return None


def lora_shard_dim(module_name: str, which: str) -> int | None:
    """The dim of a LoRA factor (``which``: lora_A [r, in] or lora_B [out, r]) that ranks split: B of a
    column-parallel layer along its output, A of a row-parallel one along its input; the other is whole."""
    short = module_name.rsplit(".", 1)[-1]
    if short in COLUMN and which == "lora_B":
        return 0
    if short in ROW and which == "lora_A":
        return 1
    return None


def take_shard(full: torch.Tensor, dim: int | None, rank: int, world: int, rows: int = 0) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim`` (None: all of it). ``rows``: the padded slice size
    (the LM head); the missing rows of the last ranks are zeros."""
    if dim is None:
        return full
    size = rows or full.shape[dim] // world
    start = rank * size
    have = max(0, min(size, full.shape[dim] - start))
    if have == size:
        return full.narrow(dim, start, size)
    shape = list(full.shape)
    shape[dim] = size
    out = full.new_zeros(shape)
    if have:
        out.narrow(dim, 0, have).copy_(full.narrow(dim, start, have))
    return out


def _full_shapes(cfg: ModelConfig) -> list[tuple[str, torch.Size]]:
    """The full model's parameters in ``named_parameters`` order, on the meta device (no memory)."""
    with torch.device("meta"):
        full = LlamaForCausalLM(cfg)
    return [(n, p.shape) for n, p in full.named_parameters()]


@torch.no_grad()
def load_shards(
    model: LlamaForCausalLM, full_cfg: ModelConfig, source: str, seed: int, rank: int, world: int
):
    """Fill rank ``rank``'s ``model`` (local shape, materialised) with its slices of ``source``'s weights:
    a preset's seeded random weights drawn exactly as the single-process loader draws them (each full
    tensor in turn on the rank's device, then sliced),
    or an HF directory's safetensors read slice by slice."""
    params = dict(model.named_parameters())
    rows = vocab_shard(full_cfg.vocab_size, world)
    if source in PRESETS:
        device = model.lm_head.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = model.lm_head.weight.dtype
        for name, shape in _full_shapes(full_cfg):
            full = torch.empty(shape, dtype=dtype, device=device)
            # As model.loader.init_random_weights, in the same order, so the draws are the same.
            if name == "lm_head.weight":
                full.normal_(0.0, full_cfg.hidden_size**-0.5, generator=gen)
            elif name.endswith("norm.weight"):
                full.fill_(1.0)
            elif name.endswith(".bias"):
                full.zero_()
            else:
                full.normal_(0.0, 0.02, generator=gen)
            if name in params:
                pad = rows if name == "lm_head.weight" else 0
                params[name].copy_(take_shard(full, shard_dim(name), rank, world, pad))
        return
    _load_hf_shards(params, Path(source).expanduser(), full_cfg, rank, world, rows)


def _load_hf_shards(params, path: Path, cfg: ModelConfig, rank: int, world: int, rows: int) -> None:
    from safetensors import safe_open

    from harli_train.model.loader import shard_files

    loaded = set()
    for file in shard_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in params:
                    if "rotary_emb" in key:
                        continue
                    raise ModelError(f"{file}: unexpected tensor {key!r} (not a Llama-family weight)")
                dim = shard_dim(key)
                view = f.get_slice(key)
                if dim is None or (key == "lm_head.weight"):
                    t = take_shard(f.get_tensor(key), dim, rank, world, rows)
                else:
                    size = view.get_shape()[dim] // world
                    index = [slice(None)] * len(view.get_shape())
                    index[dim] = slice(rank * size, (rank + 1) * size)
                    t = view[tuple(index)]
                if t.shape != params[key].shape:
                    raise ModelError(f"{file}: {key} has a shape that does not fit the model's config")
                params[key].copy_(t)
                loaded.add(key)
    missing = [
        k for k in params if k not in loaded and not (k == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if missing:
        raise ModelError(f"model directory {path}: weights missing for {missing[:5]}")
