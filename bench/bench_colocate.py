"""Co-location on one GPU: every policy x trace x load in one run, against the TPOT objective.

    python bench/bench_colocate.py            # H200: $OUT/bench_colocate.json + timeline PNGs, a table last
    python bench/bench_colocate.py --dry-run  # CPU: the tiny model on the stand-in ladder, short windows
    python bench/bench_colocate.py --tpot-ms auto:1.5,auto:2  # one set-up, every window per objective:
                                              # bench_colocate-auto1.5x.json, -auto2x.json, a table each

Set-up: recipes/llama-8b-lora.yaml (Llama-3-8B shapes, LoRA r=16 on all projections, batch 4 x 1024) while
the same base model (one copy of the weights) serves recipes/traces/{steady,bursty}.jsonl, replayed at 1x
(light), 2x (medium) and 4x (heavy) their request rate for a window each. The decode-latency profile is
measured once up front on a coarse grid, and the trainer's kernels are compiled for every SM budget before
any window starts. Each window starts a fresh adapter and optimizer on the shared weights. Policies run one after
the other, each through every cell as one service: torch's cache is emptied before a policy, which then serves the
last cell's load (bursty/heavy by default) for --warm-s seconds unrecorded before its windows.

Policies: harli (per-step controller), static:N (N = the smallest split whose predicted step at the peak
batch meets the objective beside the trainer: provisioned for the peak, as a fixed split must be), streams,
temporal, exclusive (decode alone; standalone training is measured once, alone on the whole GPU).
A violation is a decode token interval over the objective (what a user sees: the step plus any host delay
before it; see harli_train/colocate/report.py); steps whose own GPU time was over are reported apart.
The default run (2 traces x 3 loads x 5 policies, 5 s windows, ladder step 16) takes ~5 minutes on the H200;
set-up (weights, decode graphs, profile, trainer warm-up, standalone) is 20-60 s of it.

The objective decides how much there is to harvest: at 1.5x the whole GPU's step the fixed split must give
decode 112 of 132 SMs for the peak and harli reached 1.6-3.2x its finetune throughput; at 1.75x and 2x the
fixed split needs 64 and harli was 0.8-1.1x of it (bench/results/2026-11-29-*objective*).

Bars (docs/design.md): harli has zero violations and >= 1.46x the finetune tokens/s of the best baseline
(static, streams, temporal) that also has none; its finetune tokens/s as a fraction of standalone.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harli_train.cuda_env import SETTINGS, prefer_cuda_env  # noqa: E402

CUDA_ENV = prefer_cuda_env()  # before any CUDA context exists (see harli_train/cuda_env.py)

import common  # noqa: E402
import torch  # noqa: E402
from stall_sampler import StallSampler, stall_spans  # noqa: E402

from harli_train.colocate.assembly import (  # noqa: E402
    build_engine,
    build_predictor,
    corun_workload,
    warm_up_trainer,
)
from harli_train.colocate.engine_adapter import EngineAdapter  # noqa: E402
from harli_train.colocate.policies import make_policy  # noqa: E402
from harli_train.colocate.predictor import LatencyPredictor  # noqa: E402
from harli_train.colocate.runtime import ColocatedRuntime, RuntimeOptions  # noqa: E402
from harli_train.colocate.shared_model import base_view  # noqa: E402
from harli_train.colocate.sm import SMLadder, make_ladder  # noqa: E402
from harli_train.config import RecipeConfig, load_recipe  # noqa: E402
from harli_train.data.tokenizer import load_tokenizer  # noqa: E402
from harli_train.engine.load import TraceRequest, read_trace  # noqa: E402
from harli_train.model import is_preset, load_model, resolve_dtype  # noqa: E402
from harli_train.train.trainer import Trainer, resolve_device  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOADS = {"light": 1.0, "medium": 2.0, "heavy": 4.0}  # multiples of the trace's request rate
BASELINES = ("static", "streams", "temporal")
RATIO_BAR = 1.46
STEP_COLUMNS = (  # of the per-step records --keep-steps copies into the JSON (bench/analyze_colocate.py reads them)
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
)
log = logging.getLogger("bench_colocate")


@dataclass
class Bench:
    """What every window shares: recipe, weights, ladder, engine, predictor, traces."""

    cfg: RecipeConfig
    model: Any
    ladder: SMLadder
    engine: EngineAdapter
    predictor: LatencyPredictor | None
    traces: dict[str, list[TraceRequest]]
    tpot_s: float
    static_sms: int = 0
    trainer_thread: bool | None = None
    switch_interval_s: float | None = None  # None: the runtime's default
    keep_steps: int = 0  # per-step records kept in the JSON for each window (0: none)
    sample_stalls: bool = False  # thread stacks inside decode's host stalls (stall_sampler.py)
    max_in_flight: int = 2  # trainer micro-steps queued on the GPU at most
    host_priority: bool = True  # decode's launches hold the trainer's back (RuntimeOptions.host_priority)
    tag: str = ""  # "-<objective>" on the outputs of one objective of several
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench_colocate_")))


def section(results: dict, name: str, fn, *args) -> Any:
    """Run one section; a failure is recorded and the next section still runs."""
    t0 = time.perf_counter()
    try:
        out = fn(*args)
        results[name] = out if isinstance(out, dict) else {"value": out}
    except Exception as err:
        log.error("%s failed: %s", name, err)
        results[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        out = None
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def load_traces(args) -> dict[str, list[TraceRequest]]:
    traces = {}
    for name in args.traces:
        reqs = read_trace(ROOT / "recipes" / "traces" / f"{name}.jsonl")
        if args.dry_run:  # the tiny model on a CPU: short prompts and outputs keep a window to ~a second
            for r in reqs:
                r.prompt_len, r.output_len = min(r.prompt_len or 64, 48), min(r.output_len, 24)
        traces[name] = reqs
    return traces


def setup(args, results: dict) -> Bench:
    overrides = [f"train.steps={10**7}", "train.log_every=1000000", "output.checkpoint_every=0"]
    if args.dry_run:
        overrides += ["train.device=cpu", "model.dtype=float32"]
    cfg = load_recipe(args.recipe, overrides)
    first = args.tpot_ms[0]
    tpot_s = (first if isinstance(first, float) else cfg.colocation.tpot_ms) * 1e-3
    device = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    t0 = time.perf_counter()
    model = load_model(cfg.model.name, dtype, device, seed=cfg.model.seed)
    ladder = (
        SMLadder.cpu_standin(132, args.ladder_step) if args.dry_run else make_ladder(step=args.ladder_step)
    )
    traces = load_traces(args)
    every = [r for reqs in traces.values() for r in reqs]
    trainer = fresh_trainer(cfg, model, Path(tempfile.mkdtemp(prefix="bench_colocate_setup_")))
    served = base_view(trainer.model)
    tokenizer = load_tokenizer(cfg.model.name, is_preset(cfg.model.name))
    engine = build_engine(served, tokenizer, ladder, every, cfg.colocation.max_batch, seed=0)
    bench = Bench(cfg, model, ladder, engine, None, traces, tpot_s)
    bench.trainer_thread = {"auto": None, "on": True, "off": False}[args.trainer_thread]
    bench.switch_interval_s = args.switch_interval_us * 1e-6 if args.switch_interval_us else None
    bench.keep_steps = args.keep_steps
    bench.sample_stalls = args.sample_stalls
    bench.max_in_flight = args.max_in_flight
    bench.host_priority = not args.no_host_priority
    results["setup"] = {
        "model": cfg.model.name,
        "dtype": str(dtype),
        "device": str(device),
        "recipe": str(args.recipe),
        "objective_tpot_ms": tpot_s * 1e3,
        "margin": cfg.colocation.margin,
        "max_batch": cfg.colocation.max_batch,
        "train_batch": [cfg.train.batch_size, cfg.data.seq_len],
        "layers_per_microstep": cfg.train.layers_per_microstep,
        "max_in_flight": args.max_in_flight,
        "host_priority": not args.no_host_priority,
        "lora": {"rank": cfg.lora.rank, "targets": cfg.lora.targets},
        "cuda_env": {k: os.environ.get(k) for k in SETTINGS} | {"set_by_bench": sorted(CUDA_ENV)},
        "ladder": {"kind": ladder.kind, "rungs": ladder.describe()},
        "engine": {
            "max_model_len": engine.engine.config.max_model_len,
            "kv_blocks": engine.engine.storage.num_blocks,
        },
        "traces": {k: len(v) for k, v in traces.items()},
        "window_s": args.window_s,
        "load_levels": {k: f"{v:g}x the trace's rate" for k, v in LOADS.items() if k in args.loads},
        "setup_s": round(time.perf_counter() - t0, 1),
    }
    section(results, "profile", profile, bench, trainer, args)
    section(results, "warmup", warmup, bench, trainer)
    del trainer
    return bench


def fresh_trainer(cfg: RecipeConfig, model, out: Path) -> Trainer:
    cfg.output.dir = str(out)
    trainer = Trainer(cfg, model=model, quiet=True)
    trainer.setup()
    return trainer


def profile(bench: Bench, trainer: Trainer, args) -> dict:
    cfg = bench.cfg
    on_gpu = trainer.device.type == "cuda"
    corun = (
        corun_workload(
            trainer.model,
            cfg.train.batch_size,
            cfg.data.seq_len,
            cfg.train.layers_per_microstep,
            trainer.dtype,
        )
        if on_gpu
        else None
    )
    max_len = bench.engine.engine.config.max_model_len
    kv_lens = (256, min(1536, max_len - 1)) if on_gpu else (16, 64)
    predictor, prof = build_predictor(
        bench.engine,
        bench.ladder,
        f"{cfg.model.name}|bench",
        corun,
        cfg.colocation.max_batch,
        common.out_dir() / "profile_colocate.json",
        reps=5 if on_gpu else 2,
        batches=(1, 8, 32, 64),
        kv_lens=kv_lens,
    )
    bench.predictor = predictor
    return {"samples": len(prof.samples), "fit": predictor.fit_report}


def apply_objective(bench: Bench, objective: float | AutoObjective | None, args) -> dict:
    """Set the objective (an 'auto' one needs the predictor) and the fixed split that meets it at the peak."""
    cfg = bench.cfg
    if isinstance(objective, AutoObjective):  # k x the whole GPU's step at the peak batch
        bench.tpot_s = objective.factor * bench.predictor.predict(
            cfg.colocation.max_batch, cfg.colocation.max_batch * 1024, bench.ladder.total_sms, False
        )
        rule = f"{objective.factor:g}x the whole GPU's predicted step at batch {cfg.colocation.max_batch}"
    else:
        bench.tpot_s = (objective if objective is not None else cfg.colocation.tpot_ms) * 1e-3
        rule = "--tpot-ms" if objective is not None else "the recipe's colocation.tpot_ms"
    bench.static_sms = args.static_sms or peak_static_share(bench)
    static_rule = (
        "--static-sms" if args.static_sms else "least split meeting the budget at max_batch x 1024 KV tokens"
    )
    return {
        "objective_tpot_ms": bench.tpot_s * 1e3,
        "objective_rule": rule,
        "static_sms": bench.static_sms,
        "static_rule": static_rule,
    }


def peak_static_share(bench: Bench) -> int:
    """The least decode share a fixed split must have to meet the objective at the peak batch."""
    budget = bench.tpot_s * (1 - bench.cfg.colocation.margin)
    batch = bench.cfg.colocation.max_batch
    for p in bench.ladder.spatial:
        if bench.predictor.predict(batch, batch * 1024, p.infer_sms, True) <= budget:
            return p.infer_sms
    return bench.ladder.spatial[-1].infer_sms if bench.ladder.spatial else bench.ladder.total_sms


def warmup(bench: Bench, trainer: Trainer) -> dict:
    failed = warm_up_trainer(trainer, list(bench.ladder.partitions), bench.ladder.total_sms)
    retired = bench.ladder.retire(failed)
    return {
        "budgets": sorted(
            {p.train_sms for p in bench.ladder.partitions if p.train_sms} | {bench.ladder.total_sms}
        ),
        "retired_rungs": [{"infer_sms": p.infer_sms, "train_sms": p.train_sms} for p in retired],
    }


class AutoObjective(NamedTuple):
    """--tpot-ms auto[:K]: K (default 2) times the whole GPU's predicted step at the peak batch."""

    factor: float = 2.0


def parse_objective(text: str) -> float | AutoObjective:
    """--tpot-ms: milliseconds, 'auto' or 'auto:K'; anything else is refused with the value named."""
    head, _, factor = text.partition(":")
    try:
        if head == "auto":
            obj = AutoObjective(float(factor)) if factor else AutoObjective()
            ok = obj.factor > 1.0
        else:
            obj = float(text)
            ok = obj > 0 and not factor
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"--tpot-ms {text!r}: want milliseconds > 0, 'auto' or 'auto:K' with K > 1 "
            "(K x the whole GPU's step at the peak batch)"
        )
    return obj


def parse_objectives(text: str) -> list[float | AutoObjective]:
    """--tpot-ms: one objective, or several separated by commas (each window set runs once per objective)."""
    return [parse_objective(part.strip()) for part in text.split(",")]


def objective_label(objective: float | AutoObjective | None) -> str:
    if isinstance(objective, AutoObjective):
        return f"auto{objective.factor:g}x"
    return "recipe" if objective is None else f"{objective:g}ms"


def policy_name(bench: Bench, name: str) -> str:
    return f"static:{bench.static_sms}" if name == "static" else name


def bench_policy(bench: Bench, name: str):
    """A fresh policy of that name over the bench's ladder, predictor and objective."""
    return make_policy(
        policy_name(bench, name), bench.ladder, bench.predictor, bench.tpot_s, bench.cfg.colocation.margin
    )


ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counts() -> dict[str, int]:
    """torch's caching-allocator counters that mean driver calls (cudaMalloc/cudaFree, retries after a failed
    allocation, whole-device syncs): in a window, each can stall the other thread's allocations."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def run_window(
    bench: Bench,
    name: str,
    requests: list[TraceRequest],
    time_scale: float,
    window_s: float,
    solo_s: float = 0.0,
    plot_to: Path | None = None,
) -> dict:
    """One window of one policy under one load; returns the figures the table needs."""
    # The previous window's trainer is freed into torch's cache, which this window's trainer (same policy: see
    # policy_windows) takes up again, as a long-running service does.
    gc.collect()
    run_dir = Path(tempfile.mkdtemp(dir=bench.scratch))
    trainer = fresh_trainer(bench.cfg, bench.model, run_dir)
    if bench.predictor is not None:
        bench.predictor.reset_corrections()
    policy = bench_policy(bench, name)
    opts = RuntimeOptions(
        until="load",
        window_s=window_s,
        solo_s=solo_s,
        time_scale=time_scale,
        quiet=True,
        finish=False,
        plots=plot_to is not None,
        trainer_thread=bench.trainer_thread,
        **({"switch_interval_s": bench.switch_interval_s} if bench.switch_interval_s else {}),
        max_in_flight=bench.max_in_flight,
        host_priority=bench.host_priority,
    )
    alloc_before = allocator_counts()
    rt = ColocatedRuntime(trainer, bench.engine, policy, requests, run_dir / "colocate", opts)
    sampler = StallSampler() if bench.sample_stalls else contextlib.nullcontext()
    with sampler:
        s = rt.run()
    alloc = {k: v - alloc_before.get(k, 0) for k, v in allocator_counts().items()}
    stalls = None
    if isinstance(sampler, StallSampler):
        with open(run_dir / "colocate" / "steps.jsonl") as f:
            spans = stall_spans([json.loads(line) for line in f])
        stalls = sampler.around(spans[:20], rt.t0)
    steps = []
    if bench.keep_steps:  # a compact copy of the first per-step records, for diagnosis
        with open(run_dir / "colocate" / "steps.jsonl") as f:
            for line, _ in zip(f, range(bench.keep_steps), strict=False):
                row = json.loads(line)
                steps.append([row.get(k) for k in STEP_COLUMNS])
    if plot_to is not None:
        plot_to.mkdir(parents=True, exist_ok=True)
        for png in ("timeline.png", "throughput.png"):
            shutil.copy(run_dir / "colocate" / png, plot_to / png)
    shutil.rmtree(run_dir, ignore_errors=True)
    sv, ft = s["serving"], s["finetune"]
    return {
        "policy": s["policy"],
        "finetune_tokens_per_s": ft["tokens_per_s"],
        "solo_tokens_per_s": ft["solo_tokens_per_s"],
        "tpot_ms": sv["tpot_ms"],
        "ttft_ms": sv["ttft_ms"],
        "token_interval_ms": sv["token_interval_ms"],
        "violations": sv["violations"],
        "step_latency_violations": sv.get("step_latency_violations"),
        "violation_rate": sv["violation_rate"],
        "decode_steps": sv["decode_steps"],
        "peak_decode_batch": (sv.get("decode_batch") or {}).get("max"),
        "request_tpot_violations": sv["request_tpot_violations"],
        "requests": sv["requests"],
        "aborted_at_end": sv["aborted_at_end"],
        "paused_fraction": s["trainer_paused_fraction"],
        "mean_infer_sms": s["mean_infer_sms"],
        "share_histogram": s["share_histogram"],
        "micro_steps": ft["micro_steps"],
        "abandoned_steps": ft["abandoned_steps"],
        "oom_recoveries": ft["oom_recoveries"],
        "output_tokens_per_s": sv["output_tokens_per_s"],
        "feed": ft["feed"],
        "gc_pauses": s["gc_pauses"],
        "allocator": alloc,
        **({"step_columns": list(STEP_COLUMNS), "steps": steps} if steps else {}),
        **({"stall_samples": stalls} if stalls is not None else {}),
    }


def standalone(bench: Bench, args) -> dict:
    """The trainer alone on the whole GPU (exclusive's second half), measured once."""
    out = run_window(bench, "exclusive", [], 1.0, 0.0, solo_s=args.solo_s)
    return {"finetune_tokens_per_s": out["solo_tokens_per_s"], "feed": out["feed"]}


def cell_requests(bench: Bench, trace: str, load: str, window_s: float) -> tuple[list[TraceRequest], float]:
    """The requests of one trace that arrive within a window at one load level, and the time scale."""
    scale = 1.0 / LOADS[load]
    return [r for r in bench.traces[trace] if r.arrival_s * scale < window_s], scale


def policy_windows(bench: Bench, name: str, cells: list[tuple[str, str]], args, outs: dict) -> None:
    """One policy's windows in every cell, as one service: the allocator's cache is emptied before it, then
    warmed as ``harli-train --colocate-with`` warms it (a synthetic step on each of the trainer's streams) and
    by ``--warm-s`` of the policy's own serving (not recorded), and kept from window to window.

    torch's caching allocator hands a freed block out again only on the stream that allocated it, so a cache
    left by another policy's streams is of no use to this one and crowds its own out (on the H200, harli
    windows after other policies ran out of memory in 4 of 6 cells, -s6-first.json.gz); a cold cache makes the
    trainer call cudaMalloc ~600-1600 times while decode serves (-s5-replicate.json.gz)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        policy = bench_policy(bench, name)
        places = policy.trainer_partitions() + [bench.ladder.full]
        trainer = fresh_trainer(bench.cfg, bench.model, Path(tempfile.mkdtemp(dir=bench.scratch)))
        warm_up_trainer(trainer, places, bench.ladder.total_sms, release=False)
        del trainer
    if args.warm_s > 0 and name != "exclusive":
        requests, scale = cell_requests(bench, *cells[-1], args.warm_s)
        section(
            outs.setdefault("_warm", {}),
            policy_name(bench, name),
            run_window,
            bench,
            name,
            requests,
            scale,
            args.warm_s,
        )
    for trace, load in cells:
        key = f"{trace}/{load}"
        requests, scale = cell_requests(bench, trace, load, args.window_s)
        out = outs.setdefault(key, {"requests_in_window": len(requests), "time_scale": scale})
        plot = common.out_dir() / f"timelines{bench.tag}" / f"{trace}-{load}" if name == "harli" else None
        section(
            out, policy_name(bench, name), run_window, bench, name, requests, scale, args.window_s, 0.0, plot
        )


def split_policies(text: str) -> list[str]:
    """``--policies``: comma-separated names, where a harli variant's own options continue the name before
    them ("harli,harli:prefill=paused,grow=0.05,static" is three policies)."""
    out: list[str] = []
    for item in filter(None, text.split(",")):
        if out and "=" in item and ":" not in item:
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def verdict(cell_out: dict, solo: float | None) -> dict:
    harli = cell_out.get("harli", {})
    ok = [
        (k, v)
        for k, v in cell_out.items()
        if isinstance(v, dict)
        and k.split(":")[0] in BASELINES
        and "error" not in v
        and v.get("violations") == 0
    ]
    best = max(ok, key=lambda kv: kv[1]["finetune_tokens_per_s"], default=None)
    tok = harli.get("finetune_tokens_per_s")
    out = {
        "harli_violations": harli.get("violations"),
        "best_baseline": best[0] if best else None,
        "best_baseline_tokens_per_s": best[1]["finetune_tokens_per_s"] if best else None,
    }
    out["ratio_vs_best_baseline"] = (
        tok / out["best_baseline_tokens_per_s"]
        if tok is not None and best and out["best_baseline_tokens_per_s"] > 0
        else None
    )
    out["fraction_of_standalone"] = tok / solo if tok is not None and solo else None
    # harli variants (harli:OPTIONS) against the same baseline, for an A/B within one run.
    out["variants"] = {
        k: {
            "violations": v.get("violations"),
            "ratio_vs_best_baseline": (
                v["finetune_tokens_per_s"] / best[1]["finetune_tokens_per_s"]
                if best and best[1]["finetune_tokens_per_s"] > 0 and "finetune_tokens_per_s" in v
                else None
            ),
        }
        for k, v in cell_out.items()
        if k.startswith("harli:") and isinstance(v, dict) and "error" not in v
    }
    out["pass"] = bool(
        harli.get("violations") == 0 and (best is None or (out["ratio_vs_best_baseline"] or 0) >= RATIO_BAR)
    )
    return out


def comparison_plot(results: dict, args, tag: str = "") -> str | None:
    """Finetune tokens/s per policy in every cell, violations marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(t, lo) for t in args.traces for lo in args.loads if f"{t}/{lo}" in results.get("cells", {})]
    if not cells:
        return None
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.8 / max(len(args.policies), 1)
    for i, name in enumerate(args.policies):
        xs, ys, bad = [], [], []
        for j, (t, lo) in enumerate(cells):
            entry = next(
                (
                    v
                    for k, v in results["cells"][f"{t}/{lo}"].items()
                    if (k == name or (name == "static" and k.startswith("static:")))
                    and isinstance(v, dict)
                    and "policy" in v
                ),
                None,
            )
            if entry is None:
                continue
            xs.append(j + i * width)
            ys.append(entry["finetune_tokens_per_s"])
            if entry["violations"]:
                bad.append((xs[-1], ys[-1]))
        ax.bar(xs, ys, width, label=name)
        if bad:
            ax.plot(*zip(*bad, strict=True), "x", color="red")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))], [f"{t}\n{lo}" for t, lo in cells])
    ax.set_ylabel("finetune tokens/s while serving")
    ax.set_title(f"co-location, TPOT objective {results['setup']['objective_tpot_ms']:g} ms (x: violations)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = common.out_dir() / f"bench_colocate_policies{tag}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def peak_batch(cell_out: dict) -> float | None:
    """The largest decode batch any policy of the cell ran (the load's peak, as served)."""
    peaks = [v.get("peak_decode_batch") for v in cell_out.values() if isinstance(v, dict)]
    return max((p for p in peaks if p is not None), default=None)


def summary_table(results: dict, args) -> str:
    rows = []
    for key, c in results.get("cells", {}).items():
        for name, v in c.items():
            if not isinstance(v, dict) or name in ("verdict",):
                continue
            if "error" in v:
                rows.append([key, name, "error", "", "", "", ""])
                continue
            if "policy" not in v:
                continue
            tp = v["tpot_ms"] or {}
            rows.append(
                [
                    key,
                    v["policy"],
                    round(v["finetune_tokens_per_s"]),
                    _f(tp.get("p50")),
                    _f(tp.get("p99")),
                    v["violations"],
                    f"{100 * v['paused_fraction']:.0f}%",
                ]
            )
        vd = c.get("verdict", {})
        rows.append(
            [
                key,
                "=> harli vs best baseline",
                _f(vd.get("ratio_vs_best_baseline"), "x"),
                f"best {vd.get('best_baseline')}",
                f"{_f(vd.get('fraction_of_standalone'))} of solo",
                f"peak batch {_f(peak_batch(c))}",
                "PASS" if vd.get("pass") else "FAIL",
            ]
        )
    head = ["trace/load", "policy", "finetune tok/s", "TPOT p50 ms", "TPOT p99 ms", "violations", "paused"]
    solo = results.get("standalone", {}).get("finetune_tokens_per_s")
    lines = [
        common.table(rows, head),
        f"objective: TPOT {results.get('setup', {}).get('objective_tpot_ms')} ms per decode token interval; "
        f"static split sized for batch {results.get('setup', {}).get('max_batch')} (the engine's max); "
        f"standalone training {_f(solo)} tokens/s; bar: harli 0 violations and >= {RATIO_BAR}x the best "
        "baseline with 0 violations",
    ]
    errors = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    if errors:
        lines.append(f"errors in: {', '.join(errors)}")
    return "\n".join(lines)


def _f(v, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.3g}{suffix}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny model, stand-in ladder, short windows")
    ap.add_argument(
        "--recipe", default=None, help="default: recipes/llama-8b-lora.yaml (quickstart on --dry-run)"
    )
    ap.add_argument(
        "--tpot-ms",
        type=parse_objectives,
        default=[None],
        help="objective in ms, 'auto' (2x the whole GPU's step at the peak batch) or 'auto:K' (K x); "
        "several, comma-separated, run every window once per objective after one set-up and write "
        "bench_colocate-<objective>.json each; default: the recipe's",
    )
    ap.add_argument(
        "--window-s", type=float, default=None, help="seconds of load per window (default 5; 1.5 dry)"
    )
    ap.add_argument(
        "--solo-s", type=float, default=None, help="seconds of standalone training (default 5; 1 dry)"
    )
    ap.add_argument("--policies", default="harli,static,streams,temporal,exclusive")
    ap.add_argument("--traces", default="steady,bursty")
    ap.add_argument("--loads", default="light,medium,heavy")
    ap.add_argument(
        "--static-sms", type=int, default=None, help="fixed split (default: provisioned for the peak)"
    )
    ap.add_argument("--ladder-step", type=int, default=16, help="SM granularity of the ladder's rungs")
    ap.add_argument(
        "--trainer-thread",
        choices=("auto", "on", "off"),
        default="auto",
        help="launch the trainer's micro-steps from their own thread (auto: on a GPU)",
    )
    ap.add_argument(
        "--switch-interval-us",
        type=float,
        default=None,
        help="the GIL hand-over interval while the trainer thread runs (default: the runtime's)",
    )
    ap.add_argument("--keep-steps", type=int, default=0, help="per-step records kept per window in the JSON")
    ap.add_argument(
        "--max-in-flight",
        type=int,
        default=RuntimeOptions().max_in_flight,
        help="trainer micro-steps queued on the GPU at most beside decode (default %(default)s)",
    )
    ap.add_argument(
        "--no-host-priority",
        action="store_true",
        help="diagnosis: the trainer's launches do not wait while decode launches a step",
    )
    ap.add_argument(
        "--sample-stalls",
        action="store_true",
        help="diagnosis: sample every thread's stack every 2 ms and keep the samples inside decode host stalls",
    )
    ap.add_argument(
        "--warm-s",
        type=float,
        default=None,
        help="seconds each policy serves the last cell's load, unrecorded, before its windows (default 2; 0 dry)",
    )
    args = ap.parse_args()
    args.policies = split_policies(args.policies)
    args.traces, args.loads = (a.split(",") for a in (args.traces, args.loads))
    args.recipe = Path(
        args.recipe or ROOT / "recipes" / ("quickstart.yaml" if args.dry_run else "llama-8b-lora.yaml")
    )
    args.window_s = args.window_s or (1.5 if args.dry_run else 5.0)
    args.solo_s = args.solo_s or (1.0 if args.dry_run else 5.0)
    args.warm_s = (0.0 if args.dry_run else 2.0) if args.warm_s is None else args.warm_s
    if args.dry_run:
        torch.set_num_threads(1)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    results: dict[str, Any] = {
        "env": common.environment(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    t0 = time.perf_counter()
    made: dict[str, Bench] = {}

    def setup_section() -> dict:
        made["bench"] = setup(args, results)
        return results["setup"]

    current = results  # what the finally block writes: the objective in progress, or the shared set-up
    try:
        section(results, "setup", setup_section)
        bench = made.get("bench")
        if bench is not None:
            section(results, "standalone", standalone, bench, args)
            for i, objective in enumerate(args.tpot_ms):
                bench.tag = f"-{objective_label(objective)}" if len(args.tpot_ms) > 1 else ""
                current = {**results, "setup": dict(results.get("setup", {})), "cells": {}}
                run_objective(bench, objective, current, args)
                if i < len(args.tpot_ms) - 1:
                    write_and_print(current, bench.tag, args)
    except BaseException as err:  # even Ctrl-C: what ran is written
        current["fatal"] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        log.error("bench stopped: %s", current["fatal"]["error"])
    finally:
        bench = made.pop("bench", None)
        if bench is not None:
            section(current, "teardown", teardown, bench)
        current["total_s"] = round(time.perf_counter() - t0, 1)
        write_and_print(current, bench.tag if bench is not None else "", args)


def run_objective(bench: Bench, objective, results: dict, args) -> None:
    """Every cell under one objective, into ``results`` (which holds the shared set-up and standalone)."""
    info = section(results, "objective", apply_objective, bench, objective, args)
    if info is None:
        return
    results["setup"]["objective_tpot_ms"] = info["objective_tpot_ms"]
    cells = [(t, lo) for t in args.traces for lo in args.loads]
    outs: dict[str, Any] = {}
    for name in args.policies:
        log.info("policy %s in %d cells (objective %.3f ms)", name, len(cells), bench.tpot_s * 1e3)
        try:
            policy_windows(bench, name, cells, args, outs)
        except Exception as err:  # the other policies, the JSON and the table still come out
            log.error("policy %s failed: %s", name, err)
            outs.setdefault("_errors", {})[name] = traceback.format_exc()[-3000:]
    solo = results.get("standalone", {}).get("finetune_tokens_per_s")
    results["warm_windows"] = outs.pop("_warm", {})
    if "_errors" in outs:
        results["policy_errors"] = outs.pop("_errors")
    for trace, load in cells:
        key = f"{trace}/{load}"
        results["cells"][key] = out = outs.get(key, {})
        out["verdict"] = verdict(out, solo)
    section(results, "overall", overall, results)
    section(
        results,
        "plots",
        lambda: {
            "policies": comparison_plot(results, args, bench.tag),
            "timeline": _headline(args, bench.tag),
        },
    )


def write_and_print(results: dict, tag: str, args) -> None:
    path = common.write_json(f"bench_colocate{tag}.json", results)
    print(f"wrote {path}")
    try:
        print(summary_table(results, args))
    except Exception as err:
        print(f"(no table: {type(err).__name__}: {err})")


def overall(results: dict) -> dict:
    verdicts = [c.get("verdict", {}) for c in results.get("cells", {}).values()]
    ratios = [v["ratio_vs_best_baseline"] for v in verdicts if v.get("ratio_vs_best_baseline") is not None]
    fractions = [v["fraction_of_standalone"] for v in verdicts if v.get("fraction_of_standalone") is not None]
    return {
        "harli_total_violations": sum(v.get("harli_violations") or 0 for v in verdicts),
        "min_ratio_vs_best_baseline": min(ratios, default=None),
        "mean_ratio_vs_best_baseline": sum(ratios) / len(ratios) if ratios else None,
        "mean_fraction_of_standalone": sum(fractions) / len(fractions) if fractions else None,
        "all_cells_pass": bool(verdicts) and all(v.get("pass") for v in verdicts),
    }


def teardown(bench: Bench) -> dict:
    """Release everything that used the ladder's streams, then destroy the green contexts.

    Destroying a green context while work, events or cached memory blocks still refer to its streams makes a
    later event record (the caching allocator's, on free) fail with 'context is destroyed'.
    """
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.synchronize()
    bench.engine = bench.model = bench.predictor = None  # decode graphs, KV cache, weights
    gc.collect()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    bench.ladder.close()
    shutil.rmtree(bench.scratch, ignore_errors=True)
    return {"ladder_closed": True}


def _headline(args, tag: str = "") -> str | None:
    """The timeline to commit: harli on the hardest cell that ran."""
    for trace, load in (("bursty", "heavy"), ("bursty", "medium"), ("steady", "heavy")):
        src = common.out_dir() / f"timelines{tag}" / f"{trace}-{load}" / "timeline.png"
        if src.is_file():
            dst = common.out_dir() / f"bench_colocate_timeline{tag}.png"
            shutil.copy(src, dst)
            return str(dst)
    return None


if __name__ == "__main__":
    main()
