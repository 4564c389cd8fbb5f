"""Getting the trainer ready to run beside decode: its kernels compiled (and, with graphs, its micro-steps
captured) for every SM budget it may get, each kind of micro-step timed, on a seeded synthetic batch of the
recipe's shape, with none of the trainer's state kept."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator
from typing import Any

import torch

from harli_train import kernels
from harli_train.colocate.sm import Partition
from harli_train.train.adapter_update import AdapterUpdate
from harli_train.train.shape_graphs import GraphCaptureError
from harli_train.train.step import MicroStep, train_step
from harli_train.train.trainer import Trainer
from harli_train.train.trainer_state import rng_state, set_rng_state

log = logging.getLogger(__name__)


def warm_up_trainer(
    trainer: Trainer,
    partitions: list[Partition],
    total_sms: int,
    release: bool = True,
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> set[int]:
    """Compile the trainer's kernels for every SM budget it may get (a synthetic step each; no state kept).

    Returns the budgets where the step failed (cuBLAS may not run its GEMMs on a ladder's small leftover
    share); the caller retires those rungs. Running out of memory is not such a failure.

    Each step leaves a step's working set in torch's cache for its stream alone (a freed block is handed out
    again only on the stream that allocated it; ~19 GiB for Llama-3-8B at batch 4 x 1024). ``release=False``
    keeps it, for ``partitions`` that are exactly the streams the trainer will use: serving then starts with
    their caches warm, where a cold cache makes the trainer call cudaMalloc while decode serves. Otherwise the
    cache is emptied: more streams than fit beside the served model would run the GPU short of memory, and the
    allocator's retry frees every cached block with a device-wide sync, which holds the decode loop.
    ``scope()`` is entered around each step, as the feeder enters it around each micro-step (the
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
        trainer.autocast,
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
