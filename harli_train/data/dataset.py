"""Training examples read from a JSONL file: token ids plus the labels the loss is taken on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harli_train.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
FORMATS = ("auto", "prompt_completion", "text")
FORMAT_FIELDS = {"prompt_completion": ("prompt", "completion"), "text": ("text",)}


class DataError(ValueError):
    """A problem with the user's data or tokenizer files; the message says which file (and line)."""


@dataclass(slots=True)
class Example:
    """One tokenized example. Labels are unshifted (labels[t] is the target at position t; the model
    shifts) and IGNORE_INDEX where no loss is taken."""

    input_ids: list[int]
    labels: list[int]


def load_examples(
    path: str | Path, fmt: str, tokenizer: Tokenizer, max_examples: int | None = None
) -> list[Example]:
    """Tokenize a JSONL file of {"prompt", "completion"} rows or {"text"} rows.

    prompt/completion -> [bos] + prompt + completion + [eos], loss on completion + eos only.
    text              -> [bos] + text + [eos], loss on everything but bos.
    Prompt and completion are tokenized separately so the loss mask falls exactly on their boundary.
    With fmt="auto" the first row decides the format; a file mixing both is an error. Blank lines and
    rows whose text is empty are skipped. bos is left out when the tokenizer has none.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if max_examples is not None and max_examples < 1:
        raise DataError(f"max_examples must be at least 1, got {max_examples}")
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: data file is empty")

    row_fmt = None if fmt == "auto" else fmt
    fmt_origin = "the requested format"
    examples: list[Example] = []
    skipped: list[int] = []
    # Read bytes and decode line by line so a bad byte is reported on its own line.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if max_examples is not None and len(examples) >= max_examples:
                break
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # tolerate a leading BOM
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            row = _parse_row(line, where)
            detected = _detect_format(row, where)
            if row_fmt is None:
                row_fmt, fmt_origin = detected, f"the file's format (from line {lineno})"
            elif detected != row_fmt:
                raise DataError(
                    f"{where}: row is in {detected} format, but {fmt_origin} is {row_fmt}; "
                    "a file must use one format"
                )
            fields = [_string_field(row, name, row_fmt, where) for name in FORMAT_FIELDS[row_fmt]]
            if not any(fields):
                skipped.append(lineno)
                continue
            examples.append(_tokenize(fields, tokenizer))

    if not examples:
        detail = f"rows on lines {_line_list(skipped)} are empty" if skipped else "it has only blank lines"
        raise DataError(f"{path}: no usable rows: {detail}")
    return examples


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
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    if len(fields) == 2:
        prompt, completion = (tokenizer.encode(s) for s in fields)
        target = completion + [tokenizer.eos_id]
        return Example(bos + prompt + target, [IGNORE_INDEX] * (len(bos) + len(prompt)) + target)
    target = tokenizer.encode(fields[0]) + [tokenizer.eos_id]
    return Example(bos + target, [IGNORE_INDEX] * len(bos) + target)


def _line_list(lines: list[int], limit: int = 5) -> str:
    shown = ", ".join(str(n) for n in lines[:limit])
    return shown + (f" and {len(lines) - limit} more" if len(lines) > limit else "")
