"""Checkpoints: the adapter (PEFT format) plus everything needed to continue the exact same run.

Layout: ``<run>/checkpoints/step_000100/`` holds ``adapter_config.json``, ``adapter_model.safetensors``,
``trainer_state.safetensors`` (the optimizer's tensors, torch's RNG) and ``trainer_state.json`` (the rest:
``harli_train.train.trainer_state``). Nothing is unpickled: a checkpoint someone hands over can at worst fail
to load. A checkpoint written by an older harli-train (``trainer_state.pt``, a pickle) is refused unopened.

A save never leaves a broken checkpoint in place of a good one. It writes ``.tmp_step_N/``, fsyncing every
file and writing ``trainer_state.json`` last, so that its presence marks the folder complete, then renames
the folder into place; folders on their way out are first renamed to ``.del_*``. ``recover_checkpoints``,
run at start-up, finishes what a kill interrupted: a complete temporary is promoted, partial ones removed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from harli_train import durable
from harli_train.adapter import CONFIG_NAME, WEIGHTS_NAME, load_adapter, save_adapter
from harli_train.model.llama import LlamaForCausalLM
from harli_train.train.signals import held_signals
from harli_train.train.trainer_state import decode, encode

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LEGACY_STATE = "trainer_state.pt"  # what earlier harli-train versions wrote: a pickle, never opened
FILES = (CONFIG_NAME, WEIGHTS_NAME, STATE_TENSORS, STATE_JSON)  # in the order a save writes them
_TMP, _DEL = ".tmp_", ".del_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from."""


class SaveError(RuntimeError):
    """A checkpoint or adapter that could not be written (a full disk, a read-only folder); it names the file
    and the OS error. What was saved before is kept."""


def describe_os_error(err: OSError) -> str:
    return f"{err.filename}: [Errno {err.errno}] {err.strerror}"


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
    """Write step ``step``'s checkpoint under ``root/checkpoints/``, then keep only the newest ``keep``.

    SIGINT and SIGTERM wait until it is written (``held_signals``). A kill at any point leaves every earlier
    checkpoint intact. Raises SaveError, with the temporary removed and the earlier checkpoints untouched,
    when a file cannot be written.
    """
    from safetensors.torch import save

    ckpt_dir = Path(root) / CHECKPOINTS
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f"{_TMP}{final.name}"
    with held_signals(f"checkpoint {final}"):
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
            save_adapter(model, tmp, base_model=base_model)
            plain, tensors = encode(trainer_state)
            durable.write_file(tmp / STATE_TENSORS, save(tensors))
            durable.write_file(tmp / STATE_JSON, json.dumps(plain).encode())
            _move_into_place(tmp, final)
        except OSError as err:
            _remove(tmp)
            kept = list_checkpoints(root)
            note = f"the last complete checkpoint, {kept[-1]}, is kept" if kept else "there is no earlier one"
            raise SaveError(
                f"could not save the checkpoint of step {step}: {describe_os_error(err)}; {note}"
            ) from None
        for old in list_checkpoints(root)[:-keep]:
            _discard(old)
    return final


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; a ``final`` already there (the same step, saved again) is
    renamed aside first and removed once the new one is in place."""
    aside = final.with_name(_DEL + final.name)
    if final.exists():
        _remove(aside)
        final.rename(aside)
    try:
        tmp.rename(final)
    except OSError:
        if aside.exists():
            aside.rename(final)
        raise
    durable.fsync_dir(final.parent)
    _remove(aside)


def _discard(folder: Path) -> None:
    """Remove a checkpoint: first renamed to ``.del_*`` (atomically no longer a checkpoint), then deleted."""
    gone = folder.with_name(_DEL + folder.name)
    try:
        folder.rename(gone)
    except OSError as err:
        log.warning("could not remove the old checkpoint %s (%s)", folder, err)
        return
    _remove(gone)


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def recover_checkpoints(root: Path) -> None:
    """Finish what a killed save left under ``root/checkpoints/``, each action logged.

    A complete ``.tmp_step_N`` (every file written) becomes ``step_N`` when there is none; a partial one, a
    ``.del_*`` folder and a ``step_*`` folder that is neither complete nor an old-format checkpoint (an empty
    one, say) are removed; so is an empty ``checkpoints/``.
    """
    ckpt_dir = Path(root) / CHECKPOINTS
    if not ckpt_dir.is_dir():
        return
    for folder in sorted(ckpt_dir.glob("step_*")):
        if folder.is_dir() and not (is_complete(folder) or _is_legacy(folder)):
            log.warning("removing %s: an incomplete checkpoint folder (a run was killed)", folder)
            _remove(folder)
    for tmp in sorted(ckpt_dir.glob(f"{_TMP}step_*")):
        final = ckpt_dir / tmp.name.removeprefix(_TMP)
        if is_complete(tmp) and not final.exists():
            log.warning("promoting %s to %s: a complete checkpoint whose save was cut short", tmp, final.name)
            tmp.rename(final)
        else:
            log.warning("removing %s: a save that was cut short", tmp)
            _remove(tmp)
    for gone in ckpt_dir.glob(f"{_DEL}*"):
        _remove(gone)
    durable.fsync_dir(ckpt_dir)
    if not any(ckpt_dir.iterdir()):
        ckpt_dir.rmdir()


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
