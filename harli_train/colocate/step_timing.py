"""Timing one step of the profile: the median of repeated launches after a warm-up (CUDA events on a GPU
stream, the host clock on the CPU stand-in), alone or beside the trainer's micro-steps (``time_beside``, with
a ``Corunner`` keeping the trainer's stream busy). ``time_calls``, ``median_step_s`` and ``fastest_step_s``
are the primitives the benches use too.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from harli_train.colocate.sm import Partition, is_cuda_stream

DecodeStepFn = Callable[[int, int, Partition], Any]  # (batch, kv_len, partition): enqueue one decode step
CorunFn = Callable[[Partition], Any]  # (partition): enqueue one trainer micro-step on partition.train_stream

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
    seconds = t_solo * (warmup + reps)  # what the decode steps take alone: the queue must outlast it
    trainer = Corunner(corun_fn, part, seconds, t_train)
    times = time_calls(step, part.infer_stream, warmup, reps, trainer)
    retimed = False
    if trainer.covered is False:
        n = trainer.steps_to_cover()
        if n is not None and n <= RETRY_GROWTH * trainer.n:
            trainer = Corunner(corun_fn, part, seconds, t_train, max(n, trainer.n + 1))
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
