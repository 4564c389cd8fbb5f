"""Checkpoints: the adapter (PEFT format) plus everything needed to continue the exact same run.

Layout: `<dir>/checkpoints/step_000100/{adapter_config.json, adapter_model.safetensors, trainer_state.pt}`.
A checkpoint is written to a temporary folder and renamed, so a crash mid-save never leaves a broken one.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harli_train.adapter import load_adapter, save_adapter
from harli_train.model.llama import LlamaForCausalLM

STATE_NAME = "trainer_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from."""


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path, step: int, model: LlamaForCausalLM, trainer_state: dict[str, Any], base_model: str, keep: int
) -> Path:
    ckpt_dir = root / "checkpoints"
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_adapter(model, tmp, base_model=base_model)
    torch.save(trainer_state, tmp / STATE_NAME)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    ckpt_dir = Path(root) / "checkpoints"
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob("step_*") if (p / STATE_NAME).is_file())


def find_checkpoint(path: Path) -> Path:
    """`path` is a checkpoint folder itself or a run directory holding `checkpoints/step_*`."""
    path = Path(path)
    if (path / STATE_NAME).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(
            f"no checkpoint to resume from in {path} (looked for checkpoints/step_*/{STATE_NAME})"
        )
    return found[-1]


def load_checkpoint(path: Path, model: LlamaForCausalLM) -> dict[str, Any]:
    """Loads the adapter into `model` (replacing any) and returns the trainer state."""
    for m in model.lora_modules().values():
        m.remove_lora()
    load_adapter(model, path)
    try:
        return torch.load(path / STATE_NAME, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file: say which one
        raise CheckpointError(f"{path / STATE_NAME}: cannot be read ({type(e).__name__}: {e})") from None
