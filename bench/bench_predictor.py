"""SM ladder, latency predictor and controller on the GPU: every figure of issue 5 from one run.

    python bench/bench_predictor.py            # H200: writes $OUT/bench_predictor.json, prints a table last
    python bench/bench_predictor.py --dry-run  # CPU: the same flow on the stand-in ladder, simulated decode
    python bench/bench_predictor.py --engine harli_train.engine.bench_hook:make   # the real decode engine

Decode is a proxy until the engine is wired in: 8 Llama-3-8B layers of bf16 GEMVs (distinct weights per
layer, so nothing is served from L2) plus a bandwidth-bound read of the KV bytes a step would attend over.
The trainer is the finetune-shaped GEMM 8192x4096x4096. ``--engine MODULE:FUNC`` swaps both: FUNC(ladder)
returns an object with the proxy's interface (``decode_step``, ``trainer_step``, ``capture``,
``kv_bytes_per_token``, ``model_id``).

Bars (docs/design.md): decode beside the trainer on the complementary share < 1.5x (overlapping torch contexts:
8-10x); held-out MAPE <= 5 % solo and co-run; prediction <= 10 us; decision <= 20 us; switch <= 50 us; a
graph captured on 16 SMs replays slower than one captured on the full GPU (it stays on its partition).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

from harli_train.colocate.controller import Controller  # noqa: E402
from harli_train.colocate.predictor import LatencyPredictor, fit_options, split_samples  # noqa: E402
from harli_train.colocate.profile import ProfileKey, save_profile  # noqa: E402
from harli_train.colocate.profile_grid import build_profile, run_profile_grid  # noqa: E402
from harli_train.colocate.sm import Partition, SMLadder, TimeSliceLadder  # noqa: E402

BATCHES, KV_LENS = (1, 8, 32, 64, 128), (512, 1024, 2048)
# Llama-3-8B per layer: qkv, o, gate+up, down as (in, out); KV per token per layer: K and V, 8 heads x 128.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
KV_ELEMS_PER_TOKEN = 2 * 8 * 128


class DecodeProxy:
    """Decode-shaped work on a partition's inference stream and a finetune GEMM on its training stream."""

    model_id = "llama-8b-proxy-8layers"

    def __init__(self, layers: int = 8, max_batch: int = 128, max_kv: int = 2048) -> None:
        import torch

        torch.manual_seed(0)
        dev, bf = "cuda", torch.bfloat16
        self.torch = torch
        self.W = [[torch.randn(k, n, device=dev, dtype=bf) * 0.02 for k, n in SHAPES] for _ in range(layers)]
        self.x = [torch.randn(max_batch, k, device=dev, dtype=bf) for k, _ in SHAPES]
        self.kv = [
            torch.randn(max_batch * max_kv, KV_ELEMS_PER_TOKEN, device=dev, dtype=bf) for _ in range(layers)
        ]
        self.kv_out = torch.empty(layers, KV_ELEMS_PER_TOKEN, device=dev, dtype=bf)
        self.A = torch.randn(8192, 4096, device=dev, dtype=bf)
        self.B = torch.randn(4096, 4096, device=dev, dtype=bf)
        self.kv_bytes_per_token = 2.0 * KV_ELEMS_PER_TOKEN * layers

    def decode_step(self, batch: int, kv_len: int, part: Partition) -> None:
        torch = self.torch
        n = batch * kv_len
        with torch.cuda.stream(part.infer_stream):
            for layer, ws in enumerate(self.W):
                for w, x in zip(ws, self.x, strict=True):
                    torch.matmul(x[:batch], w)
                if n:
                    torch.sum(self.kv[layer][:n], dim=0, out=self.kv_out[layer])

    def trainer_step(self, part: Partition) -> None:
        with self.torch.cuda.stream(part.train_stream):
            self.torch.matmul(self.A, self.B)

    def capture(self, batch: int, kv_len: int, part: Partition):
        """A CUDA graph of one decode step captured on ``part``'s inference stream."""
        torch = self.torch
        for _ in range(3):  # cuBLAS picks its kernels and workspace for this stream before capture
            self.decode_step(batch, kv_len, part)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=part.infer_stream):
            self.decode_step(batch, kv_len, part)
        return graph


class SimulatedDecode:
    """--dry-run: busy-waits a roofline-shaped latency so every section runs on the CPU stand-in."""

    model_id = "simulated"
    kv_bytes_per_token = 32768.0

    def __init__(self, total_sms: int) -> None:
        self.total = total_sms

    def latency(self, batch: int, kv_len: int, sms: int) -> float:
        bw = min(1.0, sms / 48) * 2e12
        return (
            50e-6 + (3.5e9 + batch * kv_len * self.kv_bytes_per_token) / bw / 100 + 2e-6 * batch * 132 / sms
        )

    def decode_step(self, batch: int, kv_len: int, part: Partition) -> None:
        end = time.perf_counter() + self.latency(batch, kv_len, part.infer_sms)
        while time.perf_counter() < end:
            pass

    def trainer_step(self, part: Partition) -> None:
        time.sleep(2e-4)

    def capture(self, batch, kv_len, part):
        raise RuntimeError("CUDA graphs need a GPU")


def section(results: dict, name: str, fn, *args) -> Any:
    """Run one section; a failure is recorded and the next section still runs."""
    t0 = time.perf_counter()
    try:
        out = fn(*args)
        results[name] = out if isinstance(out, dict) else {"value": out}
    except Exception as err:
        results[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        out = None
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def make_ladder(args) -> tuple[SMLadder, dict]:
    t0 = time.perf_counter()
    ladder = SMLadder.cpu_standin(132, 32) if args.dry_run else SMLadder.create(step=args.step)
    ms = (time.perf_counter() - t0) * 1e3
    return ladder, {
        "kind": ladder.kind,
        "create_ms": round(ms, 2),
        "rungs": ladder.describe(),
        "granted_infer_sms": ladder.shares,
    }


def disjointness(work, ladder: SMLadder, args) -> dict:
    """Decode (batch 64, weights only) alone and beside the trainer: our disjoint rungs vs torch's pairs."""
    out: dict[str, Any] = {"rungs": {}, "torch_overlapping": {}}
    reps = dict(warmup=3, reps=args.reps)
    for want in (32, 48, 64):
        p = ladder.select(want)
        rows = run_profile_grid(
            work.decode_step, work.trainer_step, _one(p, ladder.total_sms), (64,), (0,), **reps
        )
        out["rungs"][p.infer_sms] = _slowdown(rows)
    if not args.dry_run:
        import torch

        gc = getattr(getattr(torch.cuda, "green_contexts", None), "GreenContext", None)
        for n in (32, 48, 64) if gc is not None else ():
            gi, gf = gc.create(num_sms=n, device_id=0), gc.create(num_sms=ladder.total_sms - n, device_id=0)
            p = Partition(n, ladder.total_sms - n, gi.Stream(), gf.Stream())
            rows = run_profile_grid(
                work.decode_step, work.trainer_step, _one(p, ladder.total_sms), (64,), (0,), **reps
            )
            out["torch_overlapping"][n] = _slowdown(rows)
    worst = max(r["slowdown"] for r in out["rungs"].values())
    out["max_disjoint_slowdown"] = worst
    out["pass_lt_1.5x"] = worst < 1.5
    return out


def _one(p: Partition, total: int) -> SMLadder:
    return SMLadder([dataclasses.replace(p)], total, kind="single")  # a copy: the ladder re-indexes it


def _slowdown(rows: list[dict]) -> dict:
    solo = next(r["latency_s"] for r in rows if not r["corun"])
    corun = next(r["latency_s"] for r in rows if r["corun"])
    return {"solo_ms": solo * 1e3, "corun_ms": corun * 1e3, "slowdown": corun / solo}


def profile_grid(work, ladder: SMLadder, args) -> dict:
    batches, kvs = ((1, 8), (512, 1024)) if args.dry_run else (BATCHES, KV_LENS)
    key = ProfileKey.current(work.model_id, sm_count=ladder.total_sms)
    prof = build_profile(
        key,
        work.decode_step,
        work.trainer_step,
        ladder,
        work.kv_bytes_per_token,
        batches=batches,
        kv_lens=kvs,
        warmup=3,
        reps=args.reps,
    )
    path = common.out_dir() / "profile_predictor.json"
    save_profile(path, prof)
    return {
        "profile": prof,
        "path": str(path),
        "samples": len(prof.samples),
        "key": prof.key.describe(),
        "profile_seconds": round(prof.meta["profile_seconds"], 1),
    }


def fit_and_score(prof, ladder: SMLadder, args) -> dict:
    """Fit on a random 70 %, score the held-out 30 %; repeated over seeds: the split must not matter."""
    runs, preds = [], []
    for seed in range(args.seed, args.seed + 5):
        train, held = split_samples(prof.samples, 0.7, seed=seed)
        preds.append(
            LatencyPredictor.fit(
                train,
                ladder.total_sms,
                prof.meta["kv_bytes_per_token"],
                **fit_options(prof.meta),
            )
        )
        runs.append({"seed": seed, **preds[-1].fit_report, **preds[-1].evaluate(held, prefix="heldout_")})
    first, pred = runs[0], preds[0]
    solo, corun = first["heldout_solo_mape_pct"], first.get("heldout_corun_mape_pct", 0.0)
    return {
        "runs": runs,
        "heldout_solo_mape_pct": solo,
        "heldout_corun_mape_pct": corun,
        "mean_heldout_solo_mape_pct": sum(r["heldout_solo_mape_pct"] for r in runs) / len(runs),
        "mean_heldout_corun_mape_pct": sum(r.get("heldout_corun_mape_pct", 0) for r in runs) / len(runs),
        "kv_bandwidth_GBps_by_share": {s: round(v / 1e9, 1) for s, v in pred.effective_bandwidth().items()},
        "predictor": pred.to_dict(),
        "pass_le_5pct": solo <= 5 and corun <= 5,
    }


def costs(pred: LatencyPredictor, ladder: SMLadder) -> dict:
    """Median CPU cost of one prediction, one all-shares sweep and one controller decision (10k calls)."""
    rng = random.Random(0)
    loads = [(rng.choice(BATCHES), rng.choice(KV_LENS)) for _ in range(10_000)]
    shares = [p.infer_sms for p in ladder.spatial] or ladder.shares
    calls = [(b, b * kv, rng.choice(shares)) for b, kv in loads]
    t_pred = _median_us(lambda c: pred.predict(c[0], c[1], c[2], True), calls)
    t_all = _median_us(lambda c: pred.predict_all_shares(c[0], c[1]), calls[:2000])
    tpot = 1.3 * pred.predict(32, 32 * 1024, ladder.full.infer_sms, False)
    ctl = Controller(pred, ladder, tpot, margin=0.1, hysteresis_steps=8, log_limit=20_000)
    t_dec = _median_us(lambda c: ctl.decide(c[0], c[1]), calls)
    summary = ctl.summary()
    return {
        "predict_us": t_pred,
        "predict_all_shares_us": t_all,
        "decide_us": t_dec,
        "tpot_ms": tpot * 1e3,
        "decisions": summary,
        "pass_predict_le_10us": t_pred <= 10,
        "pass_decide_le_20us": t_dec <= 20,
    }


def _median_us(fn, calls) -> float:
    times = []
    clock = time.perf_counter_ns
    for c in calls:
        t0 = clock()
        fn(c)
        times.append(clock() - t0)
    return common.median(times) / 1e3


def switching(work, ladder: SMLadder, args) -> dict:
    """Re-partitioning between steps: CPU cost of the event hand-off, then its cost on the GPU timeline
    with decode graphs captured per partition (alternating rungs vs staying on each)."""
    parts = [ladder.select(s) for s in (32, 64)] + [ladder.full]
    pairs = [(parts[i % 3], parts[(i + 1) % 3]) for i in range(3000)]
    out: dict[str, Any] = {"switch_us": _median_us(lambda pq: ladder.switch(*pq), pairs)}
    out["pass_switch_le_50us"] = out["switch_us"] <= 50
    if args.dry_run:
        return out
    import torch

    graphs = {p.index: work.capture(8, 512, p) for p in parts}

    def step_ms(seq: list[Partition]) -> float:
        for _ in range(2):  # the first pass warms up; the second is timed
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prev = seq[0]
            for p in seq:
                ladder.switch(prev, p)
                with torch.cuda.stream(p.infer_stream):
                    graphs[p.index].replay()
                prev = p
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / len(seq)

    alone = {p.infer_sms: step_ms([p] * 300) for p in parts}
    alternating = step_ms([parts[i % 3] for i in range(300)])
    out.update(
        step_ms_on_each=alone,
        step_ms_alternating=alternating,
        gpu_switch_overhead_us=(alternating - sum(alone.values()) / len(alone)) * 1e3,
    )
    return out


def graph_confinement(work, ladder: SMLadder) -> dict:
    """The same decode graph captured on 16 SMs and on the full GPU, both replayed from the default stream."""
    import torch

    out = {}
    for name, p in (("sms16", ladder.select(16)), ("full", ladder.full)):
        g = work.capture(64, 1024, p)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        out[f"{name}_replay_ms"] = common.median(times)
        out[f"{name}_sms"] = p.infer_sms
    out["ratio"] = out["sms16_replay_ms"] / out["full_replay_ms"]
    out["pass_stays_on_partition"] = out["ratio"] > 1.3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU stand-in ladder and simulated decode")
    ap.add_argument("--engine", default=None, help="MODULE:FUNC returning the decode/trainer workload")
    ap.add_argument("--step", type=int, default=8, help="SM ladder granularity")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.dry_run:
        args.reps = min(args.reps, 3)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    results: dict[str, Any] = {"env": common.environment(), "args": vars(args)}
    made: dict[str, SMLadder] = {}

    def ladder_section() -> dict:
        made["ladder"], info = make_ladder(args)
        return info

    section(results, "ladder", ladder_section)
    ladder = made.get("ladder") or TimeSliceLadder.create()
    if args.engine:
        module, func = args.engine.split(":")
        work = getattr(importlib.import_module(module), func)(ladder)
    else:
        work = SimulatedDecode(ladder.total_sms) if args.dry_run else DecodeProxy()

    section(results, "disjointness", disjointness, work, ladder, args)
    grid = section(results, "profile", profile_grid, work, ladder, args)
    prof = results["profile"].pop("profile", None) if grid else None
    pred = None
    if prof is not None:
        fit = section(results, "predictor", fit_and_score, prof, ladder, args)
        if fit:
            pred = LatencyPredictor.from_dict(fit["predictor"])
    if pred is not None:
        section(results, "costs", costs, pred, ladder)
    section(results, "switching", switching, work, ladder, args)
    if not args.dry_run:
        section(results, "graphs", graph_confinement, work, ladder)
    path = common.write_json("bench_predictor.json", results)
    print(f"wrote {path}")
    print(summary_table(results))


def summary_table(r: dict) -> str:
    def get(sec, key, fmt="{:.3g}"):
        v = r.get(sec, {}).get(key)
        return "error" if "error" in r.get(sec, {}) else ("-" if v is None else fmt.format(v))

    over = r.get("disjointness", {}).get("torch_overlapping", {})
    worst_overlap = max((v["slowdown"] for v in over.values()), default=None)
    rows = [
        ["ladder rungs (infer SMs)", str(r.get("ladder", {}).get("granted_infer_sms", "error")), ""],
        ["ladder create ms", get("ladder", "create_ms"), ""],
        ["co-run slowdown, disjoint (max)", get("disjointness", "max_disjoint_slowdown"), "< 1.5"],
        [
            "co-run slowdown, torch overlapping (max)",
            "-" if worst_overlap is None else f"{worst_overlap:.3g}",
            "",
        ],
        ["held-out MAPE solo %", get("predictor", "heldout_solo_mape_pct"), "<= 5"],
        ["held-out MAPE co-run %", get("predictor", "heldout_corun_mape_pct"), "<= 5"],
        ["predict us", get("costs", "predict_us"), "<= 10"],
        ["decide us", get("costs", "decide_us"), "<= 20"],
        ["switch us (CPU, event hand-off)", get("switching", "switch_us"), "<= 50"],
        ["switch us (GPU timeline, graphs)", get("switching", "gpu_switch_overhead_us"), "<= 50"],
        ["graph replay 16 SMs / full", get("graphs", "ratio"), "> 1.3"],
    ]
    errors = [k for k, v in r.items() if isinstance(v, dict) and "error" in v]
    return common.table(rows, ["figure", "value", "bar"]) + (
        f"\nerrors in: {', '.join(errors)}" if errors else ""
    )


if __name__ == "__main__":
    main()
