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
- measured/predicted latency of decode steps beside the trainer by their share and batch, and by the
  trainer's micro-step on the GPU as they started (its oldest queued: fwd, bwd, loss, next, optim); with
  ``harli:neighbour=on``, the excess it learnt beside each kind by the window's end;
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
The measures over the step records are ``step_measures.py``'s.
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
import colocate_tables  # noqa: E402
import common  # noqa: E402
import harli_defaults  # noqa: E402
from colocate_matrix import load  # noqa: E402
from stall_report import sampled_stalls, slow_launches  # noqa: E402
from step_breakdown import beside_seconds, decode_shares, grows, paused_time  # noqa: E402
from step_measures import (  # noqa: E402
    CHUNK_SIZES,
    KINDS,
    batch_size,
    beside_fit,
    beside_queue_fit,
    chunk_size,
    host_gaps,
    mixed_chunks,
    near_budget,
    rows_of,
    spikes,
    stalls,
    trainer_share,
    transitions,
    violations,
    windows,
)

from harli_train.policy_names import DEFAULT_GROW_HEADROOM, parse_harli_options  # noqa: E402


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


def learns_margin(name: str, setup: dict[str, Any]) -> bool:
    """Whether the policy ``name`` of a result with this set-up learnt its margin."""
    options = harli_defaults.options_of(name, setup)
    return bool(options and options["learn_margin"])


def margin_text(learned: dict[str, float] | None, margin: float | None, learns: bool) -> str:
    """A row's margin: the run's fixed one, or a learnt one as start -> end (least-largest in the window),
    or its start alone where the result did not record its range (written before 2026-12-07)."""
    if learned:
        return f"{learned['start']:.3g} -> {learned['now']:.3g} ({learned['min']:.3g}-{learned['max']:.3g})"
    if margin is None:
        return "-"
    return f"{margin:.3g} learnt, range not recorded" if learns else f"{margin:.3g}"


def analyze(results: dict) -> dict[str, Any]:
    """Per cell (named 'objective cell' in the matrix layout) and policy with step records: what the module
    says; measured/predicted by transition and host gaps per policy, over every cell."""
    total = results.get("env", {}).get("sms") or 132
    report: dict[str, Any] = {"objectives": {}, "cells": {}}
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    gaps: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    chunks: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    beside: dict[str, dict[tuple[int, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    by_queue: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    setup = results.get("setup", {})
    margin = setup.get("margin")
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
                for kind, rs in beside_queue_fit(rows).items():
                    by_queue[name][kind] += rs
                learned = entry.get("learned_margin")
                at = harli_defaults.decided_margin(entry, margin)
                held = (
                    near_budget(rows, tpot_s * (1 - at), grow_headroom(entry.get("policy") or name))
                    if at is not None
                    else {}
                )
                report["cells"].setdefault(f"{objective} {cell}".strip(), {})[name] = {
                    **held,
                    "tokens_per_s": entry["finetune_tokens_per_s"],
                    "violations": entry["violations"],
                    "margin": margin_text(learned, margin, learns_margin(entry.get("policy") or name, setup)),
                    "trainer_sms": sms,
                    "tokens_per_s_per_sm": entry["finetune_tokens_per_s"] / sms if sms else None,
                    "no_trainer_s": idle,
                    "whole_gpu_mixed_s": whole_gpu_mixed_s,
                    "paused": paused_time(rows, total, tpot_s),
                    "decode_shares": decode_shares(rows),
                    "grows": grows(rows),
                    "beside_s": beside_seconds(rows),
                    "rebuilt_chunks": feed.get("rebuilt_chunks"),
                    "gpu_busy_s": feed.get("gpu_busy_s"),
                    "launch_host_s": feed.get("launch_host_s"),
                    "device_allocs": (entry.get("allocator") or {}).get("num_device_alloc"),
                    "neighbour_excess": entry.get("neighbour_excess"),
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
    sizes = [chunk_size(lo) for lo, _ in CHUNK_SIZES]  # the table's order
    report["mixed_chunks"] = {
        name: {size: _tail(by_size[size], 95) for size in sizes if size in by_size}
        for name, by_size in chunks.items()
    }
    report["beside_fit"] = {
        name: {
            f"{sms} SMs, batch {batch_size(low)}": _tail(rs, 95) for (sms, low), rs in sorted(by_key.items())
        }
        for name, by_key in beside.items()
    }
    report["beside_queue_fit"] = {
        name: {kind: _tail(rs, 99) for kind, rs in sorted(by_kind.items())}
        for name, by_kind in by_queue.items()
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


def _tail(ratios: list[float], pct: int) -> dict[str, float]:
    """Steps, median, the ``pct``th percentile (nearest rank, as ``p<pct>``) and max of ratios."""
    ordered = sorted(ratios)
    return {
        "steps": len(ordered),
        "median": statistics.median(ordered),
        f"p{pct}": ordered[max(math.ceil(pct / 100 * len(ordered)) - 1, 0)],
        "max": ordered[-1],
    }


def _print_ratios(title: str, by_policy: dict[str, dict[str, dict]], head: str, tail: str) -> None:
    """A table of ``_tail`` rows, one per policy and key of ``by_policy``."""
    print(f"\n{title}")
    rows = [
        [name, key, t["steps"], t["median"], t[tail], t["max"]]
        for name, by_key in by_policy.items()
        for key, t in by_key.items()
    ]
    print(common.table(rows, ["policy", head, "steps", "median", tail, "max"]))


def print_breakdown(report: dict[str, Any], least: float = 0.01) -> None:
    """The trainer's paused seconds by cause, and the decode shares of each batch with at least ``least`` of
    a window's decode steps beside the trainer."""
    print("\nthe trainer paused, seconds by cause (episodes: runs of paused steps; steps: median an episode)")
    paused = [
        [cell, name, p["whole_gpu_mixed_s"], p["drain_s"], p.get("drain_alone_s", 0.0), p["prefill_s"]]
        + [p["other_s"], p["episodes"], f"{p.get('handoffs', 0)} ({p.get('handoffs_over', 0)})"]
        + [p["whole_gpu_mixed_steps_per_episode"], p["drain_steps_per_episode"]]
        for cell, ps in report["cells"].items()
        for name, r in ps.items()
        if (p := r["paused"])["episodes"]
    ]
    head = ["cell", "policy", "whole-GPU mixed", "drain", "of it alone", "prefill", "other", "episodes"]
    head += ["hand-offs (over)", "mixed steps", "drain steps"]
    print(common.table(paused, head))
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
        print(colocate_tables.tables(matrix))
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
                    r["margin"],
                ]
            )
    head = ["cell", "policy", "tok/s", "viol.", "trainer SMs", "tok/s/SM", "no trainer s", "rebuilt", "GPU s"]
    print(common.table(rows, [*head, "launch s", "cudaMalloc", "margin"]))
    print("\nmeasured / predicted decode step, by what came before it")
    trows = [
        [name, kind, t["steps"], t["median"], t["max"], t["over_1"]]
        for name, by_kind in report["transitions"].items()
        for kind in KINDS
        if (t := by_kind.get(kind))
    ]
    print(common.table(trows, ["policy", "before", "steps", "median", "max", "over 1"]))
    _print_ratios(
        "measured / predicted decode step beside the trainer, by its share and batch",
        report["beside_fit"],
        "decode share, batch",
        "p95",
    )
    _print_ratios(
        "measured / predicted decode step beside the trainer, by the trainer's micro-step on the GPU",
        report["beside_queue_fit"],
        "oldest queued",
        "p99",
    )
    excess = [
        [cell, name, kind, k["steps"], k["value"], k["factor"], ex["all"], ex["steps_sized"]]
        for cell, ps in report["cells"].items()
        for name, r in ps.items()
        if (ex := r.get("neighbour_excess"))
        for kind, k in ex["kinds"].items()
    ]
    if excess:
        print(
            "\nharli:neighbour=on at the window's end: each kind's quantile of measured / predicted beside it"
        )
        head = ["cell", "policy", "kind", "steps", "quantile", "factor", "all steps' quantile", "steps sized"]
        print(common.table(excess, head))
    print("\nhost ms between decode steps (token interval less the step's latency)")
    grows = [
        [name, key, g["steps"], g["p50"], g["p99"], g["max"]]
        for name, by_key in report["host_gaps_ms"].items()
        for key, g in sorted(by_key.items())
    ]
    print(common.table(grows, ["policy", "when", "steps", "p50", "p99", "max"]))
    _print_ratios(
        "measured / predicted mixed step, by its prefill tokens", report["mixed_chunks"], "tokens", "p95"
    )
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
