"""A co-located run over N ranks: rank 0 assembles and drives it, the others follow both of its sides.

Rank 0 runs the single-GPU assembly (``colocate.assembly.assemble``) with a ``TPAssembly``: its trainer and
models are its slices, its engine publishes every forward, its policy's shares are agreed with the other
ranks (``share.AgreedPolicy``), and warm-ups and profiling loads run without collectives. Every other rank
(``follow_colocated``) builds the same engine over its slices (the same recipe, load and ladder) and runs two
loops until rank 0 stops them: the engine's on the main thread (``tp_engine.follow_engine``) and the
trainer's on a thread of its own (``tp_trainer.follow_trainer``): each side has its own control channel and
collective group, so neither waits for the other.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

from harli_train.colocate.engine_adapter import EngineAdapter
from harli_train.colocate.sm import is_cuda_stream
from harli_train.config import RecipeConfig
from harli_train.model import resolve_dtype
from harli_train.parallel.collectives import local_only
from harli_train.parallel.group import TPGroups
from harli_train.parallel.share import AgreedPolicy, ShareAgreement, nccl_sms
from harli_train.parallel.tp_engine import follow_engine, lead_engine, stop_followers
from harli_train.parallel.tp_model import TPLlamaForCausalLM, load_tp_model
from harli_train.parallel.tp_trainer import TPTrainer, follow_trainer

log = logging.getLogger(__name__)


def tp_trainer(cfg: RecipeConfig, tp: TPGroups, quiet: bool = True) -> TPTrainer:
    """A trainer over this rank's slice of the recipe's model (``setup()`` not yet called)."""
    dtype = resolve_dtype(cfg.model.dtype, tp.device)
    model = load_tp_model(cfg.model.name, dtype, tp, seed=cfg.model.seed)
    return TPTrainer(cfg, model, tp, quiet=quiet)


def follower_recipe(cfg: RecipeConfig) -> tuple[RecipeConfig, str]:
    """``cfg`` for a follower's trainer: its records go to a scratch folder (returned) deleted at the end;
    rank 0 writes the run's files."""
    scratch = tempfile.mkdtemp(prefix="harli-tp-rank-")
    out = copy.deepcopy(cfg)
    out.output.dir, out.output.tensorboard, out.output.wandb = scratch, False, None
    out.output.overwrite = True
    return out, scratch


class TPAssembly:
    """Rank 0's hooks into ``assemble`` (see its ``parallel`` argument)."""

    def __init__(self, tp: TPGroups):
        self.tp = tp
        self.channel = None
        self.agreement: ShareAgreement | None = None

    def trainer(self, cfg: RecipeConfig) -> TPTrainer:
        return tp_trainer(cfg, self.tp)

    def load_served(self, source: str, dtype: torch.dtype, device: Any, seed: int = 0) -> TPLlamaForCausalLM:
        return load_tp_model(source, dtype, self.tp, seed=seed, serving=True)

    def lead(self, engine: EngineAdapter) -> None:
        self.channel = lead_engine(engine.engine, self.tp)
        self.agreement = ShareAgreement(self.channel, self.tp.engine_ctl, nccl_sms(self.tp.device))

    def wrap_policy(self, policy: Any) -> AgreedPolicy:
        return AgreedPolicy(policy, self.agreement)

    def local(self) -> contextlib.AbstractContextManager:
        return local_only()

    def local_fn(self, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            with local_only():
                return fn(*args, **kwargs)

        return run

    def stop(self, trainer: TPTrainer) -> None:
        """End the other ranks' loops (after the run: its trainer has finished)."""
        if self.channel is not None:
            stop_followers(self.channel)
        trainer.stop_followers()


def _stream_of(partitions: list[Any], attr: str, sms: int, sms_attr: str) -> Any:
    for p in partitions:
        if getattr(p, sms_attr) == sms and is_cuda_stream(getattr(p, attr)):
            return getattr(p, attr)
    return None


def follow_colocated(cfg: RecipeConfig, serve_model: str, tp: TPGroups) -> dict[str, int]:
    """Rank > 0 of a co-located run; returns how many engine steps and trainer micro-steps it ran."""
    from harli_train.colocate.assembly import build_engine, build_ladder, load_requests, same_model
    from harli_train.colocate.shared_model import base_view

    col = cfg.colocation
    cfg, scratch = follower_recipe(cfg)
    ladder = None
    try:
        trainer = tp_trainer(cfg, tp)
        trainer.setup()
        dtype = resolve_dtype(cfg.model.dtype, tp.device)
        if same_model(serve_model, cfg.model.name):
            served = base_view(trainer.model)
        else:
            served = load_tp_model(serve_model, dtype, tp, seed=cfg.model.seed, serving=True)
        ladder = build_ladder(col.policy, tp.device, col.ladder_step)
        requests = load_requests(col, seed=cfg.train.seed, device=tp.device.type)
        engine = build_engine(
            served,
            None,
            ladder,
            requests,
            col.max_batch,
            seed=cfg.train.seed,
            mixed_prefill=col.mixed_prefill,
        )
        parts = list(ladder.partitions) + [ladder.full]
        failure: list[BaseException] = []

        def train_loop() -> None:
            try:
                counts["micro_steps"] = follow_trainer(
                    trainer, lambda sms: _stream_of(parts, "train_stream", sms, "train_sms")
                )
            except BaseException as err:  # the engine loop's caller reports it
                failure.append(err)
                log.error("rank %d: the trainer failed: %s", tp.rank, err)

        counts = {"micro_steps": 0}
        thread = threading.Thread(target=train_loop, name=f"tp-trainer-{tp.rank}", daemon=True)
        thread.start()
        counts["engine_steps"] = follow_engine(
            engine.engine,
            tp,
            lambda key, sms: _stream_of(parts, "infer_stream", sms, "infer_sms"),
            ShareAgreement(None, tp.engine_ctl, nccl_sms(tp.device)),
        )
        thread.join()
        engine.close()
        if failure:
            raise failure[0]
        return counts
    finally:
        if ladder is not None:
            ladder.close()
        shutil.rmtree(scratch, ignore_errors=True)
