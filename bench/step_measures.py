"""Measures over a co-location window's per-step records (no GPU needed): the rows themselves, the trainer's
share, measured/predicted by transition, share and chunk, violations, host gaps, stalls and spikes.
``analyze_colocate.py`` prints them; ``replan_mixed.py`` and ``replay_controller.py`` read the rows."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

KINDS = ("grow", "shrink", "exit whole GPU", "after prefill", "same share")
CHUNK_SIZES = ((1, 63), (64, 127), (128, 255), (256, None))  # prefill tokens of a mixed step, inclusive
BATCH_SIZES = ((1, 1), (2, 8), (9, 16), (17, 32), (33, 64), (65, None))  # decode rows, inclusive
# The columns of the step records in files without step_columns (before 2026-11-29's last runs).
LEGACY_STEP_COLUMNS = (
    "t",
    "kind",
    "batch",
    "infer_sms",
    "train_sms",
    "train",
    "measured_s",
    "micro_steps",
    "reason",
    "kv_tokens",
    "prefill_tokens",
)


def rows_of(entry: dict) -> list[dict[str, Any]]:
    """The window's kept per-step records as dicts (older files lack some columns)."""
    cols = entry.get("step_columns") or LEGACY_STEP_COLUMNS
    return [dict(zip(cols, r, strict=False)) for r in entry.get("steps", [])]


def decode_beside(rows: list[dict]) -> list[dict]:
    """The decode steps beside the trainer among ``rows`` that carry a measured latency."""
    return [r for r in rows if r["kind"] == "decode" and r.get("train") == "beside" and r.get("measured_s")]


def trainer_share(rows: list[dict], total_sms: int) -> tuple[float, float]:
    """Time-weighted trainer SMs over the window, and the seconds it held none."""
    held = idle = span = 0.0
    for prev, row in zip(rows, rows[1:], strict=False):
        dt = row["t"] - prev["t"]
        sms = (row.get("train_sms") or 0) if row.get("train") != "none" else 0
        held += dt * sms
        idle += dt * (sms == 0)
        span += dt
    return (held / span if span else 0.0), idle


def transitions(rows: list[dict], total_sms: int) -> dict[str, list[float]]:
    """measured/predicted of every decode step, by what came before it."""
    out: dict[str, list[float]] = defaultdict(list)
    prev = None
    for row in rows:
        if row["kind"] == "prefill":
            prev = "prefill"
            continue
        if row["kind"] != "decode":
            continue
        pred, meas = row.get("predicted_s"), row.get("measured_s")
        if pred and meas and row["infer_sms"] != total_sms:
            if prev == "prefill":
                kind = "after prefill"
            elif prev is None or row["infer_sms"] == prev["infer_sms"]:
                kind = "same share"
            elif row["infer_sms"] > prev["infer_sms"]:
                kind = "grow"
            else:
                kind = "exit whole GPU" if prev["infer_sms"] == total_sms else "shrink"
            out[kind].append(meas / pred)
        prev = row
    return out


def size_range(n: int, ranges: tuple[tuple[int, int | None], ...]) -> str:
    """The range of ``ranges`` (inclusive ``(lo, hi)``, ``hi`` None: open) that ``n`` falls in, as 'lo-hi',
    'lo' (a range of one) or 'lo+'; '0' when none holds it."""
    for lo, hi in ranges:
        if n >= lo and (hi is None or n <= hi):
            return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"
    return "0"


def batch_size(batch: int) -> str:
    """The ``BATCH_SIZES`` range a decode step of ``batch`` rows falls in (the decode GEMV's row tiles)."""
    return size_range(batch, BATCH_SIZES)


def beside_fit(rows: list[dict]) -> dict[tuple[int, int], list[float]]:
    """measured/predicted of every decode step beside the trainer, by (decode SMs, the least batch of its
    ``BATCH_SIZES`` range): where the co-run model under-predicts is a share and a batch range, not a
    transition."""
    out: dict[tuple[int, int], list[float]] = defaultdict(list)
    lows = [lo for lo, _ in BATCH_SIZES]
    for row in decode_beside(rows):
        if row.get("predicted_s"):
            low = max(lo for lo in lows if lo <= row["batch"])
            out[(row["infer_sms"], low)].append(row["measured_s"] / row["predicted_s"])
    return out


def beside_queue_fit(rows: list[dict]) -> dict[str, list[float]]:
    """measured/predicted of every decode step beside the trainer, by the kind of the trainer's oldest
    micro-step still on the GPU as the step started (``trainer_queue``; "nothing queued" when none was,
    "unknown" in files without the column): which of the trainer's phases decode runs slower beside than
    the co-run model says (the loss micro-step streams its logits, pure memory traffic)."""
    out: dict[str, list[float]] = defaultdict(list)
    for row in decode_beside(rows):
        if row.get("predicted_s"):
            queue = row.get("trainer_queue")
            kind = "unknown" if queue is None else (queue.split("+")[0] or "nothing queued")
            out[kind].append(row["measured_s"] / row["predicted_s"])
    return out


def chunk_size(tokens: int) -> str:
    """The ``CHUNK_SIZES`` range ``tokens`` prefill tokens fall in, as 'lo-hi' (or 'lo+')."""
    return size_range(tokens, CHUNK_SIZES)


def mixed_chunks(rows: list[dict], total_sms: int) -> tuple[dict[str, list[float]], float]:
    """measured/predicted of every mixed step with a prediction, by ``chunk_size`` of its prefill tokens; and
    the seconds (token intervals) of mixed steps on the whole GPU."""
    out: dict[str, list[float]] = defaultdict(list)
    whole = 0.0
    for row in rows:
        if row["kind"] != "mixed" or not row.get("prefill_tokens"):
            continue
        pred, meas = row.get("predicted_s"), row.get("measured_s")
        if pred and meas:
            out[chunk_size(row["prefill_tokens"])].append(meas / pred)
        if row["infer_sms"] == total_sms:
            whole += row.get("interval_s") or meas or 0.0
    return out, whole


def near_budget(rows: list[dict], budget_s: float, headroom: float, ahead: int = 5) -> dict[str, float]:
    """What harli's grow headroom held: the seconds of decode steps beside the trainer predicted within
    ``headroom`` of ``budget_s`` (where the trainer keeps clear of the next larger share too), how many such
    steps there were, and of the grows (a decode step on a larger share than the decode step before it),
    how many came within ``ahead`` steps after such a step, against ``grows_by_chance``: as many as would if
    grows fell on decode steps at random (the share of decode steps within ``ahead`` after such a step)."""
    out = {
        "near_budget_s": 0.0,
        "near_budget_steps": 0,
        "grows": 0,
        "grows_after_near": 0,
        "grows_by_chance": 0.0,
    }
    if not headroom:
        return out
    last_near, last_decode = None, None
    decode = covered = 0
    for i, (row, after) in enumerate(zip(rows, rows[1:], strict=False)):
        if row["kind"] != "decode":
            continue
        decode += 1
        near_before = last_near is not None and i - last_near <= ahead
        covered += near_before
        if last_decode is not None and row["infer_sms"] > last_decode["infer_sms"]:
            out["grows"] += 1
            out["grows_after_near"] += near_before
        last_decode = row
        pred = row.get("predicted_s")
        if row.get("train") == "beside" and pred and pred > (1 - headroom) * budget_s:
            out["near_budget_s"] += after["t"] - row["t"]
            out["near_budget_steps"] += 1
            last_near = i
    out["grows_by_chance"] = out["grows"] * covered / decode if decode else 0.0
    return out


def violations(rows: list[dict], tpot_s: float) -> list[list[dict]]:
    """Each violating decode step with the two steps before it."""
    found = []
    for i, row in enumerate(rows):
        seen = row.get("interval_s") or row.get("measured_s") or 0.0
        if row["kind"] == "decode" and seen > tpot_s:
            found.append(rows[max(0, i - 2) : i + 1])
    return found


def host_gaps(rows: list[dict]) -> dict[str, list[float]]:
    """Host seconds between consecutive decode steps (token interval less the step's own latency), split by
    whether the trainer thread was launching when the step started ("unknown" in files without it), and by the
    kind of micro-step it was launching where the file has it ("trainer launching bwd")."""
    out: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        interval, measured = row.get("interval_s"), row.get("measured_s")
        if row["kind"] != "decode" or interval is None or measured is None:
            continue
        busy = row.get("trainer_launching")
        key = "unknown" if busy is None else ("trainer launching" if busy else "trainer idle")
        out[key].append(interval - measured)
        if busy and row.get("trainer_phase"):
            out[f"{key} {row['trainer_phase']}"].append(interval - measured)
    return out


def stalls(rows: list[dict]) -> list[dict]:
    return [
        r
        for r in rows
        if r["kind"] == "decode"
        and r.get("predicted_s")
        and (r.get("measured_s") or 0) > 2 * r["predicted_s"]
    ]


def spikes(rows: list[dict], factor: float = 1.3) -> list[dict]:
    """Decode steps whose GPU span exceeds ``factor`` x every neighbour's (two each side) on the same share: the
    isolated slow steps that no smooth model predicts. ``launch_s`` in them tells a stream that waited for its
    host (the launch took the extra time) from a GPU that ran slow."""
    dec = [r for r in rows if r["kind"] == "decode" and r.get("gpu_s")]
    found = []
    for i, row in enumerate(dec):
        near = [
            dec[j]["gpu_s"]
            for j in (i - 2, i - 1, i + 1, i + 2)
            if 0 <= j < len(dec) and dec[j]["infer_sms"] == row["infer_sms"]
        ]
        if near and row["gpu_s"] > factor * max(near):
            found.append(row)
    return found


def windows(results: dict) -> list[tuple[str, float, dict[str, dict]]]:
    """(objective, TPOT seconds, {cell: {policy: row}}) of a result: one per objective of the matrix layout
    (colocate_matrix.py), or the one of an older single-objective file (its label '')."""
    if "objectives" in results:
        return [
            (
                name,
                obj["tpot_ms"] * 1e-3,
                {key: cell["policies"] for key, cell in obj.get("cells", {}).items()},
            )
            for name, obj in results["objectives"].items()
        ]
    return [("", results["setup"]["objective_tpot_ms"] * 1e-3, results.get("cells", {}))]
