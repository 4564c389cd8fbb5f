"""A tokenized training example, and the error the data pipeline raises for the user's data."""

from __future__ import annotations

from dataclasses import dataclass

IGNORE_INDEX = -100


class DataError(ValueError):
    """A problem with the user's data or tokenizer files; the message says which file (and line)."""


@dataclass(slots=True)
class Example:
    """One tokenized example. Labels are unshifted (labels[t] is the target at position t; the model
    shifts) and IGNORE_INDEX where no loss is taken."""

    input_ids: list[int]
    labels: list[int]
