"""Timing the profile grid: decode and mixed steps per SM share, alone and beside trainer work.

``run_profile_grid`` times real engine steps (the median of repeated launches after a warm-up: CUDA events
on a GPU stream, the host clock on the CPU stand-in) over batch size, KV length and share, and mixed steps
over a ``MixedGrid``; ``build_profile`` wraps the samples as a ``Profile`` with their provenance, and
``add_adapter_steps`` adds the steps on adapters to a profile made without them.
``time_calls``, ``median_step_s`` and ``fastest_step_s`` are the timing primitives the benches use too.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from harli_train.colocate.mixed_model import attention_pairs
from harli_train.colocate.profile import Profile, ProfileKey
from harli_train.colocate.sm import Partition, SMLadder, is_cuda_stream
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

    # Decode rows and chunks whose sums fill the mixed graphs' small buckets (16, 32, 64 tokens: 2 + 14, 2 + 30,
    # 2 + 62, 32 + 30) as well as the larger ones, where the projections turn compute-bound.
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


DecodeStepFn = Callable[[int, int, Partition], Any]  # (batch, kv_len, partition): enqueue one decode step
# (batch, kv_len, prefill tokens, prefill context, partition[, adapters]): enqueue one mixed step
MixedStepFn = Callable[..., Any]
CorunFn = Callable[[Partition], Any]  # (partition): enqueue one trainer micro-step on partition.train_stream


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
    **grid: Any,
) -> Profile:
    """Run the grid and wrap it with what the predictor needs (``kv_bytes_per_token``, ``mixed_buckets``: the
    token buckets the engine padded the mixed steps to) and provenance."""
    t0 = time.time()
    samples = run_profile_grid(decode_step_fn, corun_fn, ladder, **grid)
    meta = {
        "kv_bytes_per_token": kv_bytes_per_token,
        "mixed_buckets": list(mixed_buckets),
        "fma_min_sms": FMA_MIN_SMS,  # batch 1's GEMV formulation by share (predictor.fit_options)
        "ladder": ladder.describe(),
        "ladder_kind": ladder.kind,
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


# A point whose trainer queue ran dry is timed once more, with the queue its first timing says would have
# outlasted it (and this much to spare), unless that queue is more than RETRY_GROWTH times the first: the
# retry's cost is bounded, and a workload that launches about as slowly as it runs is left uncovered.
COVER_MARGIN, RETRY_GROWTH = 1.25, 2.0


def time_beside(
    step: Callable[[], Any],
    corun_fn: CorunFn,
    part: Partition,
    warmup: int,
    reps: int,
    t_solo: float,
    t_train: float | None,
) -> tuple[float, bool | None, bool]:
    """The median of ``reps`` launches of ``step`` beside the trainer's micro-steps, whether the trainer's
    queue outlasted the last of them (None on the CPU stand-in, whose trainer loops until told to stop), and
    whether the point was timed again.

    On a GPU the micro-steps are queued before the decode steps. A point whose queue ran dry first is timed
    once more with the queue ``Corunner.steps_to_cover`` computes from the first timing, when that is at most
    ``RETRY_GROWTH`` times the first queue (at most 1 + ``RETRY_GROWTH`` queues' GPU time a point). A point
    still not covered keeps its last timing, marked ``covered`` False: what it measured is partly decode
    alone."""
    trainer = Corunner(corun_fn, part, t_solo * (warmup + reps), t_train)
    times = time_calls(step, part.infer_stream, warmup, reps, trainer)
    retimed = False
    if trainer.covered is False:
        n = trainer.steps_to_cover()
        if n is not None and n <= RETRY_GROWTH * trainer.n:
            trainer = Corunner(corun_fn, part, t_solo * (warmup + reps), t_train, max(n, trainer.n + 1))
            times = time_calls(step, part.infer_stream, warmup, reps, trainer)
            retimed = True
    return median(times), trainer.covered, retimed


class Corunner:
    """Keeps the trainer busy on its stream for at least ``seconds`` while decode is timed: ``n`` micro-steps
    queued up front on a GPU (twice what ``seconds`` takes at ``t_step`` a step, or ``n``), a thread looping
    on the CPU stand-in. ``covered``: on a GPU, once ``check`` has run, whether the queue ended after the
    decode step it was given (None before, and on the CPU)."""

    MAX_STEPS = 5000

    def __init__(
        self, corun_fn: CorunFn, part: Partition, seconds: float, t_step: float | None, n: int | None = None
    ) -> None:
        self.fn, self.part = corun_fn, part
        self.n = min(n or int(2.0 * seconds / max(t_step or seconds, 1e-6)) + 2, self.MAX_STEPS)
        self.covered: bool | None = None
        self._launch_s = self._queue_s = self._decode_end_s = 0.0
        self._marks: tuple[Any, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_gpu: bool) -> None:
        if on_gpu:  # queue enough micro-steps ahead of the decode steps to overlap all of them
            import torch

            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.part.train_stream):
                first.record()
                t0 = time.perf_counter()
                for _ in range(self.n):
                    self.fn(self.part)
                self._launch_s = time.perf_counter() - t0
                last.record()
            self._marks = (first, last)
            return
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def check(self, decode_end: Any) -> None:
        """Whether the queue ended no earlier than ``decode_end`` (a timing event on decode's stream,
        completed): both are timed from the event recorded before the queue, which precedes them."""
        if self._marks is None:
            return
        first, last = self._marks
        self._queue_s, self._decode_end_s = (
            first.elapsed_time(last) * 1e-3,
            first.elapsed_time(decode_end) * 1e-3,
        )
        self.covered = self._queue_s >= self._decode_end_s

    def steps_to_cover(self) -> int | None:
        """After ``check``: the micro-steps a queue needs to outlast the same decode steps by
        ``COVER_MARGIN``, from this one's GPU and host seconds a step (the decode steps are launched once the
        queue is, so each step adds its GPU time less its launch time to the queue's lead); None when the
        GPU runs a step no slower than the host launches it (no queue gets ahead) or more than ``MAX_STEPS``
        would be needed."""
        gpu, host = self._queue_s / self.n, self._launch_s / self.n
        decode_s = max(self._decode_end_s - self._launch_s, 0.0)
        if self._marks is None or gpu <= host:
            return None
        n = math.ceil(COVER_MARGIN * decode_s / (gpu - host))
        return n if n <= self.MAX_STEPS else None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.fn(self.part)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def fastest_step_s(
    decode_step_fn: DecodeStepFn, partition: Partition, batch: int = 1, kv_len: int = 1, reps: int = 5
) -> float:
    """The least latency of ``reps`` decode steps of ``batch`` x ``kv_len`` on ``partition`` alone, after a
    warm-up of as many (the least, not the median: a busy host only ever slows a step down)."""
    step = lambda: decode_step_fn(batch, kv_len, partition)
    return min(time_calls(step, partition.infer_stream, warmup=reps, reps=reps))


def time_calls(call: Callable[[], Any], stream: Any, warmup: int, reps: int, trainer: Corunner | None = None):
    on_gpu = is_cuda_stream(stream)
    if trainer is not None:
        trainer.start(on_gpu)
    try:
        if not on_gpu:
            for _ in range(warmup):
                call()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            return times
        import torch

        with torch.cuda.stream(stream):
            for _ in range(warmup):
                call()
            marks = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                call()
                end.record(stream)
                marks.append((start, end))
        torch.cuda.synchronize()
        if trainer is not None:
            trainer.check(marks[-1][1])
        return [s.elapsed_time(e) * 1e-3 for s, e in marks]
    finally:
        if trainer is not None:
            trainer.stop()


def median_step_s(call: Callable[[], Any], stream: Any, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds of ``call`` (which launches one step on ``stream``) over ``reps`` runs after ``warmup``:
    CUDA events on a GPU stream, the host clock on a CPU stand-in."""
    return median(time_calls(call, stream, warmup, reps))


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))
