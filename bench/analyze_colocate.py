"""Where a co-location run's violations and trainer throughput came from (no GPU needed), and the matrix.

    python bench/analyze_colocate.py RESULT.json[.gz]        # a bench_colocate result written with --keep-steps
    python bench/analyze_colocate.py --merge A.json B.json ... --out bench/results/<date>-bench_colocate-matrix.json.gz

``--merge`` puts the results of several device calls into one matrix (``colocate_matrix.merge``: the
derived fields and the verdict recomputed over all of them), writes it and prints its table.

Otherwise it reads one result (the matrix layout, per objective; or the single-objective layout of
bench_colocate before 2026-12) and prints, for every policy with per-step records:
- per cell: finetune tokens/s, violations, the trainer's time-weighted SMs and tokens/s per SM, the seconds
  it held no SMs, rebuilt chunks, and the trainer thread's GPU-busy and launch seconds (the SMs are those the
  plans gave the trainer: with prefill paused, micro-steps already queued still run during a prefill, so
  tokens/s per SM reads high there);
- measured/predicted latency of decode steps by what came before them: a grow, a shrink between shares, an
  exit from the whole GPU (the trainer resuming), the first step after a prefill, or the same share;
- every violation with the two steps before it;
- the host time between decode steps, split by whether the trainer thread was launching at the time (its host
  work competes with the decode loop's: the GIL, torch's allocator);
- stalls (a step over twice its prediction), with the step's GPU span where the run recorded it, so a slow
  GPU shows apart from a host delay;
- measured/predicted latency of mixed steps by their prefill tokens (``CHUNK_SIZES``), and the seconds of
  mixed steps on the whole GPU (the trainer paused): how well the mixed-step model sizes the chunks;
- harli's grow headroom: the seconds of decode steps predicted within it of the budget (the trainer then
  kept clear of the next larger share too), and how many of the window's grows came within 5 steps of one;
- where the trainer's paused seconds went and the decode shares each batch took (``step_breakdown``);
- steps that launched slowly and, from a run with ``--sample-stalls``, where the decode thread sat in each
  sampled stall (``stall_report``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import colocate_matrix  # noqa: E402
import common  # noqa: E402
from colocate_matrix import STEP_COLUMNS, load  # noqa: E402
from stall_report import sampled_stalls, slow_launches  # noqa: E402
from step_breakdown import beside_seconds, decode_shares, grows, paused_time  # noqa: E402

from harli_train.policy_names import DEFAULT_GROW_HEADROOM, parse_harli_options  # noqa: E402

KINDS = ("grow", "shrink", "exit whole GPU", "after prefill", "same share")
CHUNK_SIZES = ((1, 63), (64, 127), (128, 255), (256, None))  # prefill tokens of a mixed step, inclusive
BATCH_SIZES = ((1, 1), (2, 8), (9, 16), (17, 32), (33, 64), (65, None))  # decode rows, inclusive
# Files before 2026-11-29's last runs lack these (older ones also lack step_columns).
ADDED_COLUMNS = (
    "predicted_s",
    "gpu_s",
    "interval_s",
    "trainer_launching",
    "trainer_phase",
    "launch_s",
    "trainer_queue",
    "adapter_rows",
    "mixed_raw_s",
    "host_gap_s",
    "plan_s",
    "train_step",
    "forward_launch_s",
)


def rows_of(entry: dict) -> list[dict[str, Any]]:
    """The window's kept per-step records as dicts (older files lack some columns)."""
    cols = entry.get("step_columns") or [c for c in STEP_COLUMNS if c not in ADDED_COLUMNS]
    return [dict(zip(cols, r, strict=False)) for r in entry.get("steps", [])]


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
    for row in rows:
        pred, meas = row.get("predicted_s"), row.get("measured_s")
        if row["kind"] == "decode" and row.get("train") == "beside" and pred and meas:
            low = max(lo for lo in lows if lo <= row["batch"])
            out[(row["infer_sms"], low)].append(meas / pred)
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


def _step(row: dict) -> str:
    ms = lambda k: "-" if row.get(k) is None else f"{1e3 * row[k]:.1f}"
    return (
        f"t={row['t']:.3f} {row['kind']} batch {row.get('batch')} on {row.get('infer_sms')} SMs "
        f"(trainer {row.get('train_sms')}, {row.get('train')}): predicted {ms('predicted_s')} ms, "
        f"measured {ms('measured_s')}, GPU {ms('gpu_s')} (launch {ms('launch_s')}, forward {ms('forward_launch_s')}), interval {ms('interval_s')}"
        + (
            f", host gap before it {ms('host_gap_s')} (plan {ms('plan_s')})"
            if row.get("host_gap_s") is not None
            else ""
        )
        + (f", trainer launching {row['trainer_phase']}" if row.get("trainer_phase") else "")
        + (f", queued {row['trainer_queue']}" if row.get("trainer_queue") else "")
        + f" | {row.get('reason')}"
    )


def grow_headroom(policy: str) -> float:
    """harli's grow headroom as the policy's name sets it (0 for every other policy)."""
    base, _, options = policy.partition(":")
    if base != "harli":
        return 0.0
    try:
        return parse_harli_options(options).get("grow_headroom", DEFAULT_GROW_HEADROOM)
    except ValueError:
        return DEFAULT_GROW_HEADROOM


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


def analyze(results: dict) -> dict[str, Any]:
    """Per cell (named 'objective cell' in the matrix layout) and policy with step records: what the module
    says; measured/predicted by transition and host gaps per policy, over every cell."""
    total = results.get("env", {}).get("sms") or 132
    report: dict[str, Any] = {"objectives": {}, "cells": {}}
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    gaps: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    chunks: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    beside: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    margin = results.get("setup", {}).get("margin")
    for objective, tpot_s, cells in windows(results):
        report["objectives"][objective] = tpot_s * 1e3
        for cell, policies in cells.items():
            for name, entry in policies.items():
                if not isinstance(entry, dict) or "steps" not in entry:
                    continue
                rows = rows_of(entry)
                sms, idle = trainer_share(rows, total)
                feed = entry.get("feed", {})
                for kind, rs in transitions(rows, total).items():
                    ratios[name][kind] += rs
                for key, gs in host_gaps(rows).items():
                    gaps[name][key] += gs
                by_size, whole_gpu_mixed_s = mixed_chunks(rows, total)
                for size, rs in by_size.items():
                    chunks[name][size] += rs
                for key, rs in beside_fit(rows).items():
                    beside[name][key] += rs
                held = (
                    near_budget(rows, tpot_s * (1 - margin), grow_headroom(entry.get("policy") or name))
                    if margin is not None
                    else {}
                )
                report["cells"].setdefault(f"{objective} {cell}".strip(), {})[name] = {
                    **held,
                    "tokens_per_s": entry["finetune_tokens_per_s"],
                    "violations": entry["violations"],
                    "trainer_sms": sms,
                    "tokens_per_s_per_sm": entry["finetune_tokens_per_s"] / sms if sms else None,
                    "no_trainer_s": idle,
                    "whole_gpu_mixed_s": whole_gpu_mixed_s,
                    "paused": paused_time(rows, total),
                    "decode_shares": decode_shares(rows),
                    "grows": grows(rows),
                    "beside_s": beside_seconds(rows),
                    "rebuilt_chunks": feed.get("rebuilt_chunks"),
                    "gpu_busy_s": feed.get("gpu_busy_s"),
                    "launch_host_s": feed.get("launch_host_s"),
                    "device_allocs": (entry.get("allocator") or {}).get("num_device_alloc"),
                    "violating_steps": [[_step(r) for r in ctx] for ctx in violations(rows, tpot_s)],
                    "stalls": [_step(r) for r in stalls(rows)],
                    "spikes": [_step(r) for r in spikes(rows)],
                    "slow_launches": slow_launches(rows),
                    "sampled_stalls": sampled_stalls(entry.get("stall_samples") or []),
                }
    report["transitions"] = {
        name: {
            kind: {
                "steps": len(rs),
                "median": statistics.median(rs),
                "max": max(rs),
                "over_1": sum(r > 1.0 for r in rs),
            }
            for kind, rs in by_kind.items()
        }
        for name, by_kind in ratios.items()
    }
    report["mixed_chunks"] = {
        name: {
            size: {
                "steps": len(rs),
                "median": statistics.median(rs),
                "p95": sorted(rs)[max(math.ceil(0.95 * len(rs)) - 1, 0)],  # nearest rank
                "max": max(rs),
            }
            for size, rs in by_size.items()
        }
        for name, by_size in chunks.items()
    }
    report["beside_fit"] = {
        name: {
            f"{sms} SMs, batch {batch_size(low)}": {
                "steps": len(rs),
                "median": statistics.median(rs),
                "p95": sorted(rs)[max(math.ceil(0.95 * len(rs)) - 1, 0)],  # nearest rank
                "max": max(rs),
            }
            for (sms, low), rs in sorted(by_key.items())
        }
        for name, by_key in beside.items()
    }
    report["host_gaps_ms"] = {
        name: {
            key: {
                "steps": len(gs),
                "p50": 1e3 * statistics.median(gs),
                "p99": 1e3 * sorted(gs)[int(0.99 * (len(gs) - 1))],
                "max": 1e3 * max(gs),
            }
            for key, gs in by_key.items()
        }
        for name, by_key in gaps.items()
    }
    return report


def print_breakdown(report: dict[str, Any], least: float = 0.01) -> None:
    """The trainer's paused seconds by cause, and the decode shares of each batch with at least ``least`` of
    a window's decode steps beside the trainer."""
    print("\nthe trainer paused, seconds by cause (episodes: runs of paused steps; steps: median an episode)")
    paused = [
        [cell, name, p["whole_gpu_mixed_s"], p["drain_s"], p["prefill_s"], p["other_s"], p["episodes"]]
        + [p["whole_gpu_mixed_steps_per_episode"], p["drain_steps_per_episode"]]
        for cell, ps in report["cells"].items()
        for name, r in ps.items()
        if (p := r["paused"])["episodes"]
    ]
    head = ["cell", "policy", "whole-GPU mixed", "drain", "prefill", "other", "episodes", "mixed steps"]
    print(common.table(paused, [*head, "drain steps"]))
    print("\ndecode steps beside the trainer: the shares each batch ran on (steps)")
    shares = []
    for cell, ps in report["cells"].items():
        for name, r in ps.items():
            total = sum(sum(c.values()) for c in r["decode_shares"].values())
            for batch, by_share in r["decode_shares"].items():
                if sum(by_share.values()) >= least * total:
                    shares.append([cell, name, batch, "  ".join(f"{s}: {n}" for s, n in by_share.items())])
    print(common.table(shares, ["cell", "policy", "batch", "share: steps"]))
    print("\ndecode's grows between consecutive decode steps, and the seconds beside the trainer by SMs held")
    rows = [
        [cell, name, "  ".join(f"{k}: {n}" for k, n in list(r["grows"].items())[:6])]
        + ["  ".join(f"{k}: {t:.2f}" for k, t in list(r["beside_s"].items())[:4])]
        for cell, ps in report["cells"].items()
        for name, r in ps.items()
    ]
    print(common.table(rows, ["cell", "policy", "grows (most first)", "seconds beside the trainer"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "results", nargs="?", help="a bench_colocate JSON (or .json.gz) written with --keep-steps"
    )
    ap.add_argument(
        "--merge", nargs="+", metavar="RESULT", help="bench_colocate results to merge into one matrix"
    )
    ap.add_argument("--out", help="with --merge: where the matrix goes (.json or .json.gz)")
    ap.add_argument(
        "--keep-steps",
        action="store_true",
        help="with --merge: keep the rows' step records in the matrix (by default they stay in the results)",
    )
    args = ap.parse_args()
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out (the matrix file)")
        names = [Path(p).name for p in args.merge]
        matrix = colocate_matrix.merge([load(Path(p)) for p in args.merge], names, args.keep_steps)
        print(f"wrote {colocate_matrix.write(args.out, matrix)} ({len(args.merge)} calls)")
        print(colocate_matrix.table(matrix))
        return
    if not args.results:
        ap.error("give a result to analyze, or --merge RESULT ... --out MATRIX")
    report = analyze(load(Path(args.results)))
    print(
        ", ".join(
            f"objective {name or 'of the run'}: {ms:.3f} ms" for name, ms in report["objectives"].items()
        )
    )
    rows = []
    for cell, policies in report["cells"].items():
        for name, r in policies.items():
            rows.append(
                [
                    cell,
                    name,
                    r["tokens_per_s"],
                    r["violations"],
                    r["trainer_sms"],
                    r["tokens_per_s_per_sm"],
                    r["no_trainer_s"],
                    r["rebuilt_chunks"],
                    r["gpu_busy_s"],
                    r["launch_host_s"],
                    r["device_allocs"],
                ]
            )
    head = ["cell", "policy", "tok/s", "viol.", "trainer SMs", "tok/s/SM", "no trainer s", "rebuilt", "GPU s"]
    print(common.table(rows, [*head, "launch s", "cudaMalloc"]))
    print("\nmeasured / predicted decode step, by what came before it")
    trows = [
        [name, kind, t["steps"], t["median"], t["max"], t["over_1"]]
        for name, by_kind in report["transitions"].items()
        for kind in KINDS
        if (t := by_kind.get(kind))
    ]
    print(common.table(trows, ["policy", "before", "steps", "median", "max", "over 1"]))
    print("\nmeasured / predicted decode step beside the trainer, by its share and batch")
    brows = [
        [name, where, t["steps"], t["median"], t["p95"], t["max"]]
        for name, by_key in report["beside_fit"].items()
        for where, t in by_key.items()
    ]
    print(common.table(brows, ["policy", "decode share, batch", "steps", "median", "p95", "max"]))
    print("\nhost ms between decode steps (token interval less the step's latency)")
    grows = [
        [name, key, g["steps"], g["p50"], g["p99"], g["max"]]
        for name, by_key in report["host_gaps_ms"].items()
        for key, g in sorted(by_key.items())
    ]
    print(common.table(grows, ["policy", "when", "steps", "p50", "p99", "max"]))
    print("\nmeasured / predicted mixed step, by its prefill tokens")
    mrows = [
        [name, size, m["steps"], m["median"], m["p95"], m["max"]]
        for name, by_size in report["mixed_chunks"].items()
        for size in (chunk_size(lo) for lo, _ in CHUNK_SIZES)
        if (m := by_size.get(size))
    ]
    print(common.table(mrows, ["policy", "tokens", "steps", "median", "p95", "max"]))
    mixed_s = [
        [cell, name, r["whole_gpu_mixed_s"]] for cell, ps in report["cells"].items() for name, r in ps.items()
    ]
    print(common.table(mixed_s, ["cell", "policy", "s of mixed steps on the whole GPU"]))
    print("\nharli's grow headroom: decode steps beside the trainer predicted within it of the budget")
    near = [
        [
            cell,
            name,
            r["near_budget_steps"],
            r["near_budget_s"],
            r["grows"],
            r["grows_after_near"],
            r["grows_by_chance"],
        ]
        for cell, ps in report["cells"].items()
        for name, r in ps.items()
        if r.get("near_budget_steps")
    ]
    head = ["cell", "policy", "steps", "seconds", "grows", "within 5 steps of one", "by chance"]
    print(common.table(near, head))
    print_breakdown(report)
    for cell, policies in report["cells"].items():
        for name, r in policies.items():
            for ctx in r["violating_steps"]:
                print(f"\nviolation, {cell} {name}:\n  " + "\n  ".join(ctx))
            for line in r["stalls"]:
                print(f"\nstall, {cell} {name}: {line}")
            for line in r["spikes"]:
                print(f"\nGPU spike, {cell} {name}: {line}")
            for line in r["slow_launches"]:
                print(f"\nslow launch, {cell} {name}: {line}")
            for line in r["sampled_stalls"]:
                print(f"\nsampled stall, {cell} {name}: {line}")


if __name__ == "__main__":
    main()
