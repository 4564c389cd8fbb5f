"""Probe: does a profiled decode step "beside the trainer" really run beside it?

    python bench/probe_corun.py [RECIPE] [--colocate-with MODEL] [--shares 32,48,64] [--set KEY=VALUE ...]

Assembles the co-located job (``assembly.assemble``, the command line's assembly) up to its profile, then
times decode steps alone and beside the profile's trainer workload on a few shares, twice in the same
process: with the trainer's micro-steps for the whole window queued up front (``UpFront``, how profiles
were made until 2026-12-05) and topped up before every timed launch (``profile_grid.Corunner``). Reports
each point's beside / alone ratio for both. A share whose up-front ratios fall to ~1.0 at some points
while the topped-up ones hold the share's slowdown had its co-run points partly timed alone. Writes
``$OUT/probe_corun.json`` and prints a table. On the CPU stand-in both run the trainer in a thread (the
flow only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
import common  # noqa: E402

from harli_train.colocate import assembly, profile_grid  # noqa: E402
from harli_train.colocate.profile_grid import Corunner, run_profile_grid  # noqa: E402
from harli_train.config import load_recipe  # noqa: E402

WARMUP, REPS, CORUN_REPS = 3, 10, 30


class UpFront(Corunner):
    """The trainer's micro-steps for the whole window (twice its decode steps' time) queued before it."""

    def __init__(self, corun_fn, part, step_s, t_step, record=None) -> None:
        super().__init__(corun_fn, part, step_s, t_step, record)
        window_s = step_s * (WARMUP + CORUN_REPS)
        self.n = min(int(2.0 * window_s / max(t_step or window_s, 1e-6)) + 2, 5000)

    def start(self, on_gpu: bool) -> None:
        if not on_gpu:
            super().start(on_gpu)
            return
        import torch

        with torch.cuda.stream(self.part.train_stream):
            for _ in range(self.n):
                self.fn(self.part)
        self.launched = self.n

    def top_up(self) -> None:
        pass


class _Captured(Exception):
    pass


def assembled(recipe: str, model: str, overrides: list[str]) -> dict:
    """The engine, SM ladder and profile workload the assembly hands its profile (nothing profiled)."""
    got: dict = {}

    def capture(engine, ladder, model_id, corun, max_batch, *args, **kwargs):
        got.update(engine=engine, ladder=ladder, corun=corun)
        raise _Captured

    cfg = load_recipe(recipe, [f"output.dir={tempfile.mkdtemp(prefix='probe_corun-')}", *overrides])
    build = assembly.build_predictor
    assembly.build_predictor = capture
    try:
        assembly.assemble(cfg, model, warm_up=False, spatial=True)
    except _Captured:
        pass
    finally:
        assembly.build_predictor = build
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", nargs="?", default="recipes/llama-8b-lora.yaml")
    ap.add_argument("--colocate-with", default="llama-8b")
    ap.add_argument("--shares", default="32,48,64")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--kv-lens", default="256,1024")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    got = assembled(args.recipe, args.colocate_with, args.set)
    engine, ladder, corun = got["engine"], got["ladder"], got["corun"]
    if corun is None:  # the CPU stand-in's assembly has no GPU workload: a busy loop stands in
        corun = lambda part: sum(range(20_000))  # noqa: E731
    engine.register(ladder.partitions)
    shares = [int(s) for s in args.shares.split(",")]
    shares = [s for s in shares if s in ladder.shares] or ladder.shares[1:3]
    grid = dict(
        batches=tuple(int(b) for b in args.batches.split(",")),
        kv_lens=tuple(int(k) for k in args.kv_lens.split(",")),
        shares=shares,
        warmup=WARMUP,
        reps=REPS,
        corun_reps=CORUN_REPS,
    )
    ratios: dict[str, dict[tuple, float]] = {}
    for mode, cls in (("up_front", UpFront), ("topped_up", Corunner)):
        profile_grid.Corunner = cls
        try:
            rows = run_profile_grid(engine.synthetic_decode, corun, ladder, **grid)
        finally:
            profile_grid.Corunner = Corunner
        alone = {(r["infer_sms"], r["batch"], r["kv_len"]): r["latency_s"] for r in rows if not r["corun"]}
        ratios[mode] = {
            (r["infer_sms"], r["batch"], r["kv_len"]): r["latency_s"]
            / alone[(r["infer_sms"], r["batch"], r["kv_len"])]
            for r in rows
            if r["corun"]
        }
    points = sorted(ratios["topped_up"])
    table = [
        [s, b, kv, ratios["up_front"].get((s, b, kv)), ratios["topped_up"][(s, b, kv)]] for s, b, kv in points
    ]
    by_share = {
        s: {mode: statistics.pstdev([v for k, v in r.items() if k[0] == s]) for mode, r in ratios.items()}
        for s in shares
    }
    path = common.write_json(
        "probe_corun.json",
        {
            "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in grid.items()},
            "points": [
                dict(zip(("infer_sms", "batch", "kv_len", "up_front", "topped_up"), row, strict=True))
                for row in table
            ],
            "spread_by_share": by_share,
        },
    )
    print(f"wrote {path}")
    print(common.table(table, ["decode SMs", "batch", "kv_len", "beside/alone up front", "topped up"]))
    print(common.table([[s, v["up_front"], v["topped_up"]] for s, v in by_share.items()],
                       ["decode SMs", "spread up front", "spread topped up"]))  # fmt: skip


if __name__ == "__main__":
    main()
