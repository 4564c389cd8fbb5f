"""The co-location matrix's printed tables (``colocate_matrix`` holds the layout, the derived fields and the
verdict they read): harli against the fixed splits and the ideal per cell (``table``), the light-load bar's
factors (``light_bar_table``) and harli's variants against harli (``variants_table``); ``tables`` joins
them."""

from __future__ import annotations

from typing import Any

import common
from colocate_matrix import LIGHT_FRACTION_BAR, is_harli, keeps


def table(matrix: dict[str, Any]) -> str:
    """harli against best_static, best_single_static and the ideal, per objective and cell."""
    head = [
        "objective", "cell", "harli tok/s", "clean", "attain", "viol. rate", "ttft p99", "best static", "tok/s",
        "harli/best", "single", "harli/single", "ideal", "harli/ideal", "eff harli", "eff best", "pass",
    ]  # fmt: skip
    rows = []
    verdicts = matrix.get("verdict", {}).get("cells", {})
    for obj_name, obj in matrix.get("objectives", {}).items():
        for key, cell in obj.get("cells", {}).items():
            h = cell["policies"].get("harli", {})
            best = cell.get("best_static")
            b = cell["policies"].get(best, {}) if best else {}
            single = obj.get("traces", {}).get(key.split("/")[0], {}).get("best_single_static")
            v = verdicts.get(f"{obj_name} {key}", {})
            other = cell["policies"].get(v.get("best_baseline") or "", {})
            rows.append(
                [
                    obj_name,
                    key,
                    _f(h.get("finetune_tokens_per_s"), 0),
                    _clean_column(h, cell),
                    _f(h.get("tpot_attainment"), 3),
                    _f(h.get("violation_rate"), 4),
                    _f((h.get("ttft_ms") or {}).get("p99"), 0),
                    best or _no_split(v),
                    _f((b or other).get("finetune_tokens_per_s"), 0),
                    _f(v.get("vs_best_static", v.get("vs_best_baseline")), 2),
                    single or "-",
                    _f(v.get("vs_best_single_static"), 2),
                    _f(cell.get("ideal_tokens_per_s"), 0),
                    _f(h.get("fraction_of_ideal"), 2),
                    _f(h.get("share_efficiency"), 2),
                    _f(b.get("share_efficiency"), 2),
                    "PASS" if v.get("pass") else "FAIL",
                ]
            )
    return common.table(rows, head)


def tables(matrix: dict[str, Any]) -> str:
    """Every table a matrix prints, in order: ``table``, then the light bar's and the variants' when they
    have rows (what the bench and ``analyze_colocate.py --merge`` print last)."""
    parts = (table(matrix), light_bar_table(matrix), variants_table(matrix))
    return "\n".join(p for p in parts if p)


def light_bar_table(matrix: dict[str, Any]) -> str:
    """harli's fraction of the whole GPU's standalone rate in each light cell, against ``LIGHT_FRACTION_BAR``,
    as its two factors (the verdict's ``shares_worth_of_standalone`` times harli's ``share_efficiency``) and
    the fraction of the window harli's trainer was paused; "" when no light cell has the fraction."""
    head = ["objective", "cell", "of standalone", "bar", "shares' worth", "x share eff.", "paused"]
    rows = []
    for name, v in matrix.get("verdict", {}).get("cells", {}).items():
        if v.get("fraction_of_standalone") is None:
            continue
        obj_name, key = name.split(" ", 1)
        harli = matrix["objectives"][obj_name]["cells"][key]["policies"].get("harli", {})
        rows.append(
            [
                obj_name,
                key,
                _f(v["fraction_of_standalone"], 3),
                _f(LIGHT_FRACTION_BAR, 2),
                _f(v.get("shares_worth_of_standalone"), 3),
                _f(harli.get("share_efficiency"), 3),
                _f(harli.get("paused_fraction"), 3),
            ]
        )
    return common.table(rows, head) if rows else ""


def variants_table(matrix: dict[str, Any]) -> str:
    """harli's variants (``--policies harli:OPTIONS``) against ``harli`` in the same cells: "" when none ran."""
    head = ["objective", "cell", "policy", "tok/s", "/harli", "clean", "attain", "viol. rate", "ttft p99"]
    rows = []
    for obj_name, obj in matrix.get("objectives", {}).items():
        for key, cell in obj.get("cells", {}).items():
            names = [n for n in cell["policies"] if is_harli(n)]
            if len(names) < 2:
                continue
            base = cell["policies"].get("harli", {}).get("finetune_tokens_per_s")
            for name in names:
                row = cell["policies"][name]
                tok = row.get("finetune_tokens_per_s")
                rows.append(
                    [
                        obj_name,
                        key,
                        name,
                        _f(tok, 0),
                        _f(tok / base if tok is not None and base else None, 3),
                        "error" if "error" in row else _clean_column(row, cell),
                        _f(row.get("tpot_attainment"), 3),
                        _f(row.get("violation_rate"), 4),
                        _f((row.get("ttft_ms") or {}).get("p99"), 0),
                    ]
                )
    return common.table(rows, head) if rows else ""


def _clean_column(row: dict[str, Any], cell: dict[str, Any]) -> str:
    if row.get("clean"):
        return "yes"
    return "as alone" if row and keeps(row, cell) else "no"


def _no_split(v: dict[str, Any]) -> str:
    """The best-static column of a cell without a clean fixed split: the baseline judged instead, if any."""
    alone = f"infeasible (alone {v.get('alone_violation_rate') or 0:.4f}); " if v.get("infeasible") else ""
    if not v.get("no_fixed_split_clean"):
        return f"{alone}none clean"
    if "best_baseline" not in v:
        return f"{alone}none clean; temporal not run"
    return f"{alone}none clean; {v['best_baseline'] or 'no training'}"


def _f(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
