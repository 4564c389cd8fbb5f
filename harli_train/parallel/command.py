"""`--tensor-parallel N`: the command starts its N ranks (or joins torchrun's) and runs one job on them.

Jobs: ``train`` (the trainer alone), ``colocate`` (``RECIPE --colocate-with MODEL``) and ``serve``
(``serve --model MODEL``). Rank 0 does what the single-GPU command does over its slices and returns its
summary; the other ranks follow it. Spawned ranks report to the parent through one JSON file each in a
scratch folder: rank 0's summary, or a rank's error (its message and class), which the parent raises as
``TensorParallelError`` so that the command line prints one line with the exit code that error has on one
GPU. A rank that dies makes the others be terminated (torch.multiprocessing), and the parent names it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from harli_train.parallel.group import TPGroups, close_groups, from_env, spawn, under_torchrun

log = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A rank failed: ``error_class`` is its error's class (None: the rank died without one)."""

    def __init__(self, message: str, error_class: type[BaseException] | None = None):
        super().__init__(message)
        self.error_class = error_class


def serving_engine(source: str, config: Any, tp: TPGroups, seed: int = 0, tokenizer: bool = True):
    """This rank's engine over its slice of ``source``: ``config`` with no step launched ahead, the
    bandwidth GEMV path off (it fuses o/down with the next norm, where an all-reduce must come between),
    and the KV blocks every rank can hold."""
    from harli_train.data.tokenizer import load_tokenizer
    from harli_train.engine import DecodeEngine
    from harli_train.model import is_preset, resolve_dtype
    from harli_train.parallel.tp_engine import agreed_kv_blocks
    from harli_train.parallel.tp_model import load_tp_model

    model = load_tp_model(source, resolve_dtype("auto", tp.device), tp, seed=seed, serving=True)
    cfg = dataclasses.replace(config, overlap=False, decode_gemv=False)
    if cfg.num_kv_blocks is None:
        cfg.num_kv_blocks = agreed_kv_blocks(model, cfg, tp)
    tok = load_tokenizer(source, is_preset(source)) if tokenizer else None
    return DecodeEngine(model, cfg, tokenizer=tok)


def _train(tp: TPGroups, args: dict[str, Any]) -> dict[str, Any] | None:
    from harli_train.parallel.colocated import follower_recipe, tp_trainer
    from harli_train.parallel.tp_trainer import follow_trainer

    if tp.is_leader:
        trainer = tp_trainer(args["cfg"], tp, quiet=args.get("quiet", False))
        trainer.setup()
        try:
            return trainer.train()
        finally:
            trainer.stop_followers()
    cfg, scratch = follower_recipe(args["cfg"])
    try:
        trainer = tp_trainer(cfg, tp)
        trainer.setup()
        follow_trainer(trainer)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return None


def _colocate(tp: TPGroups, args: dict[str, Any]) -> dict[str, Any] | None:
    from harli_train.colocate.commands import run_colocated
    from harli_train.parallel.colocated import TPAssembly, follow_colocated

    cfg, model = args["cfg"], args["serve_model"]
    if not tp.is_leader:
        follow_colocated(cfg, model, tp)
        return None
    hooks = TPAssembly(tp)
    made: list[Any] = []
    make = hooks.trainer
    hooks.trainer = lambda c: made.append(make(c)) or made[-1]
    try:
        summary = run_colocated(cfg, model, parallel=hooks, **args.get("options", {}))
    finally:
        if made:
            hooks.stop(made[-1])
    summary["tensor_parallel"] = {
        "ranks": tp.world,
        "backend": tp.backend,
        "shares_raised": hooks.agreement.raised,
    }
    return summary


def _serve(tp: TPGroups, args: dict[str, Any]) -> dict[str, Any] | None:
    from harli_train.engine import EngineConfig
    from harli_train.engine.engine_config import gib_bytes
    from harli_train.model import model_config
    from harli_train.parallel.tp_engine import follow_engine, lead_engine, stop_followers
    from harli_train.serve.command import run_server

    model = args["model"]
    if not tp.is_leader:
        context = model_config(model).max_position_embeddings
        cfg = EngineConfig(
            max_num_seqs=args["max_batch"],
            max_model_len=context,
            kv_cache_bytes=gib_bytes(args["kv_cache_gib"]),
        )
        engine = serving_engine(model, cfg, tp, tokenizer=False)
        follow_engine(engine, tp)
        engine.close()
        return None
    channel = []

    def build(cfg: Any):
        engine = serving_engine(model, cfg, tp)
        channel.append(lead_engine(engine, tp))
        return engine

    try:
        return run_server(**{k: v for k, v in args.items()}, build=build)
    finally:
        if channel:
            stop_followers(channel[0])


JOBS = {"train": _train, "colocate": _colocate, "serve": _serve}


def _rank_main(tp: TPGroups, job: str, args: dict[str, Any], results: str, verbose: bool) -> None:
    """One spawned rank: its job, its result or error in ``results``/rank-R.json; a failure exits 1."""
    level = logging.DEBUG if verbose else logging.INFO if tp.is_leader else logging.WARNING
    logging.basicConfig(level=level, format=f"harli-train[rank {tp.rank}]: %(message)s", stream=sys.stderr)
    if not tp.is_leader:
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the job stops
            signal.signal(sig, signal.SIG_IGN)
    if tp.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp.world))
    out = Path(results) / f"rank-{tp.rank}.json"
    try:
        result = JOBS[job](tp, args)
    except BaseException as err:
        log.debug("rank %d failed", tp.rank, exc_info=True)
        cls = type(err)
        out.write_text(
            json.dumps(
                {"error": str(err) or cls.__name__, "module": cls.__module__, "class": cls.__qualname__}
            )
        )
        raise SystemExit(1) from None
    if tp.is_leader:
        out.write_text(json.dumps({"summary": result}, default=str))


def _error_class(record: dict[str, Any]) -> type[BaseException] | None:
    try:
        cls = getattr(importlib.import_module(record["module"]), record["class"])
    except (ImportError, AttributeError, KeyError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def _read_failure(results: Path, died: str) -> TensorParallelError:
    records = sorted(results.glob("rank-*.json"), key=lambda p: p.stat().st_mtime)
    for path in records:
        record = json.loads(path.read_text())
        if "error" in record:
            rank = path.stem.split("-")[1]
            message = record["error"] if rank == "0" else f"rank {rank}: {record['error']}"
            return TensorParallelError(message, _error_class(record))
    return TensorParallelError(f"tensor parallelism: {died}")


def run_tensor_parallel(job: str, world: int, args: dict[str, Any], on_gpu: bool, verbose: bool = False):
    """Run ``job`` on ``world`` ranks; rank 0's summary (None on the other ranks under torchrun).
    TensorParallelError when a rank fails."""
    from harli_train.parallel.share import limit_nccl_ctas

    if on_gpu:
        limit_nccl_ctas()
    if under_torchrun():
        tp = from_env(on_gpu)
        if tp.world != world:
            raise TensorParallelError(f"--tensor-parallel {world}, but torchrun started {tp.world} ranks")
        try:
            return JOBS[job](tp, args)
        finally:
            close_groups()
    from torch.multiprocessing.spawn import ProcessException

    results = Path(tempfile.mkdtemp(prefix="harli-tp-"))
    try:
        try:
            spawn(_rank_main, world, on_gpu, (job, args, str(results), verbose))
        except ProcessException as err:
            raise _read_failure(results, str(err).strip().splitlines()[-1]) from None
        return json.loads((results / "rank-0.json").read_text())["summary"]
    finally:
        shutil.rmtree(results, ignore_errors=True)
