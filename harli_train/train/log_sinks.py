"""Logging backends beside metrics.jsonl: TensorBoard event files (RUN_DIR/tensorboard/) and a Weights &
Biases run, each fed the same per-step records as metrics.jsonl.

A record's numbers become scalars at its `step`: `eval_*` keys under `eval/` (`eval_loss` -> `eval/loss`),
the rest under `train/` (`loss` -> `train/loss`). Both backends are optional packages: `check_sinks` says,
before anything is loaded, which one a recipe asks for and this environment lacks.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Protocol

from harli_train.config import RecipeError

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"  # a resumed run continues the same W&B run


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers (booleans and None left out) under their backend tags."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        tag = f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"
        out[tag] = float(value)
    return out


class TensorBoardSink:
    """Event files under `run_dir/tensorboard/`, through torch.utils.tensorboard. Steps after `first_step - 1`
    that earlier event files there hold (a run resumed from an older checkpoint redoes them; a new run in the
    same directory redoes them all) are purged, as metrics.jsonl drops them."""

    def __init__(self, run_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=first_step)

    def log(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in `project`, named after the run directory, its config the resolved recipe. The run id is
    kept in `run_dir/wandb_run_id`, so a resumed run continues the same W&B run (W&B takes increasing steps
    only: steps a resume from an older checkpoint redoes keep their first values there)."""

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any], resuming: bool, source: str):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        try:
            self.run = wandb.init(
                project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir), config=config
            )
        except Exception as e:  # not logged in, no network, a bad project name: W&B's own words say which
            raise RecipeError(
                source,
                "output.wandb",
                "a W&B project wandb can open (`wandb login` first, or WANDB_MODE=offline to log locally)",
                f"{project!r}, but wandb.init failed: {type(e).__name__}: {e}",
            ) from None

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def check_sinks(tensorboard: bool, wandb_project: str | None, source: str) -> None:
    """RecipeError naming `source` and the key when the recipe asks for a backend that is not installed."""
    if tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise RecipeError(
                source,
                "output.tensorboard",
                "true only where the tensorboard package is installed (pip install tensorboard)",
                "true, but tensorboard is not installed",
            ) from None
    if wandb_project is not None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise RecipeError(
                source,
                "output.wandb",
                "a W&B project only where the wandb package is installed (pip install wandb)",
                f"{wandb_project!r}, but wandb is not installed",
            ) from None


def open_sinks(
    run_dir: Path,
    tensorboard: bool,
    wandb_project: str | None,
    config: dict[str, Any],
    resume_step: int | None,
    source: str,
) -> list[Sink]:
    """The backends a recipe asks for, opened for a run whose first new step is `resume_step + 1`;
    RecipeError naming `source` when W&B cannot start its run."""
    sinks: list[Sink] = []
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir, (resume_step or 0) + 1))
    if wandb_project is not None:
        sinks.append(WandbSink(wandb_project, run_dir, config, resume_step is not None, source))
    return sinks
