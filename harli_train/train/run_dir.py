"""The run directory (the recipe's ``output.dir``), made ready before the model or the data is loaded.

``prepare_run_dir`` creates it and checks that this process can write there, finishes what a killed save
left in its checkpoints (``recover_checkpoints``), and refuses to start a new run over another run's
checkpoints: ``--resume`` continues that run, ``output.overwrite=true`` replaces it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from harli_train.config import RecipeError
from harli_train.durable import writable_folder
from harli_train.train.checkpoint import (
    CHECKPOINTS,
    describe_os_error,
    legacy_checkpoints,
    list_checkpoints,
    recover_checkpoints,
)

log = logging.getLogger(__name__)


class OutputDirError(RecipeError):
    """A recipe whose ``output.dir`` cannot take this run: a usage error, exit code 2 on the command line."""

    def __init__(self, where: str, expected: str, found: str):
        super().__init__(where, "output.dir", expected, found)


def prepare_run_dir(path: str | Path, *, resuming: bool, overwrite: bool, source: str) -> Path:
    """Make ``path`` a run directory this run may write to; returns it.

    ``resuming``: this run continues a checkpoint, so the checkpoints there are its own. Otherwise existing
    checkpoints (another run's work) make it an OutputDirError unless ``overwrite``, which deletes them.
    ``source`` (the recipe file) is named in errors. Costs a directory listing and one empty file written
    and removed.
    """
    path = Path(path)
    _check_writable(path, source)
    try:
        recover_checkpoints(path)
    except OSError as err:
        raise OutputDirError(
            source, "a run directory whose checkpoints can be tidied", f"{path} ({describe_os_error(err)})"
        ) from None
    if resuming:
        return path
    previous = sorted(list_checkpoints(path) + legacy_checkpoints(path), key=lambda p: p.name)
    if not previous:
        return path
    if not overwrite:
        raise OutputDirError(
            source,
            "a directory without another run's checkpoints (add --resume to continue that run, or "
            "output.overwrite=true to replace it)",
            f"{path}, which holds checkpoints up to {previous[-1].name}",
        )
    log.warning("output.overwrite=true: deleting the previous run's checkpoints in %s", path / CHECKPOINTS)
    shutil.rmtree(path / CHECKPOINTS)
    return path


def _check_writable(path: Path, source: str) -> None:
    try:
        writable_folder(path)
    except NotADirectoryError as err:
        found = (
            f"{path}, which is a file"
            if Path(err.filename) == path
            else f"{path}, which is under the file {err.filename}"
        )
        raise OutputDirError(source, "a directory", found) from None
    except OSError as err:
        raise OutputDirError(
            source, "a directory this user can create and write to", f"{path} ({describe_os_error(err)})"
        ) from None
