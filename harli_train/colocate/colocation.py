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
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from harli_train import kernels
from harli_train.colocate.engine_adapter import EngineAdapter
from harli_train.colocate.live_adapter import LiveAdapter
from harli_train.colocate.memory_hook import CacheReleaseHook
from harli_train.colocate.policy import Policy, make_policy
from harli_train.colocate.pool_memory import PoolMemory
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.profile import Profile
from harli_train.colocate.runtime import ColocatedRuntime
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.sm import Partition, SMLadder
from harli_train.config import RecipeConfig
from harli_train.engine.adapters import AdapterCatalog
from harli_train.engine.load import TraceRequest
from harli_train.train.adapter_update import AdapterUpdate
from harli_train.train.shape_graphs import GraphCaptureError
from harli_train.train.step import MicroStep, train_step
from harli_train.train.trainer import Trainer
from harli_train.train.trainer_state import rng_state, set_rng_state

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
        records under ``out_dir``; ``run()`` it once. A live adapter serves ``trainer``'s adapter. Options that
        leave ``launch_ahead`` unset take the recipe's ``colocation.launch_ahead``."""
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


def warm_up_trainer(
    trainer: Trainer,
    partitions: list[Partition],
    total_sms: int,
    release: bool = True,
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> set[int]:
    """Compile the trainer's kernels for every SM budget it may get (a synthetic step each; no state kept).

    Returns the budgets where the step failed (seen on the H200: cuBLAS cannot run its GEMMs on the 12-SM
    leftover of an 8-SM ladder); the caller retires those rungs. Running out of memory is not such a failure.

    Each step leaves a step's working set in torch's cache for its stream alone (a freed block is handed out
    again only on the stream that allocated it; ~19 GiB for Llama-3-8B at batch 4 x 1024). ``release=False``
    keeps it, for ``partitions`` that are exactly the streams the trainer will use: serving then starts with
    their caches warm, where a cold cache makes the trainer call cudaMalloc while decode serves. Otherwise the
    cache is emptied: more streams than fit beside the served model would run the GPU short of memory, and the
    allocator's retry frees every cached block with a device-wide sync (the decode loop held for up to 266 ms on
    the H200). ``scope()`` is entered around each step, as the feeder enters it around each micro-step (the
    page pool's, so that the caches warmed are those the run allocates from); the chunks' saved tensors go
    where the run's go (``trainer.stash_chunk``: the pool's stashes), so a stream's cache holds only what
    the run allocates from it.
    """
    if trainer.device.type != "cuda":
        return set()
    batch = synthetic_batch(trainer)
    saved = rng_state()
    places = {p.train_sms: p.train_stream for p in partitions if p.train_sms > 0}
    places.setdefault(total_sms, partitions[-1].train_stream)

    def step(sms: int) -> None:
        try:
            run_step(sms)
        except GraphCaptureError as err:  # train on without graphs: this budget's step again, eagerly
            trainer.drop_graphs(err)
            run_step(sms)

    def run_step(sms: int) -> None:
        with torch.cuda.stream(places[sms]), kernels.sm_budget(sms), scope():
            for _ in synthetic_step(trainer, batch):  # with graphs: captures this budget's set
                pass
            warm_step_end(trainer)
        torch.cuda.synchronize()
        if release and trainer.step_graphs is not None:
            # The capture's eager pass cached a working set for this stream alone: give it back before the
            # next budget's (the graphs keep theirs in their own pool).
            torch.cuda.empty_cache()

    try:
        failed = try_budgets(sorted(places), step, keep=total_sms)
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        set_rng_state(saved)
        torch.cuda.synchronize()
        if release:
            torch.cuda.empty_cache()
    log.info("trainer kernels warmed up for SM budgets %s", sorted(set(places) - failed))
    return failed


def synthetic_batch(trainer: Trainer) -> dict[str, Any]:
    """A seeded micro-batch of the recipe's shape (batch size x sequence length) on the CPU, packed like the
    run's when the recipe packs (the block-diagonal attention and its mask's memory included)."""
    cfg, model = trainer.cfg, trainer.model
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(
        0, min(model.config.vocab_size, 256), (cfg.train.batch_size, cfg.data.seq_len), generator=gen
    )
    batch = {"input_ids": ids, "labels": ids.clone(), "num_target_tokens": ids.shape[0] * (ids.shape[1] - 1)}
    batch["positions"] = torch.arange(ids.shape[1]).expand_as(ids).clone()
    if cfg.data.packing:
        batch["doc_ids"] = torch.zeros_like(ids)
    return batch


def synthetic_step(trainer: Trainer, batch: dict[str, Any]) -> Generator[MicroStep, None, Any]:
    """The micro-steps of one step over ``batch`` as the run makes them (its chunking, autocast, batch
    buffers, activation stashes and graphs), on the current stream; its gradients stay in the adapter."""
    return train_step(
        trainer.model,
        [batch],
        trainer.cfg.train.layers_per_microstep,
        trainer._autocast,
        buffers=trainer.buffers if trainer.step_graphs is not None else None,
        stash=trainer.eager_stash,
        graphs=trainer.step_graphs,
    )


def time_micro_steps(
    trainer: Trainer,
    stream: Any,
    sms: int,
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, float]:
    """Seconds each kind of micro-step of one synthetic step takes on ``stream`` with ``sms`` SMs (the
    median over the step's micro-steps of that kind; ``next``, the step boundary's launch, as ``fwd``),
    its kernels already loaded (``warm_up_trainer``). Nothing of the trainer's state is kept. Empty on a
    CPU."""
    if trainer.device.type != "cuda":
        return {}
    saved = rng_state()
    marks: list[tuple[str, Any, Any]] = []
    try:
        with torch.cuda.stream(stream), kernels.sm_budget(sms), scope():
            steps = synthetic_step(trainer, synthetic_batch(trainer))
            while True:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                try:
                    ms = next(steps)
                except StopIteration:
                    break
                end.record(stream)
                marks.append((ms.phase, start, end))
        torch.cuda.synchronize()
    finally:
        trainer.optimizer.zero_grad(set_to_none=True)
        set_rng_state(saved)
    by_kind: dict[str, list[float]] = {}
    for phase, start, end in marks:
        by_kind.setdefault(phase, []).append(start.elapsed_time(end) * 1e-3)
    out = {kind: sorted(v)[len(v) // 2] for kind, v in by_kind.items()}
    if "fwd" in out:
        out["next"] = out["fwd"]
    log.info(
        "the trainer's micro-steps on %d SMs: %s",
        sms,
        ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(out.items())),
    )
    return out


def warm_step_end(trainer: Trainer) -> None:
    """Run, on the current stream, the kernels that end a step: the gradients' clip and a fused AdamW
    update, as the trainer's `update_adapter` launches them, over one scratch element per adapter tensor
    (the trainer's gradients and optimizer state are not touched). The count matters, the sizes do not: the
    stack of the per-tensor norms and the norm over them pick their kernels by the number of tensors. CUDA
    loads a kernel on its first launch in a context, and a load may synchronize the context: loaded while
    decode serves, it holds decode's step up."""
    master = trainer.params[0]
    scratch = [
        torch.zeros(1, dtype=master.dtype, device=master.device, requires_grad=True) for _ in trainer.params
    ]
    for p in scratch:
        p.grad = torch.zeros_like(p)
    group = trainer.optimizer.param_groups[0]
    optimizer = torch.optim.AdamW(
        scratch, lr=group["lr"], betas=group["betas"], eps=group["eps"], fused=bool(group.get("fused"))
    )
    optimizer.step()
    if trainer.updates_lean(optimizer):
        AdapterUpdate(optimizer, None)(group["lr"])
    else:
        trainer.clip_gradients(float("inf"))


def try_budgets(budgets: list[int], run: Callable[[int], None], keep: int) -> set[int]:
    """Run ``run(sms)`` for each budget; the budgets whose run raised a (non-OOM) runtime error, logged.
    ``keep`` (the whole GPU) must work: its error is re-raised."""
    failed = set()
    for sms in budgets:
        try:
            run(sms)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as err:
            if sms == keep:
                raise
            failed.add(sms)
            log.warning(
                "the trainer's kernels fail on %d SMs (%s): that rung is retired",
                sms,
                str(err).splitlines()[0][:160],
            )
    return failed
