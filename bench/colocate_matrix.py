"""The co-location matrix: what each policy did in each cell (trace x load) under each objective, against the
strongest fixed split and the ideal harvest; merged over device calls into the result of record.

Layout (one call's file and the merged matrix alike)::

    {"objectives": {"auto:1.5": {"tpot_ms": ..,
                                 "cells": {"steady/light": {"policies": {"harli": {..}, "static:48": {..}},
                                                            "best_static": "static:48",
                                                            "ideal_tokens_per_s": .., ..}},
                                 "traces": {"steady": {"best_single_static": "static:64", ..}}}},
     "standalone": {"whole_gpu_tokens_per_s": .., "by_train_sms": {"84": .., ..}}, ...}

A cell also holds its ``window`` (length, time scale, requests), ``sweep_start`` (the split the fixed
splits' sweep started from) and, when its call measured it (``--whole-gpu-now``),
``whole_gpu_tokens_per_s``: the trainer alone on the whole GPU in the same call, which the light bar then
divides by; a cell's key is ``trace/load``, ``varying/1x`` for the trace run whole. A policy
row (``policy_row``) holds ``finetune_tokens_per_s``, ``tpot_attainment``, ``violation_rate``,
``violations``, ``clean``, ``share_worth_tokens_per_s`` (the standalone worth of the SMs it held, pauses as
none), ``share_efficiency`` (its tokens/s over that worth),
``fraction_of_ideal``, the TTFT/TPOT/token-interval figures, ``trainer_sm_seconds``, ``share_histogram`` and
``unused_sm_fraction``;
a cell's ``exclusive`` row (the engine alone on the whole GPU) says whether its objectives can be kept at all
(``infeasible``, ``keeps``);
the policy under test is keyed ``harli`` whatever its options (``policy`` gives its full name), variants of
it run beside it for an A/B under their own names (``harli:window=0.1``: never baselines), a window
that failed is a row with ``error``; a policy run several times in a cell (``--repeats``) is one of its
windows, chosen by ``repeated``, with ``repeats`` listing them all. Every policy is judged by the same bar
(``clean``: every token interval counted, and with the objective's ``ttft_ms`` every request's TTFT or its
wait so far; ``tpot_clean`` is the TPOT part alone). With ``--keep-steps N`` a row also holds its first N step records, as lists of ``STEP_COLUMNS``.
``by_train_sms`` includes the whole GPU's SM count. ``finish`` fills in the derived fields: share
efficiencies, fractions of the ideal, ``best_static``, ``best_single_static`` and the ``verdict``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harli_train.colocate.accounting import ATTAINMENT_BAR, RATE_BAR

NOISE = 0.02  # run-to-run noise of finetune tokens/s: a shortfall within it counts as equal
EFFICIENCY_SLACK = 0.10  # harli's share efficiency within this of the best fixed split's
VARYING_BAR = 1.3  # harli over the best single fixed split on the varying trace
LIGHT_FRACTION_BAR = 0.70  # harli's tokens/s over the same-run standalone rate at light load
ALONE = "exclusive"  # the engine alone on the whole GPU, the trainer only after the load: the feasibility reference
STEP_COLUMNS = (  # of the step records a row keeps with --keep-steps (bench/analyze_colocate.py reads them)
    "t",
    "kind",
    "batch",
    "infer_sms",
    "train_sms",
    "train",
    "predicted_s",
    "measured_s",
    "gpu_s",
    "interval_s",
    "micro_steps",
    "trainer_launching",
    "trainer_phase",
    "reason",
    "launch_s",
    "trainer_queue",
    "kv_tokens",
    "prefill_tokens",
    "adapter_rows",
    "mixed_raw_s",
    "host_gap_s",
    "plan_s",
    "train_step",
    "forward_launch_s",
)


def load(path: str | Path) -> dict[str, Any]:
    """A result or matrix file, plain or gzipped (``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def write(path: str | Path, data: dict[str, Any]) -> Path:
    """``data`` as JSON at ``path``: gzipped and compact when the name ends in ``.gz`` (results travel to
    the GPU machine with the tree, whose size is bounded), else indented for reading."""
    path = Path(path)
    if path.suffix == ".gz":
        text = json.dumps(data, separators=(",", ":"), default=str)
        path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    else:
        path.write_text(json.dumps(data, indent=1, default=str))
    return path


def policy_row(summary: dict[str, Any], steps: list[dict[str, Any]], keep_steps: int = 0) -> dict[str, Any]:
    """What the matrix keeps of one window: a co-located run's summary (``colocate/summary.json``), with its
    first ``keep_steps`` step records as lists of ``STEP_COLUMNS``."""
    sv, ft = summary["serving"], summary["finetune"]
    controller = (summary.get("policy_detail") or {}).get("controller") or {}  # a ControlledPolicy's
    row = {
        "policy": summary["policy"],
        "finetune_tokens_per_s": ft["tokens_per_s"],
        "solo_tokens_per_s": ft["solo_tokens_per_s"],
        **{k: sv[k] for k in ("tpot_attainment", "violation_rate", "violations", "clean")},
        **{k: sv.get(k) for k in ("tpot_clean", "ttft_attainment", "requests_without_first_token")},
        **{k: sv[k] for k in ("ttft_ms", "tpot_ms", "token_interval_ms", "requests", "aborted_at_end")},
        "requests_judged": sv["requests_judged"],
        "preemptions": sv.get("preemptions"),
        "decode_oom_recoveries": sv.get("decode_oom_recoveries"),
        "longest_wait": sv.get("longest_wait"),
        "decode_steps": sv["decode_steps"],
        "launched_ahead_steps": sv.get("launched_ahead_steps"),  # colocation.launch_ahead
        "serve_s": summary["phases"]["serve"]["seconds"],
        "peak_decode_batch": (sv.get("decode_batch") or {}).get("max"),
        "trainer_sm_seconds": summary["trainer_sm_seconds"],
        "share_histogram": summary["share_histogram"],
        "unused_sm_fraction": summary.get("unused_sm_fraction"),
        "paused_fraction": summary["trainer_paused_fraction"],
        "mean_infer_sms": summary["mean_infer_sms"],
        "micro_steps": ft["micro_steps"],
        "feed": ft["feed"],
        # Decode rows that ran an adapter (the live one), of every decode row served.
        "adapter_row_fraction": adapter_row_fraction(steps),
        "live_adapter": summary.get("live_adapter"),
        "gc_pauses": summary.get("gc_pauses"),  # the collector holds the GIL: its pauses stall decode
        # a learnt margin's start, end and range over the window's decisions (None: a fixed margin)
        "learned_margin": controller.get("learned_margin"),
        # harli:neighbour=on: the excess learnt beside each kind of trainer micro-step (None: off)
        "neighbour_excess": controller.get("neighbour_excess"),
    }
    if keep_steps:
        row["step_columns"] = list(STEP_COLUMNS)
        row["steps"] = [[r.get(k) for k in STEP_COLUMNS] for r in steps[:keep_steps]]
    return row


REPEAT_KEYS = (
    "finetune_tokens_per_s",
    "clean",
    "tpot_attainment",
    "violation_rate",
    "violations",
    "ttft_attainment",
    "serve_s",
)


def repeated(
    runs: list[tuple[dict[str, Any], list[dict[str, Any]]]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One row (and its step records) for the windows of one policy in one cell run several times
    (``--repeats``): the window of median finetune tokens/s (the lower middle one of an even count) when
    every window is clean, else the window that violated most (so that a policy is clean only if it was
    clean in every window); a failed window is the row when any failed. Each row is one window's, whole;
    ``repeats`` lists every window's figures (``REPEAT_KEYS``) and ``tokens_per_s_spread`` their (min,
    max)."""
    if len(runs) == 1:
        return runs[0]
    failed = [run for run in runs if "error" in run[0]]
    if failed:
        row, steps = failed[0]
    elif all(run[0].get("clean") for run in runs):
        ranked = sorted(runs, key=lambda run: run[0]["finetune_tokens_per_s"])
        row, steps = ranked[(len(ranked) - 1) // 2]
    else:
        row, steps = max(
            runs,
            key=lambda run: (
                not run[0].get("clean"),
                run[0].get("violation_rate") or 0.0,
                -(run[0].get("tpot_attainment") or 0.0),
                -(run[0].get("ttft_attainment") or 1.0),
            ),
        )
    row = dict(row)
    row["repeats"] = [{k: run[0].get(k) for k in ("error", *REPEAT_KEYS) if k in run[0]} for run in runs]
    rates = [run[0]["finetune_tokens_per_s"] for run in runs if "error" not in run[0]]
    if rates:
        row["tokens_per_s_spread"] = [min(rates), max(rates)]
    return row, steps


def adapter_row_fraction(steps: list[dict[str, Any]]) -> float:
    """The share of the decode rows of ``steps`` that ran on an adapter (0.0 without decode rows)."""
    rows = sum(r.get("batch") or 0 for r in steps if r.get("kind") in ("decode", "mixed"))
    lora = sum(r.get("adapter_rows") or 0 for r in steps if r.get("kind") in ("decode", "mixed"))
    return lora / rows if rows else 0.0


def decode_spans(
    steps: list[dict[str, Any]], least_share: Callable[[dict[str, Any]], int | None], total_sms: int
) -> list[tuple[float, int]]:
    """(seconds, trainer SMs) of each step with decode rows: its token interval (its own latency after a step
    without decode rows) and the SMs that ``least_share(row)``, the least decode share meeting the objective
    for it, leaves the trainer (none when no share does)."""
    out = []
    for row in steps:
        if row.get("kind") in ("decode", "mixed") and row.get("batch"):
            share = least_share(row)
            out.append(
                (row.get("interval_s") or row["measured_s"], 0 if share is None else total_sms - share)
            )
    return out


def ideal_tokens_per_s(
    spans: list[tuple[float, int]], duration_s: float, by_train_sms: dict[int, float], whole_gpu: float
) -> float | None:
    """An upper bound on a window's finetune tokens/s for a policy that meets the objective: each span of
    ``spans`` (``decode_spans``) at the standalone rate of its trainer SMs, the rest of ``duration_s``
    (nothing decoding) at the whole GPU's. None without a duration."""
    if duration_s <= 0:
        return None
    decoding = min(sum(s for s, _ in spans), duration_s)
    worth = sum(s * standalone_rate(by_train_sms, sms) for s, sms in spans)
    return (worth + (duration_s - decoding) * whole_gpu) / duration_s


def standalone_rate(by_train_sms: dict[int, float], sms: int) -> float:
    """The trainer's standalone tokens/s on ``sms`` SMs: measured, or linear between the measured counts
    (0 at 0 SMs; the largest measured past it)."""
    points = sorted((int(k), float(v)) for k, v in by_train_sms.items())
    if sms <= 0 or not points:
        return 0.0
    lo = (0, 0.0)
    for hi in points:
        if sms <= hi[0]:
            w = (sms - lo[0]) / (hi[0] - lo[0])
            return lo[1] + w * (hi[1] - lo[1])
        lo = hi
    return points[-1][1]


def share_worth(trainer_sm_seconds: dict[Any, float], by_train_sms: dict[int, float]) -> float | None:
    """Time-weighted standalone tokens/s of the SM counts a policy's trainer held (None: no time)."""
    total = sum(trainer_sm_seconds.values())
    if total <= 0:
        return None
    return sum(s * standalone_rate(by_train_sms, int(k)) for k, s in trainer_sm_seconds.items()) / total


def infeasible(cell: dict[str, Any]) -> bool:
    """Whether the engine alone (``exclusive``: decode on the whole GPU, no trainer while there is load) ran
    in ``cell`` and was not clean: no policy can keep the objectives at this load, training or not."""
    alone = cell["policies"].get(ALONE)
    return alone is not None and "error" not in alone and not alone.get("clean")


def keeps(row: dict[str, Any], cell: dict[str, Any]) -> bool:
    """Whether ``row`` keeps ``cell``'s objectives: it is clean or, in an infeasible cell (``infeasible``),
    it is as clean as the engine alone (its violation rate at most ``RATE_BAR`` above the engine alone's,
    its TPOT and TTFT attainments at most 1 - ``ATTAINMENT_BAR`` below): training added nothing a client
    sees that serving alone would not have shown."""
    if "error" in row:
        return False
    if row.get("clean"):
        return True
    if not infeasible(cell):
        return False
    alone, slack = cell["policies"][ALONE], 1 - ATTAINMENT_BAR

    def attained(r: dict[str, Any], key: str) -> float:
        value = r.get(key)
        return 1.0 if value is None else float(value)

    return (
        (row.get("violation_rate") or 0.0) <= (alone.get("violation_rate") or 0.0) + RATE_BAR
        and attained(row, "tpot_attainment") >= attained(alone, "tpot_attainment") - slack
        and attained(row, "ttft_attainment") >= attained(alone, "ttft_attainment") - slack
    )


def rate_cell(cell: dict[str, Any], by_train_sms: dict[int, float]) -> dict[str, Any]:
    """Fill in each policy's share efficiency and fraction of the ideal, and the cell's best fixed split
    that keeps the objectives (``best_static``, ``keeps``: None when none does)."""
    ideal = cell.get("ideal_tokens_per_s")
    for row in cell["policies"].values():
        if "error" in row:
            continue
        worth = share_worth(row.get("trainer_sm_seconds") or {}, by_train_sms)
        tok = row["finetune_tokens_per_s"]
        row["share_worth_tokens_per_s"] = worth
        row["share_efficiency"] = tok / worth if worth else None
        row["fraction_of_ideal"] = tok / ideal if ideal else None
    clean = [
        (name, row)
        for name, row in cell["policies"].items()
        if name.startswith("static:") and keeps(row, cell)
    ]
    best = max(clean, key=lambda kv: kv[1]["finetune_tokens_per_s"], default=(None, None))
    cell["best_static"] = best[0]
    return cell


def best_single_static(cells: dict[str, dict[str, Any]]) -> str | None:
    """The one fixed split that keeps the objectives (``keeps``) in every load of a trace with the highest
    mean tokens/s over those loads (what an operator would fix); None when no split does in all of them."""
    candidates = None
    for cell in cells.values():
        clean = {n for n, r in cell["policies"].items() if n.startswith("static:") and keeps(r, cell)}
        candidates = clean if candidates is None else candidates & clean
    if not candidates:
        return None

    def mean_tokens(name: str) -> float:
        return sum(c["policies"][name]["finetune_tokens_per_s"] for c in cells.values()) / len(cells)

    return max(sorted(candidates), key=mean_tokens)


def top_split(matrix: dict[str, Any]) -> str | None:
    """``static:N`` of the largest decode share that leaves the trainer SMs (the ladder's last rung with a
    trainer), from the run's set-up or, in a merged matrix, its calls'; None when no set-up says."""
    setups = [matrix.get("setup") or {}, *((c or {}).get("setup") or {} for c in matrix.get("calls", []))]
    for setup in setups:
        rungs = (setup.get("ladder") or {}).get("rungs") or []
        shares = [r["infer_sms"] for r in rungs if r.get("train_sms", 0) > 0]
        if shares:
            return f"static:{max(shares)}"
    return None


def is_harli(name: str) -> bool:
    """``harli`` (the policy under test, whatever its options) or a variant of it run beside it for an A/B
    (keyed by its own name, e.g. ``harli:window=0.1``): never a baseline."""
    return name == "harli" or name.startswith("harli:")


def best_other_baseline(cell: dict[str, Any]) -> str | None:
    """The policy other than harli (and its variants) and the fixed splits (``temporal``: the trainer in the
    slack decode leaves on the whole GPU; ``streams``; ``exclusive``: no training while serving) that keeps the
    objectives (``keeps``) with the most finetune tokens/s; None when none does."""
    clean = [
        (name, row)
        for name, row in cell["policies"].items()
        if not is_harli(name) and not name.startswith("static:") and keeps(row, cell)
    ]
    return max(clean, key=lambda kv: kv[1]["finetune_tokens_per_s"], default=(None, None))[0]


def verdict(matrix: dict[str, Any]) -> dict[str, Any]:
    """Each bar of the co-location issues, per cell and overall. harli must be clean and beat the best clean
    fixed split. Where none is clean, the cell passes only if the sweep ran the largest decode share that
    leaves the trainer SMs (``top_split``) and it was not clean either: no fixed split keeps this objective
    while training, and harli is judged against the best other clean baseline (``best_baseline``, e.g.
    training only while the engine is idle, which must have run). A cell with no clean baseline at all
    fails, as does one without a clean fixed split where the sweep did not show that none exists. Where
    the engine alone is not clean either (``infeasible``), "clean" reads "as clean as the engine alone"
    for every policy (``keeps``)."""
    cells_out, ok = {}, True
    top = top_split(matrix)
    for obj_name, obj in matrix.get("objectives", {}).items():
        for key, cell in obj.get("cells", {}).items():
            trace, load_name = key.split("/", 1)
            harli = cell["policies"].get("harli", {})
            best = cell.get("best_static")
            base = cell["policies"].get(best) if best else None
            v: dict[str, Any] = {"harli_clean": keeps(harli, cell) if harli else False, "best_static": best}
            if infeasible(cell):
                v["infeasible"] = True
                v["alone_violation_rate"] = cell["policies"][ALONE].get("violation_rate")
            tok = harli.get("finetune_tokens_per_s")
            top_row = cell["policies"].get(top) if top else None
            v["no_fixed_split_clean"] = bool(
                base is None and top_row is not None and "error" not in top_row and not keeps(top_row, cell)
            )
            temporal = cell["policies"].get("temporal")
            if v["no_fixed_split_clean"] and tok is not None and temporal and "error" not in temporal:
                other = best_other_baseline(cell)
                other_tok = cell["policies"][other]["finetune_tokens_per_s"] if other else 0.0
                v["best_baseline"] = other
                v["vs_best_baseline"] = tok / other_tok if other_tok else None
                # A clean baseline that trained nothing (its micro-steps never fitted) is beaten by any
                # clean harli that trained.
                v["beats_best_baseline"] = other is not None and tok >= (1 - NOISE) * other_tok and tok > 0
            if base is not None and tok is not None:
                v["vs_best_static"] = (
                    tok / base["finetune_tokens_per_s"] if base["finetune_tokens_per_s"] else None
                )
                v["beats_best_static"] = v["vs_best_static"] is not None and v["vs_best_static"] >= 1 - NOISE
                eff, base_eff = harli.get("share_efficiency"), base.get("share_efficiency")
                v["share_efficiency_ok"] = (
                    eff is not None and base_eff is not None and eff >= (1 - EFFICIENCY_SLACK) * base_eff
                )
            single = obj.get("traces", {}).get(trace, {}).get("best_single_static")
            if single and tok is not None and single in cell["policies"]:
                v["vs_best_single_static"] = tok / max(
                    cell["policies"][single]["finetune_tokens_per_s"], 1e-9
                )
            # The whole GPU's standalone rate measured in the call that ran the cell (--whole-gpu-now), else
            # the standalone file's.
            solo = cell.get("whole_gpu_tokens_per_s") or matrix.get("standalone", {}).get(
                "whole_gpu_tokens_per_s"
            )
            if load_name == "light" and solo and tok is not None:
                v["fraction_of_standalone"] = tok / solo
                # Its two factors: what the SMs harli gave the trainer (pauses included) are worth, and
                # share_efficiency, what the trainer made of them.
                worth = harli.get("share_worth_tokens_per_s")
                v["shares_worth_of_standalone"] = worth / solo if worth else None
            beats = (
                bool(v.get("beats_best_static") and v.get("share_efficiency_ok"))
                if base is not None
                else bool(v.get("beats_best_baseline"))
            )
            v["pass"] = bool(
                v["harli_clean"]
                and beats
                and (trace != "varying" or (v.get("vs_best_single_static") or 0) >= VARYING_BAR)
                and (load_name != "light" or (v.get("fraction_of_standalone") or 0) >= LIGHT_FRACTION_BAR)
            )
            ok &= v["pass"]
            cells_out[f"{obj_name} {key}"] = v
    return {"cells": cells_out, "all_pass": ok and bool(cells_out)}


def finish(matrix: dict[str, Any]) -> dict[str, Any]:
    """Rate every cell, name each trace's best single fixed split, and judge: the derived fields of a run's
    result or of a merged matrix (recomputed after a merge, from the rows)."""
    by_sms = {int(k): v for k, v in matrix.get("standalone", {}).get("by_train_sms", {}).items()}
    for obj in matrix.get("objectives", {}).values():
        traces: dict[str, dict[str, Any]] = {}
        for key, cell in obj.get("cells", {}).items():
            rate_cell(cell, by_sms)
            traces.setdefault(key.split("/", 1)[0], {})[key] = cell
        obj["traces"] = {
            t: {**obj.get("traces", {}).get(t, {}), "best_single_static": best_single_static(cells)}
            for t, cells in traces.items()
        }
    matrix["verdict"] = verdict(matrix)
    return matrix


STEP_KEYS = ("steps", "step_columns")  # a row's step records (--keep-steps), left in the run's own file


def merge(
    parts: list[dict[str, Any]], names: list[str] | None = None, keep_steps: bool = False
) -> dict[str, Any]:
    """One matrix from per-call results: their cells side by side; a cell that several calls ran holds the
    policy rows of all of them (a later call's row of the same policy replaces an earlier one, as do its
    cell fields, such as the ideal, where it has them); the standalone rates of the first call that has
    them (calls meant for one matrix share one ``--standalone`` file: ``standalone_differs`` lists the calls
    whose rates were others, whose ideals therefore rest on other rates); each call's set-up kept under
    ``calls``, with its file's name from ``names`` (a matrix merged before brings its own calls). The rows'
    step records stay in the calls' own files unless ``keep_steps`` (the matrix is the summary; a row's
    steps are in the file its call names)."""
    out: dict[str, Any] = {"objectives": {}, "standalone": {}, "calls": [], "standalone_differs": []}
    rates = lambda part: {
        k: part.get("standalone", {}).get(k) for k in ("whole_gpu_tokens_per_s", "by_train_sms")
    }
    for i, part in enumerate(parts):
        if "calls" in part and "setup" not in part:  # a matrix merged before: its calls, as they were
            out["calls"].extend(part["calls"])
        else:
            call = {k: part.get(k) for k in ("env", "setup", "args", "total_s", "out_of_time")}
            if names is not None:
                call["file"] = names[i]
            out["calls"].append(call)
        if not out["standalone"] and part.get("standalone"):
            out["standalone"] = part["standalone"]
        elif part.get("standalone") and rates(part) != rates(out):
            out["standalone_differs"].append(i)
        for name, obj in part.get("objectives", {}).items():
            dst = out["objectives"].setdefault(name, {"cells": {}, "traces": {}})
            dst.update({k: v for k, v in obj.items() if k not in ("cells", "traces")})
            for key, cell in obj.get("cells", {}).items():
                into = dst["cells"].setdefault(key, {"policies": {}})
                into.update({k: v for k, v in cell.items() if k != "policies" and v is not None})
                rows = cell.get("policies", {})
                if not keep_steps:
                    rows = {p: {k: v for k, v in r.items() if k not in STEP_KEYS} for p, r in rows.items()}
                into["policies"].update(rows)
    return finish(out)
