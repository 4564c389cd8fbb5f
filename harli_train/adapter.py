"""LoRA adapters in the PEFT format: `adapter_config.json` + `adapter_model.safetensors`, peft's key names.

peft stores `base_model.model.<module path>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r], with
scale = lora_alpha / r. Our module paths equal transformers' Llama ones, so the mapping is a prefix.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harli_train import durable
from harli_train.model.llama import LORA_TARGETS, LlamaForCausalLM

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter directory that cannot be loaded into this model."""


def adapter_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.lora_modules().items():
        if m.has_lora:
            out[f"{_PREFIX}{name}.lora_A.weight"] = m.lora_A.detach().float().cpu().contiguous()
            out[f"{_PREFIX}{name}.lora_B.weight"] = m.lora_B.detach().float().cpu().contiguous()
    return out


def _lora_settings(model: LlamaForCausalLM) -> tuple[int, float, float, list[str]]:
    mods = [m for m in model.lora_modules().values() if m.has_lora]
    if not mods:
        raise AdapterError("the model carries no LoRA adapter to save")
    targets = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.lora_modules().items() if m.has_lora}, key=LORA_TARGETS.index
    )
    return mods[0].rank, mods[0].alpha, mods[0].dropout, targets


def save_adapter(model: LlamaForCausalLM, out_dir: str | Path, base_model: str = "") -> Path:
    """Write the adapter so that `peft.PeftModel.from_pretrained(base, out_dir)` loads it.

    Raises OSError (naming the file) when a file cannot be written; each file is then left as it was.
    """
    from safetensors.torch import save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank, alpha, dropout, targets = _lora_settings(model)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "revision": None,
    }
    # Each file is replaced whole, so an interrupted save never leaves a half-written adapter.
    durable.write_file(out / WEIGHTS_NAME, save(adapter_state_dict(model), metadata={"format": "pt"}))
    durable.write_file(out / CONFIG_NAME, json.dumps(config, indent=2).encode())
    return out


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """An adapter read from disk and checked against a model: per projection (its full module path), the
    pair (A [r, in], B [out, r]) in the file's dtype; `config` is adapter_config.json as read."""

    config: dict[str, Any]
    rank: int
    alpha: float
    dropout: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def read_adapter(model: LlamaForCausalLM, adapter_dir: str | Path) -> AdapterWeights:
    """Read the adapter stored in `adapter_dir` (PEFT format) and check that it fits `model` (which may live
    on the meta device: only its module shapes are used). AdapterError (naming the file) for anything that
    does not fit. Loads the adapter's tensors only; the model is not touched."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(adapter_dir)
    cfg_path, w_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise AdapterError(f"adapter directory {path}: {p.name} not found")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(
            f"{cfg_path}: expected a JSON object (a PEFT LoRA config), got {type(config).__name__}"
        )
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_rslora") or config.get("use_dora"):
        raise AdapterError(f"{cfg_path}: rsLoRA / DoRA adapters are not supported")
    rank = _setting(config, cfg_path, "r", "the LoRA rank, an integer > 0", lambda v: _is_int(v) and v > 0)
    alpha = _setting(config, cfg_path, "lora_alpha", "a number > 0", lambda v: _is_number(v) and v > 0)
    dropout = _setting(
        config, cfg_path, "lora_dropout", "a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1, 0.0
    )
    try:
        state = load_file(str(w_path))
    except SafetensorError as e:
        raise AdapterError(
            f"{w_path}: not a readable safetensors file ({e}); it may be truncated (a save or copy cut short)"
        ) from None
    modules = model.lora_modules()
    found = {}
    for key, t in state.items():
        stem = key.removeprefix(_PREFIX)
        for suffix in (
            ".lora_A.weight",
            ".lora_B.weight",
            ".lora_A.default.weight",
            ".lora_B.default.weight",
        ):
            if stem.endswith(suffix):
                name, which = stem[: -len(suffix)], suffix.split(".")[1]
                break
        else:
            raise AdapterError(f"{w_path}: unexpected tensor {key!r}")
        if name not in modules:
            raise AdapterError(
                f"{w_path}: {key!r} names no projection layer of this model (adapter made for another model?)"
            )
        found.setdefault(name, {})[which] = t
    for name, pair in found.items():
        m = modules[name]
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{w_path}: {name} has only {sorted(pair)}")
        if pair["lora_A"].shape != (rank, m.in_features) or pair["lora_B"].shape != (m.out_features, rank):
            raise AdapterError(
                f"{w_path}: {name} has shapes {tuple(pair['lora_A'].shape)}/{tuple(pair['lora_B'].shape)}, "
                f"expected ({rank}, {m.in_features})/({m.out_features}, {rank}): "
                "adapter made for another model?"
            )
    if not found:
        raise AdapterError(f"{w_path}: no LoRA tensors in the file")
    pairs = {name: (pair["lora_A"], pair["lora_B"]) for name, pair in found.items()}
    return AdapterWeights(config, rank, float(alpha), float(dropout), pairs)


def load_adapter(model: LlamaForCausalLM, adapter_dir: str | Path) -> dict:
    """Attach the adapter stored in `adapter_dir` (PEFT format) to `model`; returns its config.
    AdapterError (naming the file) for anything that does not fit: the model is then left as it was."""
    adapter = read_adapter(model, adapter_dir)
    # Everything checked: only now touch the model, so a bad adapter leaves it as it was.
    modules = model.lora_modules()
    for name, (a, b) in adapter.pairs.items():
        m = modules[name]
        m.add_lora(adapter.rank, adapter.alpha, adapter.dropout)
        with torch.no_grad():
            m.lora_A.copy_(a)
            m.lora_B.copy_(b)
    return adapter.config


_MISSING = object()


def _setting(config: dict, path: Path, key: str, expected: str, ok: Callable[[Any], bool], default=_MISSING):
    """`config[key]` when `ok` accepts it (`default` when absent); AdapterError naming the file otherwise."""
    if key not in config:
        if default is _MISSING:
            raise AdapterError(f"{path}: no {key!r} ({expected}); a PEFT LoRA config has it")
        return default
    if not ok(config[key]):
        raise AdapterError(f"{path}: {key!r} must be {expected}, got {config[key]!r}")
    return config[key]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def merged_weight(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """W + scale * B A, computed in fp32 and rounded once to `dtype` (default: W's dtype). The one statement
    of how an adapter folds into its weight: `merge_adapter` and the merged export both use it."""
    delta = (b.float() @ a.float()) * scale
    return (weight.float() + delta).to(dtype or weight.dtype)


@torch.no_grad()
def merge_adapter(model: LlamaForCausalLM) -> int:
    """Fold every attached adapter into its frozen weight (W += s B A) and detach it; returns how many.

    For serving a finetuned model: the decode engine runs plain projections.
    """
    merged = 0
    for m in model.lora_modules().values():
        if m.has_lora:
            m.weight.copy_(merged_weight(m.weight, m.lora_A, m.lora_B, m.scale))
            m.remove_lora()
            merged += 1
    return merged
