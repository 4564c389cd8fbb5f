"""One co-located set-up: the shared weights, the SM ladder, the decode engine and the latency predictor.

``assemble`` builds it once; runs are then made on it one at a time: a policy (``new_policy``) and a trainer
(``new_trainer``) for each, readied together (``prepare``) and driven by a ``ColocatedRuntime`` (``runtime``).
The command line makes one such run (the recipe's policy and trainer); the co-location benchmark makes many.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harli_train.colocate.engine_adapter import EngineAdapter
from harli_train.colocate.live_adapter import LiveAdapter
from harli_train.colocate.memory_hook import CacheReleaseHook
from harli_train.colocate.policy import Policy, make_policy
from harli_train.colocate.pool_memory import PoolMemory
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.profile import Profile
from harli_train.colocate.runtime import ColocatedRuntime
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.sm import SMLadder
from harli_train.colocate.trainer_warmup import time_micro_steps, warm_up_trainer
from harli_train.config import RecipeConfig
from harli_train.engine.adapters import AdapterCatalog
from harli_train.engine.load import TraceRequest
from harli_train.train.trainer import Trainer

log = logging.getLogger(__name__)


class Colocation:
    """What every run on one GPU shares, and the recipe's own run.

    ``trainer`` is the current trainer (the recipe's until ``new_trainer`` replaces it); ``policy`` the
    recipe's policy once ``assemble`` has made (and prepared) it; ``requests`` the recipe's load; ``profile``
    the decode profile the predictor was fitted to (None without one); ``memory`` the page pool that the KV
    cache and the trainer share (None: a fixed KV tensor and torch's allocator). Runs share the engine, so
    they happen one after the other, never at once.
    """

    def __init__(
        self,
        cfg: RecipeConfig,
        trainer: Trainer,
        engine: EngineAdapter,
        ladder: SMLadder,
        requests: list[TraceRequest],
        predictor: LatencyPredictor | None = None,
        profile: Profile | None = None,
        info: dict[str, Any] | None = None,
        catalog: AdapterCatalog | None = None,
        live: LiveAdapter | None = None,
        memory: PoolMemory | None = None,
        parallel: Any = None,
    ) -> None:
        self.cfg, self.trainer, self.engine, self.ladder = cfg, trainer, engine, ladder
        self.catalog, self.live = catalog, live  # the served model ids; the trainer's adapter served live
        self._live_for = trainer  # the trainer whose adapter the live one serves
        self.parallel = parallel  # a tensor-parallel rank's hooks (assemble's ``parallel``), or None
        self.requests, self.predictor, self.profile = requests, predictor, profile
        self.info: dict[str, Any] = dict(info or {})
        self.memory = memory
        self.policy: Policy | None = None
        # What one trainer stream caches (measured at the first prepare).
        self._stream_bytes: int | None = None
        self._step_extra_bytes = 0  # what a step holds beyond that (its saved tensors)
        # Each kind of micro-step's duration on the whole GPU (measured at the first prepare): the trainer
        # side's estimates before its own, so that time slicing can size its first launches.
        self.micro_step_s: dict[str, float] = {}

    @property
    def tpot_s(self) -> float:
        """The recipe's objective (``colocation.tpot_ms``), in seconds."""
        return self.cfg.colocation.tpot_ms * 1e-3

    def new_policy(self, name: str | None = None, tpot_s: float | None = None) -> Policy:
        """A fresh policy ``name`` (default: the recipe's) over the ladder's rungs as they are now, held to
        ``tpot_s`` (default: the recipe's objective) with the recipe's margin. The predictor's online
        corrections start again from the profile's fit: what an earlier run learnt does not carry over.
        ValueError when this ladder cannot run the policy."""
        if self.predictor is not None:
            self.predictor.reset_corrections()
        col = self.cfg.colocation
        policy = make_policy(
            name or col.policy, self.ladder, self.predictor, tpot_s or self.tpot_s, col.margin
        )
        policy.ttft_s = None if col.ttft_ms is None else col.ttft_ms * 1e-3
        return policy if self.parallel is None else self.parallel.wrap_policy(policy)

    def new_trainer(self, out_dir: str | Path) -> Trainer:
        """A fresh adapter and optimizer on the shared weights, as the recipe says, writing to ``out_dir``
        (which must not hold another run); it becomes ``trainer``. Costs the trainer's set-up (its data,
        the adapter's initialisation, the optimizer's state), not a load of the weights."""
        cfg = copy.deepcopy(self.cfg)
        cfg.output.dir = str(out_dir)
        # The replaced trainer's graphs go first, whatever still refers to it: their pools and arena are
        # as large as a working set, and the new trainer captures its own.
        self.trainer.release_graphs()
        trainer = Trainer(cfg, model=self.trainer.model, quiet=True)
        trainer.setup()
        self.trainer.metrics.close()  # the replaced trainer's log, if it never ran
        self.trainer = trainer
        if self.memory is not None:
            self.memory.attach(trainer)  # the replaced trainer's placed state goes back to it
        return trainer

    def prepare(self, policy: Policy) -> Policy:
        """Ready ``policy`` to run with ``trainer``: torch's cached memory is released (a block cached for
        another policy's streams is of no use to this one's), then the trainer's kernels are compiled and
        its streams' caches warmed for every SM budget the policy gives it (a synthetic step each, caches
        kept for serving). A rung on which the trainer's kernels fail is retired from the ladder and the
        policy is made again on the rungs left, so the policy returned may be another object than
        ``policy``. The first prepare also times each kind of micro-step on the whole GPU
        (``micro_step_s``). Nothing to do on a CPU."""
        if self.trainer.device.type != "cuda":
            return policy
        torch.cuda.empty_cache()
        while True:
            scope = self.memory.trainer_scope if self.memory is not None else contextlib.nullcontext
            # Under tensor parallelism each rank warms its own kernels: no collective runs.
            local = contextlib.nullcontext() if self.parallel is None else self.parallel.local()
            with local:
                self._fit_trainer_streams(policy, scope)
                places = policy.trainer_partitions() + [self.ladder.full]
                failed = warm_up_trainer(
                    self.trainer, places, self.ladder.total_sms, release=self._release, scope=scope
                )
            if not self.ladder.retire(failed):
                if not self.micro_step_s:
                    with contextlib.nullcontext() if self.parallel is None else self.parallel.local():
                        self.micro_step_s = time_micro_steps(
                            self.trainer, self.ladder.full.train_stream, self.ladder.total_sms, scope
                        )
                    if self._release:
                        torch.cuda.empty_cache()
                return policy
            torch.cuda.empty_cache()
            policy = self.new_policy(policy.name, policy.tpot_s)  # its trainer streams are warmed in turn

    @property
    def _release(self) -> bool:
        """Whether a warm-up gives its cached memory back: with graphs a stream needs no warm cache (the
        graphs' memory is allocated at capture, one pool for every stream)."""
        return self.trainer.step_graphs is not None

    def _fit_trainer_streams(self, policy: Policy, scope: Callable) -> None:
        """Warm the whole GPU's trainer stream and one of ``policy``'s rungs, measure what the rung's stream
        added (its own cache) and what its step held beyond that (saved tensors freed by backward), and have
        ``policy`` launch on no more rungs than the memory left beside the KV cache the load wants holds: each
        stream keeps its own copy of the working set (torch's cache, and the page pool's MemPool, never hand
        one stream's freed blocks to another), and a stream warmed past the memory runs set-up or the run out
        of it. The second stream is the one measured: the first also maps what every stream shares (the
        pool's stashes of saved tensors, the optimizer's state), which is not paid again per stream. It is the
        rung with the fewest trainer SMs, which ``limit_trainer_streams`` always keeps: a dropped rung's warm
        cache would stay held by a stream nothing launches on."""
        hook = self.memory if self.memory is not None else CacheReleaseHook()
        full = self.ladder.full
        rungs = [p for p in policy.trainer_partitions() if p.infer_sms < full.infer_sms]
        warmed = 0
        if self._stream_bytes is None:  # the first warm-up of this trainer's shapes
            before, peak_before = hook.trainer_bytes(), hook.trainer_peak_bytes()
            warm_up_trainer(self.trainer, [full], self.ladder.total_sms, release=self._release, scope=scope)
            if rungs:  # now that the shared state is in: what one more stream and its step take
                before, peak_before = hook.trainer_bytes(), hook.trainer_peak_bytes()
                warm_up_trainer(
                    self.trainer, [rungs[-1]], self.ladder.total_sms, release=self._release, scope=scope
                )
                warmed = 1
            after, peak = hook.trainer_bytes(), hook.trainer_peak_bytes()
            self._stream_bytes = after - before
            # A peak the step did not raise is an older one: it says nothing of the step.
            self._step_extra_bytes = max(peak - after, 0) if peak > peak_before else 0
        per_stream = self._stream_bytes
        if per_stream <= 0:
            return
        room = max(hook.trainer_room_bytes() - self._step_extra_bytes, 0)
        count = warmed + int(room // per_stream)
        wanted = len(policy.trainer_partitions()) - 1  # the whole GPU's stream is warmed already
        if policy.limit_trainer_streams(count):
            log.warning(
                "the trainer's working set (%.1f GiB a stream, %.1f GiB more during a step) fits %d "
                "streams beside the whole GPU's in the memory left beside the KV cache (%.1f GiB): %s "
                "launches on %d of its %d trainer rungs",
                per_stream / 2**30,
                self._step_extra_bytes / 2**30,
                count,
                room / 2**30,
                policy.name,
                len(policy.trainer_partitions()) - 1,
                wanted,
            )
        else:
            log.info(
                "the trainer's working set: %.1f GiB a stream, %.1f GiB more during a step; %d rungs fit "
                "in the %.1f GiB left beside the KV cache",
                per_stream / 2**30,
                self._step_extra_bytes / 2**30,
                count,
                room / 2**30,
            )

    def runtime(
        self,
        policy: Policy,
        requests: list[TraceRequest],
        out_dir: str | Path,
        options: RuntimeOptions | None = None,
        trainer: Trainer | None = None,
    ) -> ColocatedRuntime:
        """A run of ``policy`` serving ``requests`` beside ``trainer`` (default: ``self.trainer``), its
        records under ``out_dir``; ``run()`` it once. A live adapter serves ``trainer``'s adapter. Options
        that leave ``launch_ahead`` unset take the recipe's ``colocation.launch_ahead``."""
        trainer = trainer or self.trainer
        options = options or RuntimeOptions()
        if options.launch_ahead is None:
            options = dataclasses.replace(options, launch_ahead=self.cfg.colocation.launch_ahead)
        if self.live is not None and trainer is not self._live_for:
            self.live.follow(trainer.model, trainer.step)
            self._live_for = trainer
        return ColocatedRuntime(
            trainer,
            self.engine,
            policy,
            requests,
            out_dir,
            options,
            self.memory,
            self.info,
            live=self.live,
            micro_step_s=self.micro_step_s,
        )

    def close(self) -> None:
        """Release everything that ran on the ladder's streams, then the ladder itself.

        The engine's pinned staging buffers were copied on green-context streams; torch's pinned-memory
        allocator records an event on each such stream when a buffer is freed, so the buffers must be freed
        while the contexts exist (freed later, the process aborts with 'context is destroyed'). The ladder
        is therefore the last thing to go. Idempotent.
        """
        self.engine.close()
        if self.memory is not None:
            self.memory.close()
        self.ladder.close()
