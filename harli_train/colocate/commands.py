"""What the command line calls: a co-located training run, and profiling a model's decode latency.

harli-train RECIPE.yaml --colocate-with MODEL [--policy P]   -> run_colocated(...)
harli-train profile MODEL [--out PATH]                       -> run_profile(...)
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

from harli_train.colocate import report
from harli_train.colocate.assembly import (
    assemble,
    build_engine,
    build_ladder,
    check_policy,
)
from harli_train.colocate.predictor_setup import (
    CPU_BATCHES,
    GPU_BATCHES,
    build_predictor,
    corun_workload,
)
from harli_train.colocate.profile import ProfileKey, check_destination, default_profile_path
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.config import DEFAULT_OUTPUT_DIR, RecipeConfig, resolve_output_dir
from harli_train.data.tokenizer import load_tokenizer
from harli_train.engine.load import poisson_trace
from harli_train.model import is_preset, load_model, resolve_dtype
from harli_train.train.run_checks import resolve_device

log = logging.getLogger(__name__)

COLOCATED_OUTPUT_DIR = DEFAULT_OUTPUT_DIR + "-colocated"


def run_colocated(
    cfg: RecipeConfig,
    serve_model: str,
    policy: str | None = None,
    resume: str | Path | None = None,
    quiet: bool = False,
    options: RuntimeOptions | None = None,
    serve: tuple[str, int] | None = None,
    api_key: str | None = None,
    exit_after_training: bool = False,
    parallel: Any = None,
) -> dict[str, Any]:
    """Train as ``cfg`` says while serving ``serve_model``'s decode load on the same GPU; returns the summary.

    With ``serve`` = (host, port) HTTP clients reach the engine through the OpenAI-compatible API beside the
    recipe's load (``harli_train.serve``), until the run is stopped (SIGTERM, Ctrl-C), or, with
    ``exit_after_training``, until training is done and their requests have finished.
    ``parallel``: rank 0's part of a tensor-parallel job (``assemble``'s). ``policy`` overrides
    ``colocation.policy``; ``resume`` is a run directory or checkpoint to continue from.
    The adapter and checkpoints go to ``<output.dir>`` as usual, the co-location records to
    ``records_dir(...)``: ``<output.dir>/colocate/``, or beside it for a resumed run.
    """
    if policy is not None:
        cfg.colocation.policy = check_policy(policy)
    options = options or RuntimeOptions(quiet=quiet)
    extra = {} if parallel is None else {"parallel": parallel}  # one GPU: assemble exactly as before
    if serve is not None:
        extra["live_adapter"] = True  # the trainer's adapter served live
        extra["http"] = True  # clients' requests may be as long as the model's context
    col = assemble(cfg, serve_model, resume, **extra)
    records, part = records_dir(Path(cfg.output.dir), resumed=resume is not None)
    col.info["records"] = {"dir": str(records), "part": part}
    try:
        log.info(
            "co-locating %s training with %s decode (%s, objective TPOT %g ms, %d requests, %s weights)",
            cfg.model.name,
            serve_model,
            col.policy.name,
            cfg.colocation.tpot_ms,
            len(col.requests),
            "shared" if col.info["shared_weights"] else "separate",
        )
        http = None
        if serve is not None:
            options, http = _with_server(col, serve_model, serve, api_key, exit_after_training, options)
        try:
            summary = col.runtime(col.policy, col.requests, records, options).run()
        finally:
            if http is not None:
                http.stop()
    finally:
        col.close()
    ft, sv = summary["finetune"], summary["serving"]
    attained = "-" if sv["tpot_attainment"] is None else f"{100 * sv['tpot_attainment']:.1f}%"
    ttft = sv.get("ttft_attainment")
    ttft_met = "" if ttft is None else f" ({100 * ttft:.1f}% within {sv['objective_ttft_ms']:g} ms)"
    log.info(
        "%s: finetune %.0f tokens/s while serving; %s; TPOT met by %s of them, "
        "TTFT p99 %s ms%s; summary in %s",
        summary["policy"],
        ft["tokens_per_s"],
        report.objective_text(summary["objective_stats"]),
        attained,
        _fmt(sv["ttft_ms"], "p99"),
        ttft_met,
        records / "summary.json",
    )
    summary["interrupted"] = summary["stop_reason"] == "interrupted"
    summary["adapter"] = summary["trainer"].get("adapter")
    if summary["stop_reason"] == "out_of_memory":
        summary["error"] = out_of_memory_message(summary)
    elif summary["stop_reason"] == "decode_out_of_memory":
        summary["error"] = decode_out_of_memory_message(summary)
    return summary


def out_of_memory_message(summary: dict[str, Any]) -> str:
    """Why a run stopped as ``out_of_memory`` (the trainer failed again and again with decode idle), the
    memory it had, what to change, and where its completed steps are."""
    pool = summary.get("memory", {}).get("pool", {})
    if pool.get("enabled"):
        page = pool["page_bytes"]
        kv_gib = pool["tenants"]["kv"]["now"] * page / 2**30
        where = (
            f"the page pool's {pool['budget_pages'] * page / 2**30:.2f} GiB ({pool['budget_source']}), "
            f"{kv_gib:.2f} GiB of it the idle KV cache's smallest size"
        )
        fix = "raise colocation.memory_gib, or lower train.batch_size or data.seq_len"
    else:
        where = "the GPU memory left beside the decode engine's KV cache"
        fix = "lower train.batch_size or data.seq_len, or serve a smaller colocation.max_batch"
    return (
        f"the trainer does not fit in {where}: it ran out of memory with nothing else running; {fix}"
        f"{_checkpointed(summary)}"
    )


def decode_out_of_memory_message(summary: dict[str, Any]) -> str:
    """Why a run stopped as ``decode_out_of_memory`` (engine steps failed again and again with the trainer's
    memory released), what to change, and where the trainer's completed steps are."""
    pooled = summary.get("memory", {}).get("pool", {}).get("enabled")
    fix = "serve a smaller colocation.max_batch or shorter requests"
    if pooled:
        fix += ", raise colocation.memory_gib or lower colocation.trainer_memory_gib"
    else:
        fix += ", or lower train.batch_size or data.seq_len"
    ooms = summary.get("serving", {}).get("decode_oom_recoveries")
    return (
        f"the decode engine's steps do not fit in the GPU memory left beside the trainer: they ran out of "
        f"memory again and again with the trainer's memory released ({ooms} out-of-memory steps in the run); "
        f"{fix}{_checkpointed(summary)}"
    )


def _checkpointed(summary: dict[str, Any]) -> str:
    trainer = summary.get("trainer", {})
    if not trainer.get("checkpoint"):
        return ""
    return f"; steps 1-{trainer['steps']} are checkpointed in {trainer['checkpoint']} (--resume continues)"


def _with_server(col, serve_model: str, serve, api_key, exit_after_training: bool, options: RuntimeOptions):
    """Start the HTTP front end on a thread of its own, its requests entering the runtime's loop through a
    request port; returns the runtime options that carry the port, and the front end (to stop)."""
    from dataclasses import replace

    from harli_train.colocate.gauges import GaugeBoard
    from harli_train.serve.app import Server
    from harli_train.serve.engine_loop import RequestPort
    from harli_train.serve.http_thread import HttpThread

    port = RequestPort(col.engine, col.cfg.colocation.max_queue, col.catalog)
    board = GaugeBoard()
    server = Server(
        port,
        col.engine.tokenizer,
        col.engine.max_model_len,
        col.catalog,
        api_key,
        extra_metrics=board.metrics,
    )
    http = HttpThread(server, *serve, grace_s=options.grace_s)
    http.start()
    return replace(options, port=port, serve_until_stopped=not exit_after_training, gauges=board), http


def use_colocated_output_dir(cfg: RecipeConfig) -> None:
    """Give a co-located run its own default run directory: an ``output.dir`` equal to the default
    (``runs/{recipe_stem}``, written out in the recipe or not) becomes ``runs/{recipe_stem}-colocated``, so
    that the run does not collide with the same recipe's standalone run. Any other ``output.dir`` is kept."""
    if cfg.output.dir == resolve_output_dir(DEFAULT_OUTPUT_DIR, cfg.source):
        cfg.output.dir = resolve_output_dir(COLOCATED_OUTPUT_DIR, cfg.source)


def records_dir(run_dir: Path, resumed: bool) -> tuple[Path, int]:
    """Where a co-located run writes its records (steps, summary, plots, requests), and which part it is.

    A run's first part writes ``<run_dir>/colocate/``; each resumed part writes the next
    ``colocate/part-N/`` (N = 2, 3, ...), so no part overwrites another's records. A new run (not resumed)
    starts again at part 1, removing the part folders of the run it replaces.
    """
    first = run_dir / "colocate"
    parts = {int(p.name[5:]): p for p in first.glob("part-*") if re.fullmatch(r"part-\d+", p.name)}
    if not resumed:
        for old in parts.values():
            shutil.rmtree(old, ignore_errors=True)
        return first, 1
    if not (first / "steps.jsonl").exists():
        return first, 1
    part = max(parts, default=1) + 1
    where = first / f"part-{part}"
    log.info("resumed run: its co-location records go to %s (the earlier parts' stay beside it)", where)
    return where, part


def _fmt(d: dict | None, key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v:.1f}"


def run_profile(
    model: str,
    out: str | Path | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    seed: int = 0,
    max_batch: int = 64,
    max_model_len: int = 2048,
    ladder_step: int = 16,
    batches: tuple[int, ...] | None = None,
    kv_lens: tuple[int, ...] | None = None,
    train_batch: int = 4,
    train_seq_len: int = 1024,
    layers_per_microstep: int = 4,
    reps: int | None = None,
) -> dict[str, Any]:
    """Profile ``model``'s decode steps on every SM partition, alone and beside a trainer-shaped workload.

    Stores the profile at ``out`` (default: the cache the co-located run reads, keyed by this machine) and
    returns where it went with the predictor's fit report.
    """
    if out is not None:
        check_destination(out)  # before the weights load and the steps are timed
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    weights = load_model(model, torch_dtype, dev, seed=seed)
    ladder = build_ladder("harli", dev, ladder_step)
    engine = None
    try:
        load = poisson_trace(1.0, 1.0, max_model_len // 2, max_model_len - max_model_len // 2 - 1, seed=seed)
        engine = build_engine(weights, load_tokenizer(model, is_preset(model)), ladder, load, max_batch, seed)
        corun = (
            corun_workload(weights, train_batch, train_seq_len, layers_per_microstep, torch_dtype)
            if dev.type == "cuda"
            else None
        )
        model_id = f"{model}|{torch_dtype}|batch{max_batch}|{ladder.kind}"
        path = (
            Path(out)
            if out is not None
            else default_profile_path(ProfileKey.current(model_id, sm_count=ladder.total_sms))
        )
        predictor, profile = build_predictor(
            engine,
            ladder,
            model_id,
            corun,
            max_batch,
            path,
            reps,
            batches or (GPU_BATCHES if dev.type == "cuda" else CPU_BATCHES),
            kv_lens,
        )
    finally:
        if engine is not None:
            engine.close()  # before the ladder: see Colocation.close
        ladder.close()
    log.info(
        "profile of %s: %d samples on %s -> %s", model, len(profile.samples), profile.key.describe(), path
    )
    return {
        "path": str(path),
        "key": profile.key.describe(),
        "samples": len(profile.samples),
        "shares": profile.shares,
        "fit": predictor.fit_report,
    }
