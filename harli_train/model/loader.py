"""Build a model from a named preset (seeded random weights) or a local Hugging Face directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from harli_train.model.config import PRESETS, ModelConfig, ModelError
from harli_train.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on a GPU and fp32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ModelError(f"unknown dtype {name!r} (expected one of auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]


def is_preset(source: str) -> bool:
    return source in PRESETS


def model_config(source: str) -> ModelConfig:
    if source in PRESETS:
        return ModelConfig(**{**PRESETS[source].to_dict()})
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelError(
            f"model {source!r} is neither a preset ({', '.join(PRESETS)}) nor an existing directory"
        )
    return ModelConfig.from_hf_dir(path)


def load_model(
    source: str, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> LlamaForCausalLM:
    """The frozen base model in `dtype` on `device`, in eval mode, with no adapter attached."""
    device = torch.device(device)
    cfg = model_config(source)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    # to_empty leaves buffers uninitialised: recompute the rope table.
    model.model.rotary_emb.__init__(cfg)
    model.model.rotary_emb.to(device)
    if source in PRESETS:
        log.warning(
            "model %r is a preset with RANDOM weights (seed %d): for benchmarks and tests only", source, seed
        )
        init_random_weights(model, seed)
    else:
        load_hf_weights(model, Path(source).expanduser())
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Seeded N(0, std) weights (transformers' initializer_range), ones for norms, zeros for biases.

    An untied head gets std 1/sqrt(hidden) instead: with std 0.02 behind a frozen unit-weight norm the logits
    of a small preset cannot spread enough for an adapter to push the loss below ~3 nats.
    """
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            p.normal_(0.0, model.config.hidden_size**-0.5, generator=gen)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of HF directory `path`: the index's shards, model.safetensors, or every
    *.safetensors file; ModelError when there are none or the index is not one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON, UTF-8, or its shape
            raise ModelError(
                f'{index}: not a safetensors index (expected {{"weight_map": {{tensor: file}}}}; '
                f"{type(e).__name__}: {e})"
            ) from None
        if not all(isinstance(s, str) for s in shards):
            raise ModelError(f"{index}: weight_map values must be file names")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ModelError(
            f"model directory {path}: no weights found (looked for model.safetensors, "
            "model.safetensors.index.json and *.safetensors)"
        )
    return found


@torch.no_grad()
def load_hf_weights(model: LlamaForCausalLM, path: Path) -> None:
    from safetensors import SafetensorError

    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for shard in shard_files(path):
        if not shard.is_file():
            raise ModelError(f"model directory {path}: shard {shard.name} listed in the index is missing")
        try:
            loaded |= _load_shard(shard, params)
        except SafetensorError as e:  # the header or the data ends early, or is not safetensors at all
            raise ModelError(
                f"{shard}: not a readable safetensors file ({e}); it may be truncated (an interrupted "
                "download or copy)"
            ) from None
    missing = [
        k
        for k in params
        if k not in loaded and not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    ]
    if missing:
        raise ModelError(
            f"model directory {path}: weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )


def _load_shard(shard: Path, params: dict[str, torch.nn.Parameter]) -> set[str]:
    """Copy the tensors of one safetensors file into `params`; returns the names it loaded."""
    from safetensors import safe_open

    loaded = set()
    with safe_open(str(shard), framework="pt", device="cpu") as f:
        for key in f.keys():
            if key not in params:
                if "rotary_emb" in key:
                    continue
                raise ModelError(f"{shard}: unexpected tensor {key!r} (not a Llama-family weight)")
            t = f.get_tensor(key)
            if t.shape != params[key].shape:
                raise ModelError(
                    f"{shard}: {key} has shape {tuple(t.shape)}, expected {tuple(params[key].shape)}"
                )
            params[key].copy_(t)
            loaded.add(key)
    return loaded
