"""Training examples read from a JSONL file: token ids plus the labels the loss is taken on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from harli_train.data.example import DataError, Example
from harli_train.data.tokenization import prompt_completion_example, text_example

if TYPE_CHECKING:
    from harli_train.data.tokenizer import Tokenizer

FORMATS = ("auto", "prompt_completion", "text")
FORMAT_FIELDS = {"prompt_completion": ("prompt", "completion"), "text": ("text",)}


def load_examples(
    path: str | Path, fmt: str, tokenizer: Tokenizer, max_examples: int | None = None
) -> list[Example]:
    """Tokenize a JSONL file (or every `*.jsonl` file of a folder, in name order) of {"prompt", "completion"}
    rows or {"text"} rows.

    prompt/completion -> prompt + completion + eos with the tokenizer's special tokens, loss after the prompt
    text              -> text + eos with the tokenizer's special tokens, loss on all but those before it
    (`harli_train.data.tokenization` says how). With fmt="auto" the first row decides the format; data mixing
    both is an error. Blank lines and rows whose text is empty are skipped.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if max_examples is not None and max_examples < 1:
        raise DataError(f"max_examples must be at least 1, got {max_examples}")
    files = data_files(path)
    reader = _Reader(None if fmt == "auto" else fmt, tokenizer, max_examples)
    for file in files:
        reader.read(file)
    if not reader.examples:
        if not reader.skipped:
            detail = "it has only blank lines" if len(files) == 1 else "its files have only blank lines"
        elif len(files) == 1:
            detail = f"rows on lines {_line_list([n for _, n in reader.skipped])} are empty"
        else:
            detail = f"rows at {_line_list([f'{p.name}:{n}' for p, n in reader.skipped])} are empty"
        raise DataError(f"{path}: no usable rows: {detail}")
    return reader.examples


def data_files(path: Path) -> list[Path]:
    """The JSONL files `path` names: the file itself, or a folder's `*.jsonl` files in name order."""
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not files:
            raise DataError(
                f"{path}: a directory holding no .jsonl files (data.path is a JSONL file or a folder of them)"
            )
        return files
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    return [path]


class _Reader:
    """Rows of one or more files into examples, one format throughout."""

    def __init__(self, fmt: str | None, tokenizer: Tokenizer, max_examples: int | None):
        self.fmt, self.fmt_origin, self.fmt_file = fmt, "the requested format", None
        self.tokenizer, self.max_examples = tokenizer, max_examples
        self.examples: list[Example] = []
        self.skipped: list[tuple[Path, int]] = []  # (file, line) of the rows with empty text

    @property
    def full(self) -> bool:
        return self.max_examples is not None and len(self.examples) >= self.max_examples

    def read(self, path: Path) -> None:
        """Append the examples of `path` (until `max_examples` are read); DataError naming the file and line."""
        if self.full:
            return
        if path.stat().st_size == 0:
            raise DataError(f"{path}: data file is empty")
        # Read bytes and decode line by line so a bad byte is reported on its own line.
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if self.full:
                    return
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a leading BOM
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                row = _parse_row(line, where)
                detected = _detect_format(row, where)
                if self.fmt is None:
                    self.fmt, self.fmt_file = detected, path
                    self.fmt_origin = f"the file's format (from line {lineno})"
                elif detected != self.fmt:
                    elsewhere = self.fmt_file is not None and path != self.fmt_file
                    origin = f"{self.fmt_file.name}'s format" if elsewhere else self.fmt_origin
                    one = "a folder's files" if elsewhere else "a file"
                    raise DataError(
                        f"{where}: row is in {detected} format, but {origin} is {self.fmt}; "
                        f"{one} must use one format"
                    )
                fields = [_string_field(row, name, self.fmt, where) for name in FORMAT_FIELDS[self.fmt]]
                if not any(fields):
                    self.skipped.append((path, lineno))
                    continue
                self.examples.append(_tokenize(fields, self.tokenizer))


def _parse_row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    return row


def _detect_format(row: dict, where: str) -> str:
    """The format this row's keys point to."""
    is_pc = "prompt" in row or "completion" in row
    is_text = "text" in row
    if is_pc and is_text:
        raise DataError(f"{where}: row has both 'text' and 'prompt'/'completion' fields; use one format")
    if is_pc:
        return "prompt_completion"
    if is_text:
        return "text"
    raise DataError(
        f"{where}: row has neither 'prompt'/'completion' nor 'text' fields (keys: {', '.join(row) or 'none'})"
    )


def _string_field(row: dict, name: str, fmt: str, where: str) -> str:
    if name not in row:
        needed = " and ".join(repr(n) for n in FORMAT_FIELDS[fmt])
        raise DataError(f"{where}: missing field {name!r} ({fmt} rows need {needed})")
    value = row[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


def _tokenize(fields: list[str], tokenizer: Tokenizer) -> Example:
    if len(fields) == 2:
        return prompt_completion_example(tokenizer, *fields)
    return text_example(tokenizer, fields[0])


def _line_list(lines: list[int], limit: int = 5) -> str:
    shown = ", ".join(str(n) for n in lines[:limit])
    return shown + (f" and {len(lines) - limit} more" if len(lines) > limit else "")
