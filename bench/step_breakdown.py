"""Two readings of a co-location window's step records (no GPU needed), printed by analyze_colocate.py:

- ``paused_time``: the seconds the trainer launched nothing, by cause: whole-GPU mixed steps, decode alone
  while the trainer's queued work drains before one (``DRAIN_REASON``), prefill steps, and the rest; and how
  they group into episodes (runs of consecutive paused steps). A drain is not lost to the trainer as the
  SM-seconds count it: its queued micro-steps still run. Of the drain, ``drain_alone_s`` are its steps that
  ran under ``ALONE_RATIO`` of their prediction (made for decode beside the trainer's queued work): the queue
  had ended before them or early in them, decode ran alone, and only the step being planned one ahead (while
  the queue still ran) kept the prefill waiting. ``handoffs``: the whole-GPU steps ``harli:handoff=gpu``
  launched while that work still ran (``HANDOFF_REASON``), and how many of them went past the objective.
- ``decode_shares``: for each decode batch, the shares its steps beside the trainer ran on. A batch that
  needs a larger share than the batches around it points at a kernel or a model term (the trainer trails
  the larger share for a while after each such step).
- ``grows``: how often decode grew from one share to another between consecutive decode steps. Grows past
  the share decode left a step earlier (32 -> 64 after 48 -> 32) point at a miss learnt GPU-wide.
- ``beside_seconds``: the seconds of each (decode share, trainer SMs) pair beside the trainer; SMs neither
  holds (132 - both) are what the trainer's trailing rung gives up.

A step's seconds are the time since the step before it ended (its token interval, host time included):
its plan governs that span.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

DRAIN_REASON = "mixed: decode alone"  # harli's plan while the trainer's queued work leaves the GPU
# A drain step measured under this fraction of its prediction ran (mostly) with the trainer's queue ended:
# decode alone on its share runs ~0.7x of its time beside a running trainer (H100, 32 SMs, 2026-12-07).
ALONE_RATIO = 0.8
HANDOFF_REASON = "once the trainer's queued work ends"  # harli:handoff=gpu's whole-GPU step


def paused_time(rows: list[dict[str, Any]], total_sms: int, tpot_s: float | None = None) -> dict[str, Any]:
    """Seconds the trainer held no SMs, by cause, and the episodes they came in; the hand-off steps, and of
    them those whose token interval went past ``tpot_s`` (when given)."""
    causes: Counter = Counter()
    episodes: list[Counter] = []
    open_episode = False
    for prev, row in zip(rows, rows[1:], strict=False):
        dt = row["t"] - prev["t"]
        if row.get("train") != "none" and (row.get("train_sms") or 0) > 0:
            open_episode = False
            continue
        if row["kind"] == "mixed" and row["infer_sms"] == total_sms:
            cause = "whole_gpu_mixed"
        elif row["kind"] == "decode" and (row.get("reason") or "").startswith(DRAIN_REASON):
            cause = "drain"
            measured, predicted = row.get("measured_s"), row.get("predicted_s")
            if measured and predicted and measured < ALONE_RATIO * predicted:
                causes["drain_alone"] += dt
        elif row["kind"] == "prefill":
            cause = "prefill"
        else:
            cause = "other"
        causes[cause] += dt
        if not open_episode:
            episodes.append(Counter())
            open_episode = True
        episodes[-1][cause] += 1
        episodes[-1][cause + "_s"] += dt
    kinds = ("whole_gpu_mixed", "drain", "drain_alone", "prefill", "other")
    out: dict[str, Any] = {f"{c}_s": causes[c] for c in kinds}
    out["episodes"] = len(episodes)
    handoffs = [r for r in rows if HANDOFF_REASON in (r.get("reason") or "")]
    out["handoffs"] = len(handoffs)
    out["handoffs_over"] = sum(1 for r in handoffs if tpot_s and (r.get("interval_s") or 0.0) > tpot_s)
    for cause in ("whole_gpu_mixed", "drain"):
        out[f"{cause}_steps_per_episode"] = (
            statistics.median(e[cause] for e in episodes) if episodes else None
        )
    return out


def decode_shares(rows: list[dict[str, Any]]) -> dict[int, dict[int, int]]:
    """batch -> {decode share: steps} over the decode steps that ran beside the trainer."""
    out: dict[int, Counter] = defaultdict(Counter)
    for row in rows:
        if row["kind"] == "decode" and row.get("train") == "beside" and row.get("batch"):
            out[int(row["batch"])][int(row["infer_sms"])] += 1
    return {b: dict(sorted(c.items())) for b, c in sorted(out.items())}


def grows(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Counts of decode steps on a larger share than the decode step just before them, keyed "from -> to"."""
    out: Counter = Counter()
    prev = None
    for row in rows:
        if row["kind"] != "decode":
            continue
        if prev is not None and row["infer_sms"] > prev:
            out[f"{prev} -> {row['infer_sms']}"] += 1
        prev = row["infer_sms"]
    return dict(out.most_common())


def beside_seconds(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of the decode steps beside the trainer, keyed "decode D + trainer T" by their SMs, most first."""
    out: Counter = Counter()
    for prev, row in zip(rows, rows[1:], strict=False):
        if row["kind"] == "decode" and row.get("train") == "beside" and row.get("train_sms"):
            out[f"decode {row['infer_sms']} + trainer {row['train_sms']}"] += row["t"] - prev["t"]
    return dict(out.most_common())
