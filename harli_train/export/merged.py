"""`harli-train export RUN_DIR`: a run's adapter merged into its base model as a Hugging Face directory, or
the adapter's PEFT files alone.

RUN_DIR is a run's `output.dir` (its `recipe.yaml` names the base in `model.name`; `adapter/` is the final
adapter) or one of its checkpoints (`RUN_DIR/checkpoints/step_N/`, the adapter files themselves). The merge
streams the base's safetensors shards: one output shard's tensors are in memory at a time, each projection
the adapter targets becomes W + (alpha / r) B A (`adapter.merged_weight`, computed in fp32, rounded once).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from harli_train.adapter import CONFIG_NAME, WEIGHTS_NAME, merged_weight, read_adapter
from harli_train.config import ModelSection, RecipeError
from harli_train.export import ExportError
from harli_train.export.hf_dir import (
    DEFAULT_MAX_SHARD_BYTES,
    DTYPES,
    TensorSource,
    copy_tokenizer_files,
    dtype_name,
    staged_dir,
    write_json,
    write_weights,
)
from harli_train.model import LlamaForCausalLM, is_preset, model_config
from harli_train.model.loader import shard_files

log = logging.getLogger(__name__)

RECIPE_NAME = "recipe.yaml"
ADAPTER_DIR = "adapter"
GENERATION_CONFIG = "generation_config.json"
# safetensors' dtype codes (a shard header's "dtype") for the tensors a model directory holds.
_STORED = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True, slots=True)
class RunFiles:
    """What an export reads from a run: its recipe's model section and the adapter directory."""

    recipe: Path
    adapter: Path
    model: ModelSection


def find_run(path: str | Path) -> RunFiles:
    """The recipe and adapter of run directory (or checkpoint directory) `path`; ExportError naming what is
    missing, RecipeError for a recipe.yaml whose model section does not read."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ExportError(f"{path}: not a run directory (expected a run's output.dir: recipe.yaml, adapter/)")
    if (path / ADAPTER_DIR).is_dir():
        adapter, recipe = path / ADAPTER_DIR, path / RECIPE_NAME
    elif (path / CONFIG_NAME).is_file() and path.parent.name == "checkpoints":
        adapter, recipe = path, path.parent.parent / RECIPE_NAME
    else:
        steps = sorted(p.name for p in (path / "checkpoints").glob("step_*") if p.is_dir())
        hint = f"; its latest checkpoint exports as {path / 'checkpoints' / steps[-1]}" if steps else ""
        raise ExportError(
            f"{path}: no adapter/ (a run writes it when it ends; a run still going or stopped by an error "
            f"has none){hint}"
        )
    for needed in (adapter / CONFIG_NAME, adapter / WEIGHTS_NAME):
        if not needed.is_file():
            raise ExportError(f"{needed}: not found (the adapter is incomplete)")
    if not recipe.is_file():
        raise ExportError(f"{recipe}: not found; export reads the run's recipe to find its base model")
    try:
        tree = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ExportError(f"{recipe}: not a readable YAML recipe ({type(e).__name__}: {e})") from None
    section = tree.get("model") if isinstance(tree, dict) else None
    if not isinstance(section, dict):
        raise ExportError(f"{recipe}: no model section (a run's recipe.yaml names its base in model.name)")
    try:
        model = ModelSection(**section)
    except RecipeError as e:
        raise RecipeError(str(recipe), e.key, e.expected, e.found) from None
    except TypeError as e:  # a key this version does not know
        raise ExportError(f"{recipe}: model section: {e}") from None
    return RunFiles(recipe, adapter, model)


def export_adapter(run_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Copy the run's adapter (adapter_config.json, adapter_model.safetensors)
    into new directory `out_dir`."""
    run = find_run(run_dir)
    with staged_dir(out_dir) as stage:
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            shutil.copyfile(run.adapter / name, stage / name)
    return {"kind": "adapter", "out_dir": str(Path(out_dir).resolve()), "adapter": str(run.adapter)}


def export_merged(
    run_dir: str | Path,
    out_dir: str | Path,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Write the run's base with its adapter merged into new directory `out_dir`, as transformers lays a
    model out: safetensors weights (sharded past `max_shard_bytes`), config.json, generation_config.json
    and the base's tokenizer files. Each tensor keeps the base's stored dtype unless `dtype` (float32,
    bfloat16, float16) is given, which every floating tensor is then written in (config.json says so).

    ExportError for a preset base (random weights and a byte tokenizer: nothing transformers could use with
    it; export the adapter instead), a run without an adapter, an `out_dir` that is not empty; ModelError
    when the base directory is gone; AdapterError when the adapter does not fit the base. Costs one pass
    over the base's weights and memory for one output shard.
    """
    run = find_run(run_dir)
    base = run.model.name
    if is_preset(base):
        raise ExportError(
            f"{run.recipe}: model.name {base!r} is a preset (seeded random weights, harli's byte tokenizer), "
            "not a Hugging Face model to merge into; export it with --adapter-only, or train on a Hugging "
            "Face directory (recipes/smollm2-chat.yaml trains a real one)"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    base_dir = Path(base)
    cfg = model_config(base)
    with torch.device("meta"):  # shapes only: the adapter is checked against the base without its weights
        skeleton = LlamaForCausalLM(cfg)
    adapter = read_adapter(skeleton, run.adapter)
    deltas = {f"{name}.weight": pair for name, pair in adapter.pairs.items()}
    out_dtype = DTYPES[dtype] if dtype is not None else None
    with ExitStack() as shards, staged_dir(out_dir) as stage:
        sources = []
        for shard in shard_files(base_dir):
            handle = shards.enter_context(_open_shard(shard))
            sources += [
                _source(handle, shard, key, deltas.get(key), adapter.scale, out_dtype)
                for key in handle.keys()
            ]
        missing = sorted(set(deltas) - {s.name for s in sources})
        if missing:
            raise ExportError(
                f"{base_dir}: the adapter targets weights the base does not store: {missing[:3]}"
            )
        weights = write_weights(stage, sources, max_shard_bytes)
        config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
        if out_dtype is not None:
            keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
            config.update(dict.fromkeys(keys, dtype))
        write_json(stage / "config.json", config)
        _write_generation_config(base_dir, stage, config)
        tokenizer = copy_tokenizer_files(base_dir, stage)
    if not tokenizer:
        log.warning("%s holds no tokenizer files: the export has none either", base_dir)
    stored = sorted({dtype_name(s.dtype) for s in sources if s.dtype.is_floating_point})
    return {
        "kind": "merged",
        "out_dir": str(Path(out_dir).resolve()),
        "base": str(base_dir),
        "adapter": str(run.adapter),
        "merged_modules": len(deltas),
        "dtype": stored[0] if len(stored) == 1 else stored,
        "weights": weights,
        "tokenizer": tokenizer,
    }


def _open_shard(shard: Path):
    from safetensors import SafetensorError, safe_open

    if not shard.is_file():
        raise ExportError(f"{shard}: a shard the base's index lists is missing")
    try:
        return safe_open(str(shard), framework="pt", device="cpu")
    except SafetensorError as e:
        raise ExportError(f"{shard}: not a readable safetensors file ({e}); it may be truncated") from None


def _source(
    handle, shard: Path, key: str, delta, scale: float, out_dtype: torch.dtype | None
) -> TensorSource:
    """The output tensor for base tensor `key`: merged when `delta` (A, B) is given, cast to `out_dtype`
    when it is floating and one is given; its size is known from the shard's header before it is read."""
    piece = handle.get_slice(key)
    code = piece.get_dtype()
    if code not in _STORED:
        raise ExportError(f"{shard}: tensor {key!r} has dtype {code}, which export does not handle")
    stored = _STORED[code]
    dtype = out_dtype if out_dtype is not None and stored.is_floating_point else stored
    load = functools.partial(_load, handle, key, delta, scale, dtype)
    return TensorSource(key, tuple(piece.get_shape()), dtype, load)


def _load(handle, key: str, delta, scale: float, dtype: torch.dtype) -> torch.Tensor:
    weight = handle.get_tensor(key)
    if delta is None:
        return weight.to(dtype)
    a, b = delta
    return merged_weight(weight, a, b, scale, dtype)


def _write_generation_config(base_dir: Path, stage: Path, config: dict[str, Any]) -> None:
    """The base's generation_config.json, or one made from config.json's special token ids (as
    transformers' save_pretrained makes it) when the base has none."""
    if (base_dir / GENERATION_CONFIG).is_file():
        shutil.copyfile(base_dir / GENERATION_CONFIG, stage / GENERATION_CONFIG)
        return
    from transformers import GenerationConfig

    ids = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None
    }
    GenerationConfig(**ids).save_pretrained(stage)
