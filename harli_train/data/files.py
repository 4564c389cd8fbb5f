"""Rows of the user's data files: JSON Lines, JSON, Parquet or CSV; a file, or a folder of them.

Each row is a dict with a location ("file:line" or "file: row N") for errors. Rows come in file order,
files in name order, and nothing is shuffled here: the loader's seeded order is drawn over the examples as
they come, so the same files always give the same, exactly resumable, stream.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harli_train.data.example import DataError

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def data_files(path: Path) -> list[Path]:
    """The data files `path` names: the file itself, or a folder's files with a data suffix, in name order."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())
        if not files:
            raise DataError(
                f"{path}: a directory holding no data files ({', '.join(SUFFIXES)}); data.path is a data "
                "file or a folder of them"
            )
        return files
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    return [path]


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(location, row) for each row of one file, by its suffix: .json (a JSON array of objects, or JSON
    Lines), .parquet (needs pyarrow), .csv (a header line, then one row per line; every value a string),
    anything else JSON Lines. A blank line of JSON Lines gives (location, None). DataError naming the file
    (and line or row) for what cannot be read."""
    if path.stat().st_size == 0:
        raise DataError(f"{path}: data file is empty")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_rows(path)
    if suffix == ".csv":
        return _csv_rows(path)
    if suffix == ".json" and _starts_with(path, b"["):
        return _json_array_rows(path)
    return _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    # Read bytes and decode line by line so a bad byte is reported on its own line.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a leading BOM
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                yield where, None
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield where, _object(row, where, "a JSON object per line")


def _json_array_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    for i, row in enumerate(rows, start=1):
        where = f"{path}: row {i}"
        yield where, _object(row, where, "a JSON object per row of the array")


def _csv_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                raise DataError(f"{path}: a CSV file needs a header line naming its columns")
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if None in row:
                    raise DataError(
                        f"{where}: more cells than the header has columns ({len(reader.fieldnames)})"
                    )
                yield (
                    where,
                    {k: v for k, v in row.items() if v is not None},
                )  # a short row lacks its last cells
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise DataError(f"{path}: not a readable CSV file ({e})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow "
            "(pip install pyarrow, or pip install 'harli-train[parquet]')"
        ) from None
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError for a file that is not Parquet
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    n = 0
    for batch in file.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield f"{path}: row {n}", row


def _object(row: Any, where: str, expected: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected {expected}, got {type(row).__name__}")
    return row


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
    return head.startswith(prefix)
