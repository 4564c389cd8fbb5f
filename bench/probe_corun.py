"""Probe: the profile's decode steps beside the trainer, with its workload eager and as CUDA graphs.

    python bench/probe_corun.py [RECIPE] [--colocate-with MODEL] [--shares 32,48,64] [--set KEY=VALUE ...]

Assembles the co-located job (``assembly.assemble``, the command line's assembly) up to its profile, then
runs the profile grid's decode points (``run_profile_grid``: alone, then beside the trainer's micro-steps
queued up front) on a few shares twice in one process: with the profile's trainer workload
(``predictor_setup.corun_workload``, its eager launches whatever ``GRAPHED_CORUN`` says) and with the same
workload captured as one CUDA graph per partition (``predictor_setup.GraphedWorkload``: a launch costs
microseconds, so the queue really is ahead of the GPU, as the graphed trainer of a co-located run is).
For each it reports every point's beside / alone ratio, each share's spread of them, the workload's
micro-step seconds, the points whose trainer queue ran dry before their decode steps ended
(``step_timing.time_beside`` times such a point once more with the queue its first timing says it needed,
unless that queue would be over twice as long), and the co-run error of the predictor fitted to those samples (``LatencyPredictor.fit``'s
in-sample MAPE). A workload whose ratios hold one factor a share where the other's scatter is the one whose
profile the predictor can fit. Writes ``$OUT/probe_corun.json`` and prints tables. On the CPU stand-in only
the eager workload runs (a busy loop in a thread; the flow only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
import common  # noqa: E402

from harli_train.colocate import assembly, predictor_setup  # noqa: E402
from harli_train.colocate.predictor import LatencyPredictor  # noqa: E402
from harli_train.colocate.predictor_setup import GraphedWorkload  # noqa: E402
from harli_train.colocate.profile_grid import run_profile_grid  # noqa: E402
from harli_train.config import load_recipe  # noqa: E402

WARMUP, REPS, CORUN_REPS = 3, 10, 30


class _Captured(Exception):
    pass


def assembled(recipe: str, model: str, overrides: list[str]) -> dict[str, Any]:
    """The engine, SM ladder and profile workload the assembly hands its profile (nothing is profiled: the
    assembly stops there)."""
    got: dict[str, Any] = {}

    def capture(engine, ladder, model_id, corun, max_batch, *args, **kwargs):
        got.update(engine=engine, ladder=ladder, corun=corun)
        raise _Captured

    cfg = load_recipe(recipe, [f"output.dir={tempfile.mkdtemp(prefix='probe_corun-')}", *overrides])
    build, graphs = assembly.build_predictor, predictor_setup.GRAPHED_CORUN
    assembly.build_predictor, predictor_setup.GRAPHED_CORUN = capture, False
    try:
        assembly.assemble(cfg, model, warm_up=False, spatial=True)
    except _Captured:
        pass
    finally:
        assembly.build_predictor, predictor_setup.GRAPHED_CORUN = build, graphs
    return got


def summarize(rows: list[dict], shares: list[int], total_sms: int, kv_bytes: float) -> dict[str, Any]:
    def point(r: dict) -> tuple[int, int, int]:
        return r["infer_sms"], r["batch"], r["kv_len"]

    alone = {point(r): r["latency_s"] for r in rows if not r["corun"]}
    ratios = {point(r): r["latency_s"] / alone[point(r)] for r in rows if r["corun"]}
    step_s = {r["infer_sms"]: r["train_step_s"] for r in rows if r["corun"]}
    uncovered = [point(r) for r in rows if r["corun"] and r.get("corun_covered") is False]
    by_share = {}
    for s in shares:
        mine = [v for k, v in ratios.items() if k[0] == s]
        if mine:
            by_share[s] = {
                "min": min(mine),
                "median": statistics.median(mine),
                "max": max(mine),
                "spread": statistics.pstdev(mine),
                "train_step_s": step_s.get(s),
                "uncovered": sum(1 for k in uncovered if k[0] == s),
                "points": len(mine),
            }
    fit = LatencyPredictor.fit(rows, total_sms, kv_bytes).fit_report
    return {
        "points": [[*k, v] for k, v in sorted(ratios.items())],
        "by_share": by_share,
        "fit_corun_mape_pct": fit.get("fit_corun_mape_pct"),
        "fit_solo_mape_pct": fit.get("fit_solo_mape_pct"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", nargs="?", default="recipes/llama-8b-lora.yaml")
    ap.add_argument("--colocate-with", default="llama-8b")
    ap.add_argument("--shares", default="16,32,48,64,80")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--kv-lens", default="256,1707")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    got = assembled(args.recipe, args.colocate_with, args.set)
    engine, ladder, eager = got["engine"], got["ladder"], got["corun"]
    on_gpu = eager is not None
    if not on_gpu:  # the CPU stand-in's assembly has no profile workload: a busy loop stands in
        eager = lambda part: sum(range(20_000))  # noqa: E731
    engine.register(ladder.partitions)
    shares = [s for s in (int(x) for x in args.shares.split(",")) if s in ladder.shares] or ladder.shares[1:3]
    grid = dict(
        batches=tuple(int(b) for b in args.batches.split(",")),
        kv_lens=tuple(int(k) for k in args.kv_lens.split(",")),
        shares=shares,
        warmup=WARMUP,
        reps=REPS,
        corun_reps=CORUN_REPS,
    )
    workloads = {"eager": eager}
    if on_gpu:
        workloads["graphed"] = GraphedWorkload(eager)
    result: dict[str, Any] = {"grid": {k: list(v) if isinstance(v, tuple) else v for k, v in grid.items()}}
    for name, fn in workloads.items():
        try:
            rows = run_profile_grid(engine.synthetic_decode, fn, ladder, **grid)
        except Exception as err:  # a workload that cannot be captured is a finding, not the end of the probe
            result[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        result[name] = summarize(rows, shares, ladder.total_sms, engine.kv_bytes_per_token)
    path = common.write_json("probe_corun.json", result)
    print(f"wrote {path}")
    for name in workloads:
        r = result[name]
        if "error" in r:
            print(f"\n{name}: {r['error']}")
            continue
        print(
            f"\n{name}: co-run fit MAPE {r['fit_corun_mape_pct']:.2f} %, solo {r['fit_solo_mape_pct']:.2f} %"
        )
        rows = [
            [
                s,
                v["min"],
                v["median"],
                v["max"],
                v["spread"],
                v["train_step_s"],
                f"{v['uncovered']}/{v['points']}",
            ]
            for s, v in r["by_share"].items()
        ]
        heads = ["decode SMs", "beside/alone min", "median", "max", "spread", "micro-step s", "queue ran dry"]
        print(common.table(rows, heads))


if __name__ == "__main__":
    main()
