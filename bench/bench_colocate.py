"""Co-location on one GPU: harli against fixed splits and the other baselines, per trace, load and objective.

    python bench/bench_colocate.py --trace steady --objectives auto:1.5 \\
        --profile PROFILE.json --standalone STANDALONE.json   # H200: $OUT/bench_colocate-steady.json[.gz]
    python bench/bench_colocate.py --dry-run --trace bursty    # CPU: tiny model, stand-in ladder, ~1 s windows
    python bench/analyze_colocate.py --merge A.json B.json ... --out bench/results/<date>-bench_colocate-matrix.json.gz

Everything runs on the assembly `harli-train RECIPE --colocate-with MODEL` runs (``assembly.assemble``:
recipes/llama-8b-lora.yaml serving its own base model, one copy of the weights), with the bench's options:
its loads to size the engine for, SM partitions on a CPU, ``--profile`` as the recipe's profile file. Each
window gets a fresh policy (``Colocation.new_policy``; the predictor's corrections start again), a fresh
adapter and optimizer (``new_trainer``) and its trainer streams warmed (``prepare``), then serves its cell.
The page pool is off unless ``--memory-pool on``: the windows' policies warm the trainer on most rungs'
streams, and the pool's MemPool keeps every stream's cache for the process's life (torch's own cache is
emptied between windows); ``bench/bench_pool.py`` measures the pool on one split.

Cells (colocate_load.py): ``--trace`` at light, medium and heavy load (1x, 2x, 4x its rate), or the varying
trace once, whole (cell ``varying/1x``); ``--trace steady,bursty`` runs both traces' cells in turn after
one set-up. A GPU window lasts >= 15 s and holds >= 50 requests (the trace
lengthened by its generator where it runs out). Per objective (``--objectives``, default auto:1.5,auto:2:
K x the whole GPU's predicted step at the engine's peak batch) and cell: ``harli`` (keyed ``harli`` whatever
its ``--harli-options``) and any ``harli:OPTIONS`` variants ``--policies`` names (an A/B on the same set-up,
each keyed by its own name, listed in a table of their own after the matrix's), then ``static:N`` swept from the split predicted for harli's observed peak (its
largest decode batch, each step also computing the prompt tokens per step the busiest 10 s of the cell's
arrivals bring; without harli, from ``--sweep-start``, the start a previous run's matrix names) until the
best clean one is bracketed (colocate_sweep.py; >= 3 splits, at most ``--max-rungs``), then each trace's
best single split run in the loads that lack it; ``streams`` and ``temporal`` at medium load (the varying
trace's one cell), and ``temporal`` also in any cell where the sweep ran up to the largest split with a
trainer and none was clean (the verdict then judges harli against it: colocate_matrix.verdict); where
neither harli nor temporal was clean either, ``exclusive`` (the engine alone on the whole GPU) tells whether
the objectives can be kept at that load at all (``--policies exclusive`` runs it in every cell). First, the
trainer alone (``exclusive``, ``exclusive:N``, ``--solo-s`` each) gives the standalone rates on the whole GPU and on every split's trainer SMs (or ``--standalone`` gives them back),
from which colocate_matrix.py rates each policy (share efficiency) and each cell's ideal.

Every policy is held to the same TTFT objective, ``--ttft-ms`` (default 1000 ms; the recipe key
``colocation.ttft_ms``): every policy computes a backlog of prompts on the whole GPU in time for each to
wait at most that long less the margin (``Policy.ttft_plan``), and ``clean`` needs 99 % of the window's
requests to have their first token within it, a request without one counting its wait so far. Without it a fixed split too small for the load's prefill "meets" the
TPOT objective by letting prompts queue: on the H200 at auto:2, steady/heavy, static:64 kept every token
interval within 13.7 ms while 34 of 115 requests never got a first token and the rest waited 2.5 s at the
median (``--ttft-ms none`` judges TPOT alone).

``--live-fraction F`` puts that share of each cell's requests (spread evenly) on the adapter being trained,
served live (model id ``setup``, refreshed from each window's trainer after its optimizer steps): the bench
of serving the live adapter beside training (each row's ``adapter_row_fraction``, ``live_adapter``).

``--repeats N`` runs every window N times: a row is then the window of median finetune tokens/s when all
N are clean, else the one that violated most, and lists every window's figures (on the H200 two single
windows of harli at steady/light on one commit trained 6.5k and 6.8k tokens/s, 5 % apart: the light bar
is 0.70 of the standalone rate). ``--whole-gpu-now`` measures the trainer alone on the whole GPU in the
same call (N times, the median), which the light bar (harli's tokens/s over the standalone rate) then
divides by instead of the ``--standalone`` file's.

The dry run replays 8 of each window's requests (thinned, prompts and outputs clipped) in 1 s on the
quickstart's tiny model, its trainer at batch 2 x 64 on its own thread (the second core, beside decode):
it checks the machinery and the layout, its figures mean nothing.

Device calls (an estimate until measured: set-up ~60 s, a first profile ~60 s, ~5 s a window besides its
length; windows 21.5 + 15 + 15 s for steady, 20.5 + 15 + 15 s for bursty, 90 s for varying). One objective of
steady or bursty is 3 harli + ~12 static + streams + temporal + ~2 top-up windows, ~320 s of load and ~100 s
of overhead: both objectives in one call (~15 min) exceed a call's 10 minutes, so the matrix takes one
objective per call. A call starts no window that would end past ``--time-budget-s`` (570 s; what ran is kept).
  0. --trace steady --policies none --profile $OUT/profile.json --standalone $OUT/standalone.json
     (set-up, profile and standalone rates only: ~3.5 min; later calls pass the two files back)
  1-4. --trace steady|bursty --objectives auto:1.5|auto:2: ~8 min each
  5-6. --trace varying --objectives auto:1.5|auto:2 --policies harli,static --max-rungs 4: ~9 min each
     (harli and up to 4 splits, 90 s each)
  7. --trace varying --policies streams,temporal (both objectives): ~7.5 min (4 x 90 s)
About 60 minutes of device time in all. Each call returns its result (bench_colocate-<trace>.json, gzipped
past 1 MB; step rows only with ``--keep-steps``) and harli's timelines in one archive; merged, the eight
results are the matrix of record, whose table goes in the README.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harli_train.cuda_env import SETTINGS, prefer_cuda_env  # noqa: E402

CUDA_ENV = prefer_cuda_env()  # before any CUDA context exists (see harli_train/cuda_env.py)

import colocate_matrix  # noqa: E402
import colocate_tables  # noqa: E402
import common  # noqa: E402
import harli_defaults  # noqa: E402
import torch  # noqa: E402
from colocate_args import harli_name, harli_variants, parse_args, runtime_options  # noqa: E402
from colocate_load import LOADS, Cell, compressed, make_cells  # noqa: E402
from colocate_sweep import clean, no_split_clean, prefill_per_step, start_share, sweep, top_up  # noqa: E402
from colocate_windows import OutOfTime, Windows  # noqa: E402

from harli_train.colocate.assembly import assemble  # noqa: E402
from harli_train.colocate.colocation import Colocation  # noqa: E402
from harli_train.colocate.mixed_model import attention_pairs  # noqa: E402
from harli_train.config import load_recipe  # noqa: E402

DRY_WINDOW_S, DRY_REQUESTS, DRY_PROMPT, DRY_OUTPUT = 1.0, 8, 48, 24
log = logging.getLogger("bench_colocate")


def objective_tpot_s(text: str, col: Colocation) -> float:
    """``--objectives`` item: milliseconds, or 'auto:K' (K x the whole GPU's predicted step at the engine's
    peak batch, each sequence over 1024 cached tokens)."""
    if text.startswith("auto:"):
        batch = col.cfg.colocation.max_batch
        return float(text[5:]) * col.predictor.predict(
            batch, batch * 1024, col.ladder.total_sms, False, raw=True
        )
    return float(text) * 1e-3


def least_share(col: Colocation, tpot_s: float):
    """The least decode share whose predicted step (beside the trainer, from the profile; ``step_predictor``)
    for a step record meets ``tpot_s`` (a low estimate: the ideal stays an upper bound)."""
    predict, shares = step_predictor(col), [p.infer_sms for p in col.ladder.spatial]

    def share(row: dict[str, Any]) -> int | None:
        b, kv, n = row["batch"], row.get("kv_tokens") or 0, row.get("prefill_tokens") or 0
        return next((s for s in shares if predict(b, kv, s, n) <= tpot_s), None)

    return share


def step_predictor(col: Colocation) -> Callable[[int, int, int, int], float]:
    """``predict(batch, kv_tokens, share, prefill_tokens)``: the profile's step beside the trainer, a mixed
    step when it carries prefill tokens (one chunk without context: a low estimate) and the profile has
    mixed steps."""
    pred = col.predictor

    def predict(batch: int, kv_tokens: int, sms: int, prefill_tokens: int) -> float:
        if prefill_tokens and pred.mixed is not None:
            pairs = attention_pairs([(prefill_tokens, 0)])
            return pred.predict_mixed(batch, kv_tokens, prefill_tokens, pairs, sms, True, raw=True)
        return pred.predict(batch, kv_tokens, sms, True, raw=True)

    return predict


def run_objective(
    win: Windows,
    args: argparse.Namespace,
    label: str,
    cells: list[Cell],
    standalone: dict[str, Any],
    timelines: Path,
    out: dict[str, Any],
) -> None:
    """Every window of objective ``label``, into ``out`` (its part of the result layout, colocate_matrix.py)
    as each ends, so that a call stopped early keeps what ran; harli's timelines under ``timelines``."""
    col = win.col
    whole_now = (standalone.get("whole_gpu_now") or {}).get("tokens_per_s")
    tpot_s = objective_tpot_s(label, col)
    out["tpot_ms"], out["ttft_ms"] = tpot_s * 1e3, col.cfg.colocation.ttft_ms
    out["cells"] = {c.key: {"window": c.describe(), "policies": {}} for c in cells}
    if whole_now is not None:  # the light bar's denominator, measured in this call
        for entry in out["cells"].values():
            entry["whole_gpu_tokens_per_s"] = whole_now
    shares = [p.infer_sms for p in col.ladder.spatial]
    by_sms = {int(k): v for k, v in standalone.get("by_train_sms", {}).items() if v is not None}
    baseline_cell = next((c for c in cells if c.load == "medium"), cells[0])
    static: dict[str, dict[int, dict]] = {}

    def window(name: str, cell: Cell, plot_to: Path | None = None) -> tuple[dict, list[dict]]:
        """``name``'s row in ``cell`` (``--repeats`` windows: ``Windows.repeated``), kept in ``out`` even
        when the time budget stops the repeats part way (OutOfTime is raised after)."""
        stopped = None
        try:
            row, steps = win.repeated(
                args.repeats,
                name,
                tpot_s,
                cell.requests,
                window_s=cell.window_s,
                time_scale=cell.time_scale,
                plot_to=plot_to,
            )
        except OutOfTime as stop:
            if stop.kept is None:
                raise
            (row, steps), stopped = stop.kept, stop
        out["cells"][cell.key]["policies"]["harli" if name == harli_name(args) else name] = row
        if stopped is not None:
            raise stopped
        return row, steps

    for cell in cells:
        entry = out["cells"][cell.key]
        start, harli_row = None, None
        if "harli" in args.policies:
            png = timelines / label.replace(":", "") / f"{cell.trace}-{cell.load}.png"
            row, steps = window(harli_name(args), cell, png)
            harli_row = row
            if "error" not in row:
                spans = colocate_matrix.decode_spans(steps, least_share(col, tpot_s), col.ladder.total_sms)
                entry["ideal_tokens_per_s"] = colocate_matrix.ideal_tokens_per_s(
                    spans, row["serve_s"], by_sms, standalone.get("whole_gpu_tokens_per_s") or 0.0
                )
                budget_s = tpot_s * (1 - col.cfg.colocation.margin)
                arrivals = [(r.arrival_s * cell.time_scale, r.prompt_len or 0) for r in cell.requests]
                n = prefill_per_step(arrivals, budget_s)
                start = start_share(steps, shares, step_predictor(col), budget_s, n)
        for variant in harli_variants(args):  # an A/B in the same set-up: keyed by its own name
            window(
                variant,
                cell,
                timelines / label.replace(":", "") / f"{cell.trace}-{cell.load}-{slug(variant)}.png",
            )
        if start is None and args.sweep_start is not None:
            start = sweep_start(shares, args.sweep_start)
        if "static" in args.policies and start is not None:
            entry["sweep_start"] = f"static:{start}"
            static[cell.key] = sweep(
                shares, start, lambda s, c=cell: window(f"static:{s}", c)[0], args.min_rungs, args.max_rungs
            )
        if cell is baseline_cell:
            for name in ("streams", "temporal"):
                if name in args.policies:
                    window(name, cell)
        elif "temporal" in args.policies and no_split_clean(static.get(cell.key), shares):
            # The baseline the verdict judges harli by where no split keeps the objective.
            temporal, _ = window("temporal", cell)
            if harli_row is not None and not clean(harli_row) and not clean(temporal):
                # Nothing kept the objectives: can the engine alone? If not, the verdict reads "clean"
                # as "as clean as the engine alone" (colocate_matrix.keeps).
                window("exclusive", cell)
        if "exclusive" in args.policies and "exclusive" not in entry["policies"]:
            window("exclusive", cell)
    if static:
        by_key = {c.key: c for c in cells}
        out["single_split_top_ups"] = top_up(
            static, shares, lambda key, s: window(f"static:{s}", by_key[key])[0]
        )


def sweep_start(shares: list[int], sms: int) -> int:
    """The least of the spatial decode ``shares`` (ascending) holding at least ``sms`` SMs (the largest when
    none does): where ``--sweep-start`` starts the fixed splits."""
    return next((s for s in shares if s >= sms), shares[-1])


def slug(name: str) -> str:
    """``name`` as a file name's part: letters, digits, dots and dashes."""
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in name)


def set_up(args: argparse.Namespace, scratch: Path, cells: list[Cell]) -> Colocation:
    """The assembly, as the command line builds it, with the bench's loads, partitions and profile file."""
    overrides = [f"train.steps={10**7}", "train.log_every=1000000", "output.checkpoint_every=0"]
    overrides += [f"output.dir={scratch / 'setup'}", f"colocation.policy={harli_name(args)}"]
    if args.profile:
        overrides.append(f"colocation.profile={Path(args.profile).resolve()}")
    if args.ladder_step:
        overrides.append(f"colocation.ladder_step={args.ladder_step}")
    if args.dry_run:
        overrides += ["train.device=cpu", "model.dtype=float32", "train.batch_size=2", "data.seq_len=64"]
    if args.memory_pool == "off":
        overrides.append("colocation.memory_pool=false")
    overrides.append(f"colocation.ttft_ms={'null' if args.ttft_ms is None else args.ttft_ms}")
    cfg = load_recipe(args.recipe, overrides + args.set)
    return assemble(cfg, cfg.model.name, loads=[list(c.requests) for c in cells], spatial=True)


LIVE_MODEL = "setup"  # the live adapter's model id: the set-up's output directory's name


def on_live_adapter(cells: list[Cell], fraction: float) -> list[Cell]:
    """``cells`` with ``fraction`` of each cell's requests (spread evenly over it) naming the live adapter,
    the adapter being trained: those run their LoRA in the decode steps, served from the trainer's masters."""
    if fraction <= 0:
        return cells
    out = []
    for cell in cells:
        reqs = [
            dataclasses.replace(r, model=LIVE_MODEL) if int((i + 1) * fraction) > int(i * fraction) else r
            for i, r in enumerate(cell.requests)
        ]
        out.append(dataclasses.replace(cell, requests=tuple(reqs)))
    return out


def describe(col: Colocation, args: argparse.Namespace, cells: list[Cell], seconds: float) -> dict[str, Any]:
    cfg, engine = col.cfg, col.engine.engine
    return {
        "recipe": str(args.recipe),
        "recipe_overrides": args.set,
        "trace": args.trace,
        "model": cfg.model.name,
        "device": col.info["device"],
        "margin": cfg.colocation.margin,
        "harli_defaults": harli_defaults.in_force(),  # what a harli name's unlisted options were
        "max_batch": cfg.colocation.max_batch,
        "train_batch": [cfg.train.batch_size, cfg.data.seq_len],
        "layers_per_microstep": cfg.train.layers_per_microstep,
        "ladder": {"kind": col.ladder.kind, "rungs": col.ladder.describe()},
        "engine": {"max_model_len": engine.config.max_model_len, "kv_blocks": engine.storage.num_blocks},
        "profile": col.info["profile"],
        "cells": {c.key: c.describe() for c in cells},
        "load_levels": {k: f"{v:g}x the trace's rate" for k, v in LOADS.items()},
        "runtime": runtime_options(args),
        "cuda_env": {k: os.environ.get(k) for k in SETTINGS} | {"set_by_bench": sorted(CUDA_ENV)},
        "setup_s": round(seconds, 1),
    }


def main() -> None:
    args = parse_args(__doc__.split("\n")[0])
    if args.dry_run:
        torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"env": common.environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    result["objectives"] = {}
    loads = args.loads.split(",")
    cells = [
        c for t in args.trace.split(",") for c in make_cells(t, loads, args.min_window_s, args.min_requests)
    ]
    if args.dry_run:
        cells = [compressed(c, DRY_WINDOW_S, DRY_REQUESTS, DRY_PROMPT, DRY_OUTPUT) for c in cells]
    cells = on_live_adapter(cells, args.live_fraction)
    scratch = Path(tempfile.mkdtemp(prefix="bench_colocate_"))
    col = None
    try:
        col = set_up(args, scratch, cells)
        result["setup"] = describe(col, args, cells, time.perf_counter() - t0)
        win = Windows(
            col, scratch, t0, args.time_budget_s, runtime_options(args), args.keep_steps, args.sample_stalls
        )
        result["standalone"] = win.standalone(Path(args.standalone) if args.standalone else None, args.solo_s)
        if args.whole_gpu_now and args.policies:
            result["standalone"]["whole_gpu_now"] = win.whole_gpu_now(args.repeats, args.solo_s)
        if args.policies:
            for label in args.objectives:
                out = result["objectives"][label] = {}
                run_objective(win, args, label, cells, result["standalone"], scratch / "timelines", out)
    except OutOfTime as stop:
        result["out_of_time"] = f"stopped before {stop} at {time.perf_counter() - t0:.0f} s"
        log.warning("time budget: %s", result["out_of_time"])
    except BaseException as err:  # even Ctrl-C: what ran is written
        result["fatal"] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        log.error("bench stopped: %s", result["fatal"]["error"])
    finally:
        if col is not None:
            col.close()
        result["total_s"] = round(time.perf_counter() - t0, 1)
        write_outputs(result, args, scratch)


def write_outputs(result: dict[str, Any], args: argparse.Namespace, scratch: Path) -> None:
    """The result JSON (gzipped past 1 MB), harli's timelines in one archive, and the table last."""
    matrix = colocate_matrix.finish(result)
    traces = args.trace.replace(",", "-")
    name = f"bench_colocate-{traces}.json"
    size = len(json.dumps(matrix, default=str))
    path = colocate_matrix.write(common.out_dir() / (name + ".gz" if size > 1 << 20 else name), matrix)
    pngs = sorted((scratch / "timelines").rglob("*.png"))
    if pngs:
        with tarfile.open(common.out_dir() / f"bench_colocate-{traces}-timelines.tar.gz", "w:gz") as tar:
            for png in pngs:
                tar.add(png, arcname=str(png.relative_to(scratch)))
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {path}" + (f" and {len(pngs)} timelines" if pngs else ""))
    errors = [
        f"{name} failed in {obj} {key}"
        for obj, part in matrix["objectives"].items()
        for key, cell in part["cells"].items()
        for name, row in cell["policies"].items()
        if "error" in row
    ]
    for note in [result.get("out_of_time"), (result.get("fatal") or {}).get("error")] + errors:
        if note:
            print(f"note: {note}")
    print(colocate_tables.tables(matrix))


if __name__ == "__main__":
    main()
