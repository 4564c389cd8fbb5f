"""What every command shares: one-line errors with their exit codes, strict JSON for the console, and
the launch of a `--tensor-parallel N` job."""

from __future__ import annotations

import errno
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import click

# Exit codes: 2 when the command line, the recipe or an input file is wrong (click's own usage errors use it
# too), 1 when the run fails while it works (it diverged, a file could not be written).
USAGE_ERROR, RUN_FAILURE = 2, 1


@functools.cache
def exit_codes() -> tuple[tuple[type[BaseException], int], ...]:
    """The errors that end a command with one line instead of a traceback, each with its exit code; the first
    class an error is an instance of decides (subclasses come before their bases). Imported on first use, so
    `--help` does not load torch."""
    from harli_train.adapter import AdapterError
    from harli_train.colocate.profile import ProfileError
    from harli_train.config import RecipeError
    from harli_train.data.example import DataError
    from harli_train.engine.engine_config import EngineError
    from harli_train.engine.load import TraceError
    from harli_train.export import ExportError
    from harli_train.model import ModelError
    from harli_train.train.checkpoint import CheckpointError, SaveError
    from harli_train.train.divergence import TrainingDiverged

    return (
        (RecipeError, USAGE_ERROR),
        (ModelError, USAGE_ERROR),
        (DataError, USAGE_ERROR),
        (AdapterError, USAGE_ERROR),
        (ExportError, USAGE_ERROR),
        (CheckpointError, USAGE_ERROR),
        (TraceError, USAGE_ERROR),  # an EngineError
        (FileNotFoundError, USAGE_ERROR),  # an OSError: an input named on the command line or in the recipe
        (TrainingDiverged, RUN_FAILURE),
        (SaveError, RUN_FAILURE),  # a checkpoint or adapter could not be written (the last good one kept)
        (EngineError, RUN_FAILURE),  # a request the engine refused, a cache too small for the load
        (ProfileError, RUN_FAILURE),
        (OSError, RUN_FAILURE),  # writing outputs: a full disk, a path that is a file, no permission
    )


def error_message(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError):
        return f"file not found: {err.filename}"
    if isinstance(err, OSError) and err.filename is not None:
        code = errno.errorcode.get(err.errno or 0)
        return f"{err.filename}: {err.strerror}" + (f" ({code})" if code else "")
    return str(err)


def friendly(fn: Callable) -> Callable:
    """Run a command so that each error of `exit_codes` prints one line and exits with its code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except tuple(cls for cls, _ in exit_codes()) as err:
            failure = click.ClickException(error_message(err))
            failure.exit_code = next(code for cls, code in exit_codes() if isinstance(err, cls))
            raise failure from None

    return wrapper


def strict_json(obj: Any, indent: int) -> str:
    """Valid JSON for the console: a non-finite float (the loss of a run that ran no step) prints as null,
    anything else JSON has no type for as its str()."""

    def finite(v: Any) -> Any:
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(obj), indent=indent, default=str, allow_nan=False)


def tensor_parallel_run(job: str, n: int, models: list[str], device: str, args: dict) -> Any:
    """Run a `--tensor-parallel N` job (harli_train.parallel.command) after checking N against each model;
    a rank's error ends the command as that error would on one GPU."""
    import torch

    from harli_train.model import model_config
    from harli_train.parallel.command import TensorParallelError, run_tensor_parallel
    from harli_train.parallel.group import check_tensor_parallel

    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    for source in dict.fromkeys(models):
        check_tensor_parallel(model_config(source), n, source, on_gpu)
    try:
        return run_tensor_parallel(job, n, args, on_gpu)
    except TensorParallelError as err:
        codes = [code for cls, code in exit_codes() if err.error_class and issubclass(err.error_class, cls)]
        failure = click.ClickException(str(err))
        failure.exit_code = codes[0] if codes else RUN_FAILURE
        raise failure from None
