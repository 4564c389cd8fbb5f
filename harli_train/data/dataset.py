"""Training examples read from the user's data: token ids plus the labels the loss is taken on."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from harli_train.data import formats
from harli_train.data.example import DataError, Example
from harli_train.data.files import data_files, read_rows
from harli_train.data.tokenization import (
    TRAIN_ON,
    chat_example,
    chat_tokenizer,
    prompt_completion_example,
    text_example,
)

if TYPE_CHECKING:
    from harli_train.data.tokenizer import Tokenizer

FORMATS = formats.FORMATS


def load_examples(
    path: str | Path,
    fmt: str,
    tokenizer: Tokenizer,
    max_examples: int | None = None,
    train_on: str = "assistant",
) -> list[Example]:
    """Tokenize a data file, or every data file of a folder in name order (`harli_train.data.files`: JSON
    Lines, JSON, Parquet, CSV), of rows in one format (`harli_train.data.formats`).

    prompt_completion -> prompt + completion + eos, loss after the prompt (`train_on="all"`: on all of it)
    text              -> text + eos, loss on all but the tokenizer's leading special tokens
    chat, alpaca, sharegpt -> the conversation as the tokenizer's chat template renders it, loss on the
                         assistant turns (`train_on="all"`: on every token)
    (`harli_train.data.tokenization` says how.) With fmt="auto" the first row decides the format; data mixing
    formats is an error. Blank lines and rows with no text are skipped. DataError naming the file and line
    (or row) for a bad row, the tokenizer for a chat format it has no template for.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if train_on not in TRAIN_ON:
        raise DataError(f"unknown data.train_on {train_on!r}; expected one of {', '.join(TRAIN_ON)}")
    if max_examples is not None and max_examples < 1:
        raise DataError(f"max_examples must be at least 1, got {max_examples}")
    files = data_files(path)
    reader = _Reader(None if fmt == "auto" else fmt, tokenizer, max_examples, train_on)
    for file in files:
        reader.read(file)
    if not reader.examples:
        if not reader.skipped:
            detail = "it has only blank lines" if len(files) == 1 else "its files have only blank lines"
        else:
            detail = f"rows at {_line_list(reader.skipped)} have no text"
        raise DataError(f"{path}: no usable rows: {detail}")
    return reader.examples


def split_examples(
    examples: list[Example], fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """(train, validation): a seeded `fraction` of the examples (at least one, and one fewer than all) held
    out, both in their original order. The same examples, fraction and seed always give the same split."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if len(examples) < 2:
        raise DataError(
            f"cannot hold out a validation fraction of {len(examples)} example(s); give data.val_path"
        )
    n_val = min(max(1, round(fraction * len(examples))), len(examples) - 1)
    held = set(np.random.default_rng([seed, 0x5A11]).permutation(len(examples))[:n_val].tolist())
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [e for i, e in enumerate(examples) if i in held]


class _Reader:
    """Rows of one or more files into examples, one format throughout."""

    def __init__(self, fmt: str | None, tokenizer: Tokenizer, max_examples: int | None, train_on: str):
        self.fmt, self.fmt_origin, self.fmt_file = fmt, "the requested format", None
        self.tokenizer, self.max_examples, self.train_on = tokenizer, max_examples, train_on
        self.examples: list[Example] = []
        self.skipped: list[str] = []  # locations of the rows with no text
        if fmt in formats.CHAT_FORMATS:
            chat_tokenizer(tokenizer)  # no template: one error naming the tokenizer, before any row

    @property
    def full(self) -> bool:
        return self.max_examples is not None and len(self.examples) >= self.max_examples

    def read(self, path: Path) -> None:
        """Append the examples of `path` (until `max_examples` are read);
        DataError naming the file and line."""
        if self.full:
            return
        for where, row in read_rows(path):
            if self.full:
                return
            if row is None:
                continue
            fmt = self._format(row, where, path)
            example = self._example(row, fmt, where)
            if example is None:
                self.skipped.append(where)
            else:
                self.examples.append(example)

    def _format(self, row: dict, where: str, path: Path) -> str:
        """The format to read `row` in: the requested one (other fields are ignored), else the one the first
        row showed, which every later row must show too."""
        if self.fmt is not None and formats.has_markers(row, self.fmt):
            return self.fmt
        detected = formats.detect_format(row, where)
        if self.fmt is None:
            if detected in formats.CHAT_FORMATS:
                chat_tokenizer(self.tokenizer)
            self.fmt, self.fmt_file = detected, path
            self.fmt_origin = f"the file's format (from {where.removeprefix(str(path)).lstrip(':').strip()})"
            return detected
        elsewhere = self.fmt_file is not None and path != self.fmt_file
        origin = f"{self.fmt_file.name}'s format" if elsewhere else self.fmt_origin
        one = "a folder's files" if elsewhere else "a file"
        raise DataError(
            f"{where}: row is in {detected} format, but {origin} is {self.fmt}; {one} must use one format"
        )

    def _example(self, row: dict, fmt: str, where: str) -> Example | None:
        if fmt in formats.CHAT_FORMATS:
            messages = formats.messages(row, fmt, where)
            if not any(m["content"] for m in messages):
                return None
            try:
                return chat_example(self.tokenizer, messages, self.train_on)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
        fields = formats.text_fields(row, fmt, where)
        if not any(fields):
            return None
        if fmt == "text":
            return text_example(self.tokenizer, fields[0])
        example = prompt_completion_example(self.tokenizer, *fields)
        if self.train_on == "all":
            example.labels = list(example.input_ids)
        return example


def _line_list(locations: list[str], limit: int = 5) -> str:
    shown = ", ".join(locations[:limit])
    return shown + (f" and {len(locations) - limit} more" if len(locations) > limit else "")
