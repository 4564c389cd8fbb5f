"""Checkpoints: the adapter (PEFT format) plus everything needed to continue the exact same run.

Layout: ``<run>/checkpoints/step_000100/`` holds ``adapter_config.json``, ``adapter_model.safetensors``,
``trainer_state.safetensors`` (the optimizer's tensors, torch's RNG) and ``trainer_state.json`` (the rest:
``harli_train.train.trainer_state``). Nothing is unpickled: a checkpoint someone hands over can at worst fail
to load. A checkpoint written by an older harli-train (``trainer_state.pt``, a pickle) is refused unopened.
A checkpoint is written to a temporary folder and renamed, so a crash mid-save never leaves a broken one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from harli_train import durable
from harli_train.adapter import CONFIG_NAME, WEIGHTS_NAME, load_adapter, save_adapter
from harli_train.model.llama import LlamaForCausalLM
from harli_train.train.trainer_state import decode, encode

CHECKPOINTS = "checkpoints"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LEGACY_STATE = "trainer_state.pt"  # what earlier harli-train versions wrote: a pickle, never opened
FILES = (CONFIG_NAME, WEIGHTS_NAME, STATE_TENSORS, STATE_JSON)  # in the order a save writes them


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from."""


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in FILES)


def _is_legacy(folder: Path) -> bool:
    return (folder / LEGACY_STATE).is_file() and not (folder / STATE_JSON).is_file()


def _legacy_error(file: Path) -> CheckpointError:
    return CheckpointError(
        f"{file}: an old-format checkpoint (a pickle, which can run code when it is loaded); it cannot be "
        "resumed safely, so harli-train does not open it. Start a new run instead."
    )


def save_checkpoint(
    root: Path, step: int, model: LlamaForCausalLM, trainer_state: dict[str, Any], base_model: str, keep: int
) -> Path:
    """Write step ``step``'s checkpoint under ``root/checkpoints/``, then keep only the newest ``keep``."""
    from safetensors.torch import save

    ckpt_dir = Path(root) / CHECKPOINTS
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp, base_model=base_model)
    plain, tensors = encode(trainer_state)
    durable.write_file(tmp / STATE_TENSORS, save(tensors))
    durable.write_file(tmp / STATE_JSON, json.dumps(plain).encode())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root/checkpoints/``, oldest first."""
    ckpt_dir = Path(root) / CHECKPOINTS
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob("step_*") if is_complete(p))


def legacy_checkpoints(root: Path) -> list[Path]:
    """Old-format (pickled) checkpoints under ``root/checkpoints/``, oldest first: kept, never opened."""
    ckpt_dir = Path(root) / CHECKPOINTS
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob("step_*") if _is_legacy(p))


def find_checkpoint(path: Path) -> Path:
    """``path`` is a checkpoint folder itself or a run directory holding ``checkpoints/step_*``; the newest
    complete checkpoint there. CheckpointError naming what is wrong otherwise (an old-format checkpoint
    included)."""
    path = Path(path)
    if path.is_file():
        if path.name == LEGACY_STATE:
            raise _legacy_error(path)
        raise CheckpointError(
            f"{path}: not a checkpoint; give a checkpoint folder (checkpoints/step_N) or the run directory "
            "that holds it"
        )
    if is_complete(path):
        return path
    if _is_legacy(path):
        raise _legacy_error(path / LEGACY_STATE)
    present = [name for name in FILES if (path / name).exists()]
    if present:
        missing = [name for name in FILES if name not in present]
        raise CheckpointError(f"{path}: an incomplete checkpoint (missing {', '.join(missing)})")
    found = list_checkpoints(path)
    if found:
        return found[-1]
    legacy = legacy_checkpoints(path)
    if legacy:
        raise _legacy_error(legacy[-1] / LEGACY_STATE)
    raise CheckpointError(
        f"no checkpoint to resume from in {path} (looked for {CHECKPOINTS}/step_*/{STATE_JSON})"
    )


def load_checkpoint(path: Path, model: LlamaForCausalLM) -> dict[str, Any]:
    """The trainer state of checkpoint folder ``path``, after loading its adapter into ``model`` (replacing
    any). The state is read and checked first: a bad one leaves the model as it was."""
    from safetensors.torch import load_file

    json_path, tensors_path = path / STATE_JSON, path / STATE_TENSORS
    try:
        plain = json.loads(json_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{json_path}: cannot be read ({type(e).__name__}: {e})") from None
    try:
        tensors = load_file(str(tensors_path))
    except Exception as e:  # safetensors' own error for a truncated or foreign file: say which one
        raise CheckpointError(f"{tensors_path}: cannot be read ({type(e).__name__}: {e})") from None
    try:
        state = decode(plain, tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"{json_path}: not a harli-train trainer state ({type(e).__name__}: {e})"
        ) from None
    for m in model.lora_modules().values():
        m.remove_lora()
    load_adapter(model, path)
    return state
