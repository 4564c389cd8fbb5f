"""Durable file writes: a file is written under a temporary name, fsynced and renamed into place.

A crash (or a kill) during `write_file` leaves the previous file or the new one at `path`, never a torn one;
once it returns, the new file survives a power loss too. A failure (a full disk, a read-only folder) is an
`OSError` whose `filename` is the file that could not be written. `writable_folder` checks a folder before
work whose result would be written there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path


def write_file(path: str | Path, data: bytes) -> None:
    """Replace `path` by a file holding `data`: written to `<path>.part`, fsynced, renamed, folder fsynced."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            part.unlink(missing_ok=True)
        # A failed write() carries no file name: name the file being replaced.
        raise OSError(err.errno, err.strerror, str(err.filename or path)) from err
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make the entries of folder `path` (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writable_folder(path: str | Path) -> None:
    """Make folder `path` (and its parents) if need be and check that this user can write a file in it (one
    empty file made and removed). NotADirectoryError whose `filename` is the file in the way when `path` or
    a parent of it is a file; the OSError of the mkdir or the write otherwise."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "is a file, not a folder", str(folder))
    path.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=path, prefix=".write-check-")
    os.close(fd)
    os.unlink(probe)
