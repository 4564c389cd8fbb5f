"""Timing the profile grid: decode and mixed steps per SM share, alone and beside trainer work.

``run_profile_grid`` times real engine steps (the median of repeated launches after a warm-up: CUDA events
on a GPU stream, the host clock on the CPU stand-in) over batch size, KV length and share, and mixed steps
over a ``MixedGrid``; ``build_profile`` wraps the samples as a ``Profile`` with their provenance, and
``add_adapter_steps`` adds the steps on adapters to a profile made without them. How one point is timed,
alone or beside the trainer's work, is ``step_timing``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from harli_train.colocate.mixed_model import attention_pairs
from harli_train.colocate.profile import Profile, ProfileKey
from harli_train.colocate.sm import SMLadder
from harli_train.colocate.step_timing import CorunFn, DecodeStepFn, median, time_beside, time_calls
from harli_train.engine.decode_linear import FMA_MIN_SMS

log = logging.getLogger(__name__)

DEFAULT_BATCHES = (1, 8, 32, 64, 128)
DEFAULT_KV_LENS = (512, 1024, 2048)


@dataclass(frozen=True, slots=True)
class MixedGrid:
    """Mixed steps to time per share: ``batches`` decode rows over ``kv_len`` tokens each, beside one prefill
    chunk of each of ``tokens`` after each of ``contexts`` cached tokens; beside the trainer too for the
    ``corun_batches`` (the slowdown is one factor per share: a few points pin it). Each point is timed
    ``reps`` times after ``warmup`` (a mixed step is long and steady)."""

    # Decode rows and chunks whose sums fill the mixed graphs' small buckets (16, 32, 64 tokens: 2 + 14,
    # 2 + 30, 2 + 62, 32 + 30) as well as the larger ones, where the projections turn compute-bound.
    batches: tuple[int, ...] = (2, 8, 32)
    kv_len: int = 512
    tokens: tuple[int, ...] = (14, 30, 62, 192, 512)
    contexts: tuple[int, ...] = (0, 768)
    corun_batches: tuple[int, ...] = (32,)
    warmup: int = 2
    reps: int = 5

    def points(self) -> list[tuple[int, int, int]]:
        return [(b, n, c) for b in self.batches for n in self.tokens for c in self.contexts]

    def adapter_points(self) -> list[tuple[int, int, int]]:
        """The points timed again on adapters (``MixedLoRACost``): the middle batch's chunks of every size
        after the first context, so the adapters' cost is seen at every token bucket the chunks fill."""
        b = self.batches[len(self.batches) // 2]
        return [(b, n, self.contexts[0]) for n in self.tokens]


# (batch, kv_len, prefill tokens, prefill context, partition[, adapters]): enqueue one mixed step
MixedStepFn = Callable[..., Any]


def run_profile_grid(
    decode_step_fn: DecodeStepFn,
    corun_fn: CorunFn | None,
    ladder: SMLadder,
    batches: Sequence[int] = DEFAULT_BATCHES,
    kv_lens: Sequence[int] = DEFAULT_KV_LENS,
    shares: Iterable[int] | None = None,
    warmup: int = 3,
    reps: int = 10,
    mixed_step_fn: MixedStepFn | None = None,
    mixed_grid: MixedGrid | None = None,
    lora_slots: Sequence[int] = (),
    corun_reps: int | None = None,
) -> list[dict[str, Any]]:
    """Median latency of decode steps per (partition, batch, kv_len), and of mixed steps per (partition,
    ``mixed_grid`` point) when ``mixed_step_fn`` is given, alone and beside the trainer. With ``lora_slots``
    (adapter counts, e.g. (1, 2)): decode steps of the middle batch at the shortest KV length whose rows run
    on that many adapters, alone (``decode_step_fn(b, kv, partition, n)``), for ``LoRACost``; and, with
    mixed steps, the grid's ``adapter_points`` with every row on one adapter, alone
    (``mixed_step_fn(b, kv, n, c, partition, 1)``), for ``MixedLoRACost``. A decode point beside the
    trainer is the median of ``corun_reps`` steps (default ``reps``): what the trainer's kernels draw beside
    decode varies from step to step, more than a step alone does.

    ``decode_step_fn`` and ``mixed_step_fn`` must launch on ``partition.infer_stream`` and ``corun_fn`` on
    ``train_stream``
    (GPU: both asynchronously; timed with CUDA events). On the CPU stand-in the calls run synchronously,
    are timed with ``perf_counter`` and the trainer loops in a thread.
    """
    wanted = None if shares is None else set(shares)
    parts = [p for p in ladder.partitions if wanted is None or p.infer_sms in wanted]
    samples = []
    for p in parts:
        dry = dry_retimed = 0
        corun = corun_fn is not None and p.train_sms > 0 and not p.time_sliced
        t_train = median(time_calls(lambda p=p: corun_fn(p), p.train_stream, warmup, reps)) if corun else None
        # (batch, kv_len, chunk or None, timing reps, warm-up, beside the trainer too)
        points: list[tuple] = [(b, kv, None, reps, warmup, corun) for b in batches for kv in kv_lens]
        b_lora = list(batches)[len(batches) // 2]
        points += [(b_lora, min(kv_lens), ("lora", n), reps, warmup, False) for n in lora_slots if n > 0]
        if mixed_step_fn is not None:
            g = mixed_grid or MixedGrid()
            points += [
                (b, g.kv_len, (n, c), g.reps, g.warmup, corun and b in g.corun_batches)
                for b, n, c in g.points()
            ]
            if any(n > 0 for n in lora_slots):
                points += [
                    (b, g.kv_len, (n, c, 1), g.reps, g.warmup, False) for b, n, c in g.adapter_points()
                ]
        for b, kv, chunk, n_reps, n_warm, beside in points:
            base = {
                "batch": b,
                "kv_len": kv,
                "kv_tokens": b * kv,
                "infer_sms": p.infer_sms,
                "train_sms": p.train_sms,
            }
            if chunk is None:
                step = lambda b=b, kv=kv, p=p: decode_step_fn(b, kv, p)
            elif chunk[0] == "lora":
                step = lambda b=b, kv=kv, p=p, n=chunk[1]: decode_step_fn(b, kv, p, n)
                base["lora_slots"] = chunk[1]
            else:
                n, c, *adapters = chunk  # (tokens, context[, adapters])
                step = lambda b=b, kv=kv, n=n, c=c, p=p, a=tuple(adapters): mixed_step_fn(b, kv, n, c, p, *a)
                if adapters:
                    base["lora_slots"] = adapters[0]
                base.update(prefill_tokens=n, prefill_context=c, attn_pairs=attention_pairs([(n, c)]))
            t_solo = median(time_calls(step, p.infer_stream, n_warm, n_reps))
            samples.append({**base, "corun": False, "latency_s": t_solo})
            if beside:
                n_co = (corun_reps or n_reps) if chunk is None else n_reps  # a mixed point: its grid's
                t_co, covered, retimed = time_beside(step, corun_fn, p, n_warm, n_co, t_solo, t_train)
                sample = {**base, "corun": True, "latency_s": t_co, "train_step_s": t_train}
                if covered is not None:
                    sample.update(corun_covered=covered, corun_retimed=retimed)
                    dry += not covered
                    dry_retimed += retimed and not covered
                samples.append(sample)
        log.info("profiled %d/%d SMs: %d samples so far", p.infer_sms, p.train_sms, len(samples))
        if dry:
            log.warning(
                "profile: at %d decode SMs the trainer's queue ended before the decode steps at %d point(s) "
                "(%d of them timed again with a longer queue): those points are partly decode alone "
                "(corun_covered false)",
                p.infer_sms,
                dry,
                dry_retimed,
            )
    return samples


def build_profile(
    key: ProfileKey,
    decode_step_fn: DecodeStepFn,
    corun_fn: CorunFn | None,
    ladder: SMLadder,
    kv_bytes_per_token: float,
    mixed_buckets: tuple[int, ...] = (),
    corun_workload: str | None = None,
    **grid: Any,
) -> Profile:
    """Run the grid and wrap it with what the predictor needs (``kv_bytes_per_token``, ``mixed_buckets``: the
    token buckets the engine padded the mixed steps to) and provenance (``corun_workload``: how
    ``corun_fn`` runs the trainer's work, recorded when given)."""
    t0 = time.time()
    samples = run_profile_grid(decode_step_fn, corun_fn, ladder, **grid)
    meta = {
        "kv_bytes_per_token": kv_bytes_per_token,
        "mixed_buckets": list(mixed_buckets),
        "fma_min_sms": FMA_MIN_SMS,  # batch 1's GEMV formulation by share (predictor.fit_options)
        "ladder": ladder.describe(),
        "ladder_kind": ladder.kind,
        **({"corun_workload": corun_workload} if corun_workload is not None else {}),
        "created_unix": t0,
        "profile_seconds": time.time() - t0,
        "grid": {
            k: asdict(v) if isinstance(v, MixedGrid) else list(v) if isinstance(v, (list, tuple)) else v
            for k, v in grid.items()
            if not callable(v)
        },
    }
    return Profile(key, samples, meta)


def add_adapter_steps(
    profile: Profile,
    decode_step_fn: DecodeStepFn,
    ladder: SMLadder,
    lora_slots: Sequence[int],
    shares: Iterable[int] | None = None,
    warmup: int = 3,
    reps: int = 10,
    mixed_step_fn: MixedStepFn | None = None,
) -> Profile:
    """``profile`` with the adapter steps ``LoRACost`` and ``MixedLoRACost`` need, timed now, and the rest of
    it as it was.

    The grid's adapter points (``run_profile_grid``'s ``lora_slots``) over the profile's own solo samples: per
    share (``shares``, default the profile's), decode steps of their middle batch at their shortest KV length
    on each of ``lora_slots`` adapters, and with ``mixed_step_fn`` (where the profile has mixed steps) its
    mixed grid's middle batch with every chunk size after the first context, every row on one adapter; and
    the base steps of those points beside them. The base steps timed now replace the stored ones, so that an
    adapter's cost is the difference of two steps of one run. Seconds of work, where profiling the whole grid
    again takes minutes."""
    solo = [
        s for s in profile.samples if not s["corun"] and "prefill_tokens" not in s and not s.get("lora_slots")
    ]
    if not solo or not any(n > 0 for n in lora_slots):
        raise ValueError("add_adapter_steps needs solo decode samples and at least one adapter count")
    batches = sorted({int(s["batch"]) for s in solo})
    batch = batches[len(batches) // 2]
    kv_len = min(int(s["kv_tokens"]) // int(s["batch"]) for s in solo if int(s["batch"]) == batch)
    wanted = sorted(set(shares) if shares is not None else set(profile.shares))
    mixed = [
        s for s in profile.samples if not s["corun"] and "prefill_tokens" in s and not s.get("lora_slots")
    ]
    grid = None
    if mixed_step_fn is not None and mixed:
        mixed_batches = sorted({int(s["batch"]) for s in mixed})
        grid = MixedGrid(
            batches=(mixed_batches[len(mixed_batches) // 2],),
            kv_len=int(mixed[0]["kv_len"]),
            tokens=tuple(sorted({int(s["prefill_tokens"]) for s in mixed})),
            contexts=(min(int(s["prefill_context"]) for s in mixed),),
            corun_batches=(),
            warmup=max(warmup // 2, 1),
            reps=max(reps // 2, 1),
        )
    t0 = time.time()
    timed = run_profile_grid(
        decode_step_fn,
        None,
        ladder,
        batches=(batch,),
        kv_lens=(kv_len,),
        shares=wanted,
        warmup=warmup,
        reps=reps,
        lora_slots=lora_slots,
        mixed_step_fn=mixed_step_fn if grid is not None else None,
        mixed_grid=grid,
    )
    # The adapter steps are all timed again (the old ones would repeat them), and so are their base points.
    fresh = {_sample_point(s) for s in timed if not s.get("lora_slots")}
    kept = [
        s
        for s in profile.samples
        if s["corun"] or (not s.get("lora_slots") and _sample_point(s) not in fresh)
    ]
    meta = dict(profile.meta)
    meta["adapter_steps"] = {
        "created_unix": t0,
        "profile_seconds": time.time() - t0,
        "batch": batch,
        "kv_len": kv_len,
        "lora_slots": [n for n in lora_slots if n > 0],
        "shares": wanted,
        "mixed_points": [] if grid is None else [list(p) for p in grid.adapter_points()],
    }
    return Profile(profile.key, kept + timed, meta)


def _sample_point(s: dict) -> tuple:
    """A solo sample's grid point: what a sample timed again replaces."""
    return (
        s["infer_sms"],
        s["batch"],
        s["kv_tokens"],
        s.get("prefill_tokens"),
        s.get("prefill_context"),
    )
