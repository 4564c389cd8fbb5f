"""The shared page pool under pressure: recipes/llama-8b-lora.yaml beside the long-context trace, static:N.

    python bench/bench_pool.py --out $OUT/bench_pool.json                 # H200 (~10 min; --phases to split)
    python bench/bench_pool.py --dry-run --out /tmp/bench_pool.json       # CPU: tiny model, seconds

Everything runs on the assembly ``harli-train RECIPE --colocate-with MODEL`` runs (``assembly.assemble``),
its policy fixed (``--policy static:N``) so that the runs compare. Phases (``--phases``, in this order):

- ``plain``: the assembly without the pool (``colocation.memory_pool=false``: a fixed KV tensor, torch's
  allocator); ``--windows`` windows of ``--window-s`` of each ``--traces`` trace: finetune tokens/s.
  It goes first: its memory is torch's to give back before the pool claims its budget.
- ``loss``: the assembly on the pool (``colocation.memory_gib=--memory-gib``), two runs of ``--steps``
  training steps each on a fresh adapter: without pressure (no load) and with it (recipes/traces/longctx.jsonl,
  whose bursts want more KV cache than the pool has free beside the trainer). Per run: the loss curve, the
  pool's report (reclaims: count, pages, bytes spilled, spill bandwidth, and of the spills' seconds those
  pinning host buffers and those the copies took on the GPU, grow latency; grows, shrinks,
  refusals), out-of-memory recoveries, requests served, and the decode steps over the objective within 5
  steps after each reclaim, against the same rate over the run's other decode steps (the load's own
  violations, which a fixed split that cannot keep it has without any reclaim). The two loss curves must be
  equal, step for step.
- ``pool``: the same throughput windows as ``plain``, on the pool at the recipe's default budget (what is
  free after the weights and a safety margin, as a user's run has it): what the pool itself costs. The
  ``--memory-gib`` budget is the loss phase's alone; on it the trainer must swap its activations through
  host memory while the long-context cache holds its pages, which is pressure's cost, not the pool's.

Each phase runs in a process of its own (``--in-process``: all in this one), so that no phase inherits
another's GPU memory. The loss phase's default budget (`loss_budget_gib`), 60 GiB on the H200, is below what
its pressured run wants there (~68 GiB: the KV cache's peak beside the trainer's working set), so the cache
must take pages from the trainer; on an 80 GB card the recipe's default budget already is.
One JSON (``--out``) holds every phase that ran (a phase that fails records its error and the others run);
it is written again as each phase's process ends, and a SIGINT (a device call's time limit: ``timeout -s
INT``) stops the phase running (its process with it) and writes what the finished ones gave, the cut
recorded as ``interrupted``. The table comes last. Throughput figures are medians over the windows, each
window after the first is judged against the same trace's other windows, and the pool's cost is
1 - median(pool) / median(plain).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harli_train.cuda_env import prefer_cuda_env  # noqa: E402

prefer_cuda_env()  # before any CUDA context exists

import common  # noqa: E402
import torch  # noqa: E402

from harli_train.colocate import assembly  # noqa: E402
from harli_train.colocate.assembly import assemble  # noqa: E402
from harli_train.colocate.colocation import Colocation  # noqa: E402
from harli_train.colocate.report import read_steps  # noqa: E402
from harli_train.colocate.runtime_options import RuntimeOptions  # noqa: E402
from harli_train.config import load_recipe  # noqa: E402
from harli_train.engine.load import TraceRequest, read_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "recipes" / "traces"
AFTER_RECLAIM = 5  # decode steps after a reclaim in which a violation counts against it
CHILD_GRACE_S = 15.0  # a phase's process, signalled, has this long to end before it is killed
log = logging.getLogger("bench_pool")


def load_trace(name: str, dry: bool) -> list[TraceRequest]:
    """A shipped trace; on the dry run's tiny model (2048-token context) its lengths cut 16x and 8x."""
    reqs = read_trace(TRACES / f"{name}.jsonl")
    if not dry:
        return reqs
    return [
        replace(r, prompt_len=max((r.prompt_len or 64) // 16, 1), output_len=max(r.output_len // 8, 1))
        for r in reqs
    ]


def loss_budget_gib(dry: bool) -> float | None:
    """The loss phase's default pool budget: 60 GiB on a GPU of 100 GiB or more (the H200: its pressured run
    wants ~68), else None, the recipe's default budget (on an 80 GB card what is free after the weights less
    the margin, ~39 GiB, is below what the pressured run wants already)."""
    if dry:
        return 0.006
    return 60.0 if torch.cuda.get_device_properties(0).total_memory >= 100 * 2**30 else None


def set_up(
    args: argparse.Namespace, phase: str, loads: list[list[TraceRequest]], scratch: Path
) -> Colocation:
    """The assembly of ``phase``: plain (no pool), loss (the pool at ``--memory-gib``, so that the long-context
    bursts press it) or pool (the pool at the recipe's default budget, as a user's run has it)."""
    pool = phase != "plain"
    overrides = [
        f"train.steps={10**7}",
        "train.log_every=1",
        "output.checkpoint_every=0",
        f"output.dir={scratch / ('pool' if pool else 'plain')}",
        f"colocation.policy={args.policy}",
        f"colocation.memory_pool={str(pool).lower()}",
    ]
    if phase == "loss" and args.memory_gib is not None:
        overrides.append(f"colocation.memory_gib={args.memory_gib}")
    if args.profile:
        overrides.append(f"colocation.profile={Path(args.profile).resolve()}")
    if args.dry_run:
        overrides += ["train.device=cpu", "model.dtype=float32", "train.batch_size=2", "data.seq_len=32"]
        overrides += ["train.layers_per_microstep=1", "colocation.max_batch=8"]
    cfg = load_recipe(args.recipe, [*overrides, *args.set])
    return assemble(cfg, cfg.model.name, loads=loads, spatial=True)


def run(col: Colocation, scratch: Path, name: str, requests: list[TraceRequest], opts: RuntimeOptions):
    """One run on a fresh adapter: (summary, step rows, the per-step losses)."""
    run_dir = Path(tempfile.mkdtemp(dir=scratch, prefix=name + "-"))
    gc.collect()
    col.new_trainer(run_dir / "train")
    policy = col.prepare(col.new_policy(col.cfg.colocation.policy))
    summary = col.runtime(policy, requests, run_dir / "colocate", opts).run()
    metrics = run_dir / "train" / "metrics.jsonl"
    losses = (
        [json.loads(line)["loss"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    return summary, read_steps(run_dir / "colocate" / "steps.jsonl"), losses


def after_reclaims(steps: list[dict[str, Any]], listed: int = 20) -> dict[str, Any]:
    """Decode steps over the objective within AFTER_RECLAIM decode steps of a reclaim (by the step rows'
    running count of reclaims), beside the same count over the run's other decode steps: a load the fixed
    split cannot keep violates everywhere, so a reclaim costs only what its steps violate past the rest
    (``excess_rate``). ``violating`` lists the first ``listed`` violating steps after a reclaim (kind, time,
    batch, prefill tokens, share, measured / predicted seconds, token interval, the host's gap before its
    launch, both tenants' pages, steps since the reclaim) with ``between``: the steps recorded since the
    decode step before it (prefill steps, ``oom`` rows of steps that ran out of memory and ran again with
    their ``recovery_s``; none when the engine stood idle, waiting for blocks)."""
    at = [i for i, r in enumerate(steps) if r["kind"] in ("decode", "mixed")]
    decode = [steps[i] for i in at]
    marks = [
        i for i in range(1, len(decode)) if decode[i].get("reclaims", 0) > decode[i - 1].get("reclaims", 0)
    ]
    since: dict[int, int] = {}
    for i in marks:
        for j in range(i, min(i + AFTER_RECLAIM, len(decode))):
            since[j] = min(since.get(j, AFTER_RECLAIM), j - i)
    judged = sorted(since)
    violations = [j for j in judged if decode[j].get("violated")]
    elsewhere = len(decode) - len(judged)
    violations_elsewhere = sum(bool(r.get("violated")) for j, r in enumerate(decode) if j not in since)
    rate = len(violations) / len(judged) if judged else None
    rate_elsewhere = violations_elsewhere / elsewhere if elsewhere else None
    keys = ("kind", "t", "batch", "prefill_tokens", "infer_sms", "measured_s", "predicted_s", "interval_s")
    keys += ("launch_s", "host_gap_s", "plan_s", "kv_pages", "trainer_pages")

    def between(j: int) -> list[dict[str, Any]]:
        first = at[j - 1] + 1 if j else 0
        keep = ("kind", "t", "measured_s", "recovery_s")  # recovery_s: a step out of memory, run again
        return [{k: steps[i][k] for k in keep if k in steps[i]} for i in range(first, at[j])]

    return {
        "reclaim_steps": len(marks),
        "steps_judged": len(judged),
        "violations": len(violations),
        "violation_rate": rate,
        "steps_elsewhere": elsewhere,
        "violations_elsewhere": violations_elsewhere,
        "violation_rate_elsewhere": rate_elsewhere,
        "excess_rate": None if rate is None or rate_elsewhere is None else rate - rate_elsewhere,
        "violating": [
            {**{k: decode[j].get(k) for k in keys}, "steps_after_reclaim": since[j], "between": between(j)}
            for j in violations[:listed]
        ],
    }


def _violations(after: dict[str, Any]) -> str:
    """``v/n (v'/n')``: violating decode steps after reclaims, and over the run's other decode steps."""
    return (
        f"{after['violations']}/{after['steps_judged']} "
        f"({after.get('violations_elsewhere', '-')}/{after.get('steps_elsewhere', '-')})"
    )


def loss_phase(col: Colocation, args: argparse.Namespace, scratch: Path, longctx: list[TraceRequest]) -> dict:
    col.cfg.train.steps = args.steps
    opts = RuntimeOptions(until="train", quiet=True, finish=False, plots=False, drain_s=5.0)
    out: dict[str, Any] = {}
    curves = {}
    for name, requests in (("quiet", []), ("pressure", longctx)):
        summary, steps, losses = run(col, scratch, name, requests, opts)
        curves[name] = losses
        out[name] = {
            "steps": len(losses),
            "losses": losses,
            "memory_pool": summary["memory"]["pool"],
            "oom_recoveries": summary["finetune"]["oom_recoveries"],
            "abandoned_steps": summary["finetune"]["abandoned_steps"],
            "served": summary["serving"]["requests"],
            "refused": summary["serving"]["refused"],
            "preemptions": summary["serving"]["preemptions"],
            "decode_oom_recoveries": summary["serving"].get("decode_oom_recoveries"),
            "decode_oom_s": summary["serving"].get("decode_oom_s"),
            "violation_rate": summary["serving"]["violation_rate"],
            "after_reclaim": after_reclaims(steps),
        }
    a, b = curves["quiet"], curves["pressure"]
    out["losses_equal"] = bool(a) and a == b
    out["first_difference"] = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return out


def throughput_phase(col: Colocation, args: argparse.Namespace, scratch: Path, loads: dict) -> dict:
    opts = RuntimeOptions(until="load", window_s=args.window_s, quiet=True, finish=False, plots=False)
    out = {}
    for trace, requests in loads.items():
        rates = []
        for w in range(args.windows):
            summary, _, _ = run(col, scratch, f"{trace}-{w}", requests, opts)
            rates.append(summary["finetune"]["tokens_per_s"])
        out[trace] = {"tokens_per_s": rates, "median": common.median(rates)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: the quickstart's tiny model, short windows")
    ap.add_argument("--recipe", default=None, help="default: recipes/llama-8b-lora.yaml (quickstart dry)")
    ap.add_argument("--policy", default=None, help="a fixed split (default static:64; static:48 dry)")
    ap.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="the loss phase's pool budget in GiB (default 60 on a GPU of 100 GiB or more, else the recipe's "
        "default budget; dry 0.006); the pool phase runs on the recipe's default budget",
    )
    ap.add_argument("--steps", type=int, default=None, help="training steps of each loss run (30; dry 8)")
    ap.add_argument("--traces", default="steady,bursty", help="the throughput windows' traces")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=None, help="seconds a window (20; dry 1.5)")
    ap.add_argument("--phases", default="plain,loss,pool")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override of every phase (e.g. train.cuda_graphs=true); repeatable",
    )
    ap.add_argument(
        "--graphs-on-pool",
        action="store_true",
        help="with train.cuda_graphs=true on a GPU: the graphs in the pool (assembly.GRAPHS_ON_CUDA_POOL, "
        "on by default now: the flag keeps older command lines working)",
    )
    ap.add_argument("--profile", default=None, help="decode profile file: reused when it matches")
    ap.add_argument("--out", default=None, help="the result JSON (default $OUT/bench_pool.json)")
    ap.add_argument("--in-process", action="store_true", help="run the phases in this process")
    args = ap.parse_args()
    dry = args.dry_run
    if args.graphs_on_pool:
        assembly.GRAPHS_ON_CUDA_POOL = True
    args.recipe = Path(args.recipe or ROOT / "recipes" / ("quickstart.yaml" if dry else "llama-8b-lora.yaml"))
    args.policy = args.policy or ("static:48" if dry else "static:64")
    args.memory_gib = args.memory_gib or loss_budget_gib(dry)
    args.steps = args.steps or (8 if dry else 30)
    args.window_s = args.window_s or (1.5 if dry else 20.0)
    if dry:
        torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    t0 = time.perf_counter()
    traces = {name: load_trace(name, dry) for name in args.traces.split(",") if name}
    longctx = traces.get("longctx") or load_trace("longctx", dry)
    result: dict[str, Any] = {"env": common.environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    scratch = Path(tempfile.mkdtemp(prefix="bench_pool_"))
    loads = [longctx, *traces.values()]
    phases = [p for p in args.phases.split(",") if p]
    out = Path(args.out) if args.out else common.out_dir() / "bench_pool.json"
    if not args.in_process and len(phases) > 1:
        try:
            for phase in phases:
                got = phase_in_child(phase, scratch)
                result.setdefault("setup", {}).update(got.pop("setup", {}))
                result.update(got)
                result["total_s"] = round(time.perf_counter() - t0, 1)
                write_result(result, out)  # what a cut-short call still returns
        except KeyboardInterrupt:
            done = [p for p in phases if p in result]
            result["interrupted"] = f"SIGINT after {time.perf_counter() - t0:.0f} s; phases done: {done}"
            log.warning("bench_pool: %s", result["interrupted"])
        result["total_s"] = round(time.perf_counter() - t0, 1)
        finish(result, out)
        return
    for phase in phases:
        col = None
        try:
            col = set_up(args, phase, loads, scratch)
            result.setdefault("setup", {})[phase] = {
                "memory": col.info.get("memory"),
                "s": time.perf_counter() - t0,
            }
            if phase == "loss":
                result["loss"] = loss_phase(col, args, scratch, longctx)
            else:
                result[phase] = throughput_phase(col, args, scratch, traces)
        except Exception as err:  # the other phases still run
            log.error("phase %s failed: %s", phase, err)
            result[phase] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        finally:
            if col is not None:
                col.close()
            del col
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    result["total_s"] = round(time.perf_counter() - t0, 1)
    finish(result, out)


def phase_in_child(phase: str, scratch: Path) -> dict[str, Any]:
    """Run one phase in a child process (this command line, that phase alone, its JSON in ``scratch``);
    returns what it wrote for the phase and its set-up, or the child's failure as the phase's error."""
    out = scratch / f"phase-{phase}.json"
    argv = list(sys.argv[1:])
    for flag in ("--phases", "--out"):
        while flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
        argv = [a for a in argv if not a.startswith(flag + "=")]
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--phases", phase, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        proc.wait()
    except KeyboardInterrupt:  # the phase's process goes too: no orphan keeps the GPU busy
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
    if not out.exists():
        return {phase: {"error": f"the phase's process exited with {proc.returncode} and wrote nothing"}}
    child = json.loads(out.read_text())
    return {phase: child.get(phase), "setup": child.get("setup", {})}


def write_result(result: dict[str, Any], path: Path) -> None:
    """``result`` to ``path`` (the pool's cost against plain filled in where both phases ran)."""
    plain, pool = result.get("plain", {}), result.get("pool", {})
    for trace in pool:
        if isinstance(pool.get(trace), dict) and trace in plain and "median" in plain[trace]:
            base = plain[trace]["median"]
            pool[trace]["cost_vs_plain"] = 1 - pool[trace]["median"] / base if base else None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def finish(result: dict[str, Any], path: Path) -> None:
    write_result(result, path)
    print(f"wrote {path}")
    plain, pool = result.get("plain", {}), result.get("pool", {})
    rows = []
    loss = result.get("loss", {})
    for name in ("quiet", "pressure"):
        r = loss.get(name)
        if r:
            rec = r["memory_pool"]["reclaims"]
            rows.append(
                [
                    f"loss/{name}",
                    r["steps"],
                    rec["count"],
                    rec["pages"],
                    f"{rec['bytes_spilled'] / 2**20:.1f}",
                    "-" if rec["spill_gib_per_s"] is None else f"{rec['spill_gib_per_s']:.1f}",
                    f"{rec.get('pin_seconds', 0.0):.2f}/{rec.get('copy_gpu_seconds', 0.0):.2f}/{rec['seconds']:.2f}",
                    "-" if rec["grow_ms"]["p50"] is None else f"{rec['grow_ms']['p50']:.1f}",
                    _violations(r["after_reclaim"]),
                    f"{r['oom_recoveries']}/{r.get('decode_oom_recoveries', '-')}",
                    r.get("preemptions", "-"),
                ]
            )
    header = ["run", "steps", "reclaims", "pages", "spilled MiB", "GiB/s", "pin/copy/all s", "grow ms p50"]
    header += ["viol.<=5 (elsewhere)", "OOM trainer/decode", "preempted"]
    if rows:
        print(common.table(rows, header))
        print(f"loss curves equal: {loss.get('losses_equal')}")
    for trace in pool:
        if isinstance(pool.get(trace), dict) and "median" in pool[trace]:
            cost = pool[trace].get("cost_vs_plain")
            base = plain.get(trace, {}).get("median")
            print(
                f"{trace}: finetune tok/s pool {pool[trace]['median']:.0f} vs plain "
                f"{'-' if base is None else f'{base:.0f}'} (cost {'-' if cost is None else f'{100 * cost:.1f}%'})"
            )
    for phase in ("plain", "loss", "pool"):
        if isinstance(result.get(phase), dict) and "error" in result[phase]:
            print(f"note: {phase} failed: {result[phase]['error']}")


if __name__ == "__main__":
    main()
