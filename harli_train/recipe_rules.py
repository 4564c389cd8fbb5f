"""How a recipe key is declared and checked: a dataclass field whose metadata holds its ``Rule`` (a kind, a
limit, whether null is allowed), and the one error a recipe that breaks a rule raises (``RecipeError``, naming
where, the key, what was expected and what was found). ``config`` declares the sections with these."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

OVERRIDE_SOURCE = "command line override"
UNPLACED = "config"  # where an error raised in code happened; load_recipe names the file or override instead


class RecipeError(ValueError):
    """A recipe the trainer cannot use; names the file (or command line), the key, expected and found."""

    def __init__(self, where: str, key: str, expected: str, found: str):
        self.where, self.key, self.expected, self.found = where, key, expected, found
        super().__init__(f"{where}: {key + ': ' if key else ''}expected {expected}, got {found}")


class Mismatch(ValueError):
    """A value of the wrong kind; its message, if any, says more than the kind's noun can."""


def did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def describe(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


# Kinds: a noun for messages and a coercion that raises Mismatch.
def _as_float(v: Any) -> float:
    # PyYAML reads `1e-4` (no dot) as a string, so numeric strings are numbers here.
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise Mismatch()
    try:
        number = float(v)
    except ValueError:
        raise Mismatch() from None
    if not math.isfinite(number):  # `inf` and `nan` pass every `>` test, and poison training silently
        raise Mismatch("not a finite number")
    return number


def _exactly(kind: type) -> Callable[[Any], Any]:
    def coerce(v: Any) -> Any:
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):  # `steps: true` is no int
            raise Mismatch()
        return v

    return coerce


def _as_pair(v: Any) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise Mismatch()
    return (_as_float(v[0]), _as_float(v[1]))


def _as_path(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise Mismatch()
    return str(Path(v).expanduser().resolve())


# Limits: words that follow the kind's noun, and the test behind them.
@dataclass(frozen=True, slots=True)
class Limit:
    text: str
    test: Callable[[Any], bool]


def above(lo: float) -> Limit:
    return Limit(f"> {lo}", lambda v: v > lo)


def at_least(lo: float) -> Limit:
    return Limit(f">= {lo}", lambda v: v >= lo)


def within(lo: float, hi: float, open_top: bool = False) -> Limit:
    if open_top:
        return Limit(f"in [{lo}, {hi})", lambda v: lo <= v < hi)
    return Limit(f"in [{lo}, {hi}]", lambda v: lo <= v <= hi)


def among(*choices: str) -> Limit:
    return Limit(f"among {', '.join(choices)}", lambda v: v in choices)


EXISTS = Limit("that exists", lambda path: Path(path).exists())
NOT_EMPTY = Limit("that is not empty", lambda text: bool(text.strip()))


# Kinds by name: a noun for messages and a coercion that raises Mismatch; ``register_kind`` adds one.
KINDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "int": ("an integer", _exactly(int)),
    "float": ("a number", _as_float),
    "bool": ("true or false", _exactly(bool)),
    "str": ("a string", _exactly(str)),
    "pair": ("a pair of numbers", _as_pair),
    "path": ("a path", _as_path),  # in a recipe file, relative to the file's folder
}


def register_kind(name: str, noun: str, coerce: Callable[[Any], Any]) -> None:
    """A kind of value keys may declare: ``noun`` names it in errors, ``coerce`` raises Mismatch."""
    KINDS[name] = (noun, coerce)


@dataclass(frozen=True, slots=True)
class Rule:
    kind: str
    limit: Limit | None = None
    optional: bool = False

    def expectation(self) -> str:
        text = KINDS[self.kind][0] + (f" {self.limit.text}" if self.limit else "")
        return text + (" or null" if self.optional else "")

    def apply(self, dotted: str, value: Any) -> Any:
        """The value coerced to the rule's kind; RecipeError naming `dotted` if it does not fit."""
        if value is None and self.optional:
            return None
        try:
            value = KINDS[self.kind][1](value)
        except Mismatch as e:
            detail = f" ({e})" if str(e) else ""
            raise RecipeError(UNPLACED, dotted, self.expectation(), describe(value) + detail) from None
        if self.limit and not self.limit.test(value):
            raise RecipeError(UNPLACED, dotted, self.expectation(), repr(value))
        return value


def key(default: Any, kind: str, limit: Limit | None = None, optional: bool = False) -> Any:
    """A recipe key: a dataclass field carrying its Rule. `default=MISSING` makes the key required."""
    meta = {"rule": Rule(kind, limit, optional)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def validate(section: Any, name: str) -> None:
    for f in fields(section):
        setattr(section, f.name, f.metadata["rule"].apply(f"{name}.{f.name}", getattr(section, f.name)))
