"""Which harli a result's policy name meant: the defaults of harli's options in force when a result was
written, a result's policy name restated under today's defaults, and the margin a row decided under.

A name such as ``harli`` or ``harli:grow=0`` lists only the options that differ from the defaults, and the
defaults move as A/Bs decide them (``margin=learn`` became the default on 2026-12-07). ``bench_colocate.py``
records the defaults in force as ``setup.harli_defaults``; a result without that record was written while
every default but ``margin`` was today's and the margin was fixed. ``as_ran`` turns a stored name into the
name that builds the same policy now, so that a replay of "the run's policy" replays what ran.
"""

from __future__ import annotations

import inspect
from typing import Any

from harli_train.policy_names import harli_name, parse_harli_options


def in_force() -> dict[str, Any]:
    """harli's options and their defaults now (``harli_name``'s keyword defaults: one place states them)."""
    return {k: p.default for k, p in inspect.signature(harli_name).parameters.items()}


def of_result(setup: dict[str, Any]) -> dict[str, Any]:
    """The defaults a result's run had: its ``harli_defaults`` record over today's (for options added since),
    or, for a result written before the record existed, today's with the margin fixed."""
    recorded = setup.get("harli_defaults")
    if recorded is None:
        return in_force() | {"learn_margin": False}
    return in_force() | {k: v for k, v in recorded.items() if k in in_force()}


def options_of(name: str, setup: dict[str, Any]) -> dict[str, Any] | None:
    """Every option of the harli variant ``name`` as a result's run built it (None: not a harli variant)."""
    base, _, options = name.partition(":")
    return of_result(setup) | parse_harli_options(options) if base == "harli" else None


def as_ran(name: str, setup: dict[str, Any]) -> str:
    """``name`` (a harli variant as a result stores it) restated so that today's ``make_policy`` builds what
    that result's run built; other policies' names are returned as they are."""
    options = options_of(name, setup)
    return name if options is None else harli_name(**options)


def decided_margin(row: dict[str, Any], margin: float | None) -> float | None:
    """The margin a row's window decided under: a learnt margin's median over the window (its
    ``learned_margin`` record), else the run's fixed ``margin``."""
    learned = row.get("learned_margin")
    return learned["median"] if learned else margin
