"""Feeds the trainer's micro-steps to whichever stream and SM budget a plan names.

The trainer is a generator of micro-steps that *launch* GPU work; the feeder decides how many to launch
between decode steps so that about one micro-step is queued past the next decision, and tracks them with
CUDA events (on the CPU stand-ins every launch runs synchronously and is timed directly).

Three things make this more than ``next(gen)``:

- The call after an optimizer step host-syncs (the trainer reads the loss), so it is made only once the
  trainer's queue has drained: it then costs nothing.
- Autograd runs a chunk's backward on the stream its forward ran on. A backward whose forward ran on SMs
  that decode has since taken would run inside decode's partition, so the chunk is rebuilt instead: its
  forward runs again from the saved input on the current trainer stream, and its backward follows there
  (one chunk's forward of extra work, where holding the backward would idle the trainer until decode
  shrinks, and redoing the step would throw the step's work away).
- Running out of memory abandons the step in flight, asks the memory hook to release memory, and restarts
  the step; repeated failures hold the trainer back for a while. Decode never sees the error.

Abandoning a step restores the data position and RNG saved at the step's start, so the redone step computes
exactly what the abandoned one would have: co-location changes when work runs, never what is computed.

On a GPU the launching itself costs host time (a chunk's forward or backward is hundreds of kernel launches
through Python and autograd), which would delay the next decode step if the decode thread did it. So the
feeder can run on a thread of its own (``start()``): the decode thread only *publishes* each plan (the train
stream, SM budget and horizon, or a pause) and returns at once; the trainer thread launches a plan's worth of
micro-steps (the same rules as above), stops early when a newer plan or a pause arrives, and otherwise waits.
Anything else the decode thread does to the feeder (drain, abandon, OOM recovery, the end of a run) first waits
for the trainer thread to be between micro-steps and keeps it there. An OOM in the trainer thread is handed to
the decode thread, which recovers from it at its next decision; any other error is re-raised there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from harli_train import kernels
from harli_train.colocate.engine_adapter import is_cuda_stream
from harli_train.colocate.host_priority import HostPriority
from harli_train.colocate.memory_hook import CacheReleaseHook, MemoryHook
from harli_train.colocate.policies import AFTER, BESIDE, StepPlan
from harli_train.colocate.sm import StandInEvent
from harli_train.train.divergence import TrainingDiverged
from harli_train.train.step import MicroStep

log = logging.getLogger(__name__)
OOM_ERRORS: tuple[type[BaseException], ...] = (
    getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
)


class TrainFeeder:
    """Owns the trainer's micro-step generator and launches it onto the streams plans name."""

    def __init__(
        self,
        trainer: Any,
        memory_hook: MemoryHook | None = None,
        on_slice: Callable[[float], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        max_oom_retries: int = 3,
        oom_backoff_steps: int = 64,
        log_limit: int = 4096,
        max_in_flight: int = 2,
    ) -> None:
        self.trainer = trainer
        # Micro-steps queued on the GPU at most (beside decode). The time estimates run short on a small rung,
        # and a queue grown too long fills the stream's hardware queue: the trainer's launches then block in
        # the driver, and on the H200 decode's submissions (event records, its step's return) blocked with them
        # for up to 28 ms (bench/results/2026-11-29-bench_colocate-s6-connections32.json.gz, stall samples).
        self.max_in_flight = max_in_flight
        self.hook = memory_hook or CacheReleaseHook()
        # Entered around every resumption of the trainer's generator (the page pool: where its allocations go).
        self._memory_scope = getattr(self.hook, "trainer_scope", contextlib.nullcontext)
        self.on_slice, self.should_stop = on_slice, should_stop
        self.max_oom_retries, self.oom_backoff = max_oom_retries, oom_backoff_steps
        self.on_gpu = trainer.device.type == "cuda"
        trainer.recompute_chunk = self._take_rebuild
        self.gen = trainer.micro_steps()
        self.done = trainer.done
        self.ewma_s = 0.0  # one micro-step's duration
        self.in_flight: deque[tuple[Any, Any, str]] = deque()  # (start, end, kind) of queued micro-steps
        self._kind_s: dict[str, deque[float]] = {}  # recent durations per kind of micro-step
        self._recent: deque[float] = deque(maxlen=9)  # recent durations of any kind
        self._num_layers = trainer.model.config.num_layers
        self._grad_accum = trainer.cfg.train.grad_accum
        self.last_stream: Any = None
        self.launching_kind: str | None = None  # the micro-step kind being launched now (fwd, bwd, optim...)
        self.launches: deque[tuple[str, str, int]] = deque(maxlen=log_limit)  # (phase, stream, SM budget)
        self.micro_steps = self.oom_recoveries = self.abandoned_steps = self.rebuilt_chunks = 0
        self._ticks = self._held_until = self._oom_streak = self._starved = 0
        self._micro_in_step, self._micro_per_step = 0, 0
        self._step_tokens = (
            trainer.cfg.train.batch_size * trainer.cfg.data.seq_len * trainer.cfg.train.grad_accum
        )
        self._reset_tracking()
        # The trainer thread (None: launches happen on the caller's thread).
        self._thread: threading.Thread | None = None
        self._cv = threading.Condition()
        self._plan: StepPlan | None = None  # what the trainer thread may launch on (None: paused)
        self._plan_gen = self._round_gen = 0  # bumped by every publish; the generation a round serves
        self._want = self._excl_depth = 0  # decode-thread requests to have the feeder to itself
        self._running = self._quit = False
        self._launched_total = self._launched_reported = 0
        self._pending_oom: BaseException | None = None
        self._error: BaseException | None = None
        # Where the trainer's time goes (for the run summary): GPU time of retired micro-steps, host time
        # spent launching them, the trainer thread's waits for a plan, and why launch rounds stopped.
        self.gpu_s = self.launch_host_s = self.wait_s = 0.0
        self._finish_at = 0.0  # host clock: when the queued micro-steps should be done (GPU)
        self._host_recent: deque[float] = deque(maxlen=9)
        self.rounds = 0
        self.stops: dict[str, int] = {}
        # The decode thread's claim on the host (set by the runtime with the trainer thread); every wait of the
        # decode thread for the trainer thread or the GPU opens it.
        self.priority = HostPriority()

    def _reset_tracking(self) -> None:
        self.last_phase: str | None = None
        self._last: MicroStep | None = None
        self._chunks: dict[int, list[tuple[int, int]]] = {}
        self._fwd_first_sm: dict[tuple[int, int], int] = {}
        self._next_bwd: tuple[int, int] | None = None
        self._rebuild: tuple[int, int] | None = None  # the backward chunk to rebuild at its launch
        self._micro_in_step = 0

    # ---- state ---------------------------------------------------------------------------------------
    def tick(self) -> None:
        """One decision passed (the unit of the OOM back-off); decode thread only."""
        self._ticks += 1
        self.check()

    @property
    def held(self) -> bool:
        return self._ticks < self._held_until

    def hold(self, decisions: int) -> None:
        self._held_until = max(self._held_until, self._ticks + decisions)

    def queued_s(self) -> float:
        """GPU work the trainer has queued that is still to run, in seconds: the estimated finish time of the
        last queued micro-step (each starts when the one before it ends, or when it was launched) minus
        now. A queue running late still counts a quarter micro-step until it is retired."""
        if not self.in_flight:
            return 0.0
        ahead = self._finish_at - time.perf_counter()
        return ahead if ahead > 0 else 0.25 * self.ewma_s

    def host_s(self) -> float:
        """Host time one launch takes (median of the recent ones)."""
        recent = self._host_recent
        return sorted(recent)[len(recent) // 2] if recent else 0.0

    def progress_tokens(self) -> float:
        """Tokens trained so far, counting the launched part of the step in flight pro rata."""
        tokens = float(self.trainer.tokens_seen)
        if self.last_phase == "optim":  # the step is done; the trainer counts it on its next call
            return tokens + self._step_tokens
        if self._micro_per_step:
            done = max(self._micro_in_step - len(self.in_flight), 0)
            tokens += self._step_tokens * min(done / self._micro_per_step, 1.0)
        return tokens

    # ---- launching -----------------------------------------------------------------------------------
    def feed(self, plan: StepPlan) -> int:
        """Launch the micro-steps ``plan`` allows; returns how many were launched.

        With the trainer thread running, a plan of work beside decode is only published (the return value is
        then what the thread launched since the previous publish); a time-sliced plan pauses the thread and
        launches here, after the decode step, as without a thread."""
        if self._thread is None:
            return self._feed_now(plan)
        if plan.train == BESIDE and not plan.paused:
            return self._publish(plan)
        self.pause()
        if plan.paused:
            return 0
        # The decode thread launches these itself: autograd's backward threads must pass the gate.
        with self._exclusive(), self.priority.yielded():
            return self._feed_now(plan)

    def _feed_now(self, plan: StepPlan) -> int:
        if self.done or plan.paused or self.held:
            return 0
        self.poll()
        first_sm = plan.train_from_sm if plan.isolated else 0
        sync = not self.on_gpu
        if sync:
            budget = plan.horizon_s
        elif plan.train == BESIDE:
            # Keep the decode step covered, plus about one micro-step queued past it, plus the host time the
            # next launch takes: the GPU must not run dry while the trainer is still launching.
            budget = plan.horizon_s + self.ewma_s + self.host_s() - self.queued_s()
        else:
            budget = plan.horizon_s - self.queued_s()
        launched, why = 0, "done"
        self.rounds += 1
        while not self.done:
            if self.should_stop() or self._preempted():
                why = "preempted"
                break
            # A transient detour (a prefill) may share the SMs of a backward's forward for its one step:
            # the backward goes on there.
            stale = plan.isolated and not plan.transient and self._stale(plan.partition.infer_sms)
            kind = "rebuild" if stale else self._next_kind()
            cost = self.expected_s(kind)
            if stale and kind not in self._kind_s:
                cost = self.expected_s("fwd") + self.expected_s("bwd")
            if not self._may_launch(plan, sync, budget, cost, launched, kind):
                why = "budget"
                break
            if self.last_phase == "optim" and self.in_flight:
                why = "step_boundary"
                break  # the next call host-syncs on the loss: make it once the queue is empty
            self._rebuild = self._next_bwd if stale else None
            t0 = time.perf_counter()
            seconds = self._launch(plan.train_stream, plan.train_sms, first_sm, kind)
            host = time.perf_counter() - t0
            self.launch_host_s += host
            if not sync:
                self._host_recent.append(host)
                # Its kernels start once the queue ahead is done, and none ends before its launch has.
                self._finish_at = max(max(self._finish_at, t0) + cost, t0 + host)
            launched += 1
            if plan.train == AFTER:
                self._starved = 0
            budget -= seconds if sync else (cost or float("inf"))
        key = f"{why}_after_launch" if launched else why
        self.stops[key] = self.stops.get(key, 0) + 1
        return launched

    def stats(self) -> dict[str, Any]:
        """Where the trainer's time went: launch rounds and why they stopped, host and GPU seconds."""
        return {
            "micro_steps": self.micro_steps,
            "rounds": self.rounds,
            "round_stops": dict(sorted(self.stops.items())),
            "gpu_busy_s": self.gpu_s,
            "launch_host_s": self.launch_host_s,
            "thread_wait_s": self.wait_s,
            "rebuilt_chunks": self.rebuilt_chunks,
            "abandoned_steps": self.abandoned_steps,
            "micro_step_ms": {k: 1e3 * sorted(v)[len(v) // 2] for k, v in self._kind_s.items() if v},
            "host_priority": self.priority.stats(),
        }

    def _may_launch(
        self, plan: StepPlan, sync: bool, budget: float, cost: float, launched: int, kind: str
    ) -> bool:
        if plan.train == AFTER:  # time slicing: the slack is a hard limit, the next micro-step must fit
            if cost <= budget:
                return True
            return not launched and (not plan.strict or self._starving(kind, cost, budget))
        if sync:  # CPU stand-in for work beside the step: about the horizon's worth, at least one
            return not launched or cost <= budget
        # GPU: keep the step covered and about one micro-step queued past it, never more than max_in_flight.
        return budget > 0 and len(self.in_flight) < self.max_in_flight

    def _starving(self, kind: str, cost: float, budget: float) -> bool:
        """Whether to launch a micro-step that looks too long anyway: only while its estimate rests on
        fewer than three samples (one slow first call must not shut the trainer out for good)."""
        self._starved += 1
        if self._starved == 500:
            log.warning(
                "the trainer's next micro-step (%s, ~%.1f ms) has not fitted the slack decode leaves "
                "(%.1f ms) for 500 steps: lower train.layers_per_microstep",
                kind,
                cost * 1e3,
                budget * 1e3,
            )
        return self._starved >= 20 and len(self._kind_s.get(kind, ())) < 3

    def expected_s(self, kind: str) -> float:
        """Expected duration of a micro-step of ``kind``: the median of its recent ones (0 before any)."""
        recent = self._kind_s.get(kind)
        return sorted(recent)[len(recent) // 2] if recent else self.ewma_s

    def _next_kind(self) -> str:
        """What the generator will launch next: fwd, loss, bwd, optim, eval (while an evaluation runs: its
        next chunk, or the next step), or "next" (the step boundary)."""
        last, ms = self.last_phase, self._last
        if last is None or ms is None:
            return "next"
        if last == "eval":
            return "eval"
        if last == "fwd":
            return "loss" if ms.stop >= self._num_layers else "fwd"
        if last == "loss" or (last == "bwd" and ms.start > 0):
            return "bwd"
        if last == "bwd":
            return "fwd" if ms.micro_batch + 1 < self._grad_accum else "optim"
        return "next"

    def _launch(self, stream: Any, sms: int, first_sm: int, kind: str) -> float:
        """One micro-step (``kind``, for its timing) on ``stream`` sized for ``sms`` SMs; returns its duration
        when synchronous."""
        self._handoff(stream)
        cuda = is_cuda_stream(stream)
        ctx = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
        t0 = time.perf_counter()
        self.launching_kind = kind
        try:
            with ctx, kernels.sm_budget(max(sms, 1)), self._memory_scope():
                ms = next(self.gen)
        except StopIteration:
            self.done = True
            return 0.0
        except OOM_ERRORS as err:
            self._rebuild = None
            if threading.current_thread() is self._thread:
                self._pending_oom = err  # the decode thread recovers (and decode never sees it)
            else:
                self._recover_oom(err)
            return 0.0
        finally:
            self.launching_kind = None
        seconds = time.perf_counter() - t0
        self.last_stream = stream
        self.launches.append((ms.phase, getattr(stream, "name", None) or repr(stream), sms))
        self._track(ms, first_sm)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self.in_flight.append((start, end, kind))
        else:
            self._observe(seconds, kind)
        return seconds

    def _handoff(self, stream: Any) -> None:
        """The trainer's next work on ``stream`` waits for what it queued on the previous stream."""
        prev = self.last_stream
        if prev is None or prev is stream:
            return
        if is_cuda_stream(prev) and is_cuda_stream(stream):
            event = torch.cuda.Event()
            event.record(prev)
            stream.wait_event(event)
        elif hasattr(stream, "wait_event"):
            event = StandInEvent()
            event.record(prev)
            stream.wait_event(event)

    def _track(self, ms: MicroStep, first_sm: int) -> None:
        self.micro_steps += 1
        self.last_phase, self._last = ms.phase, ms
        if ms.phase == "eval":  # a chunk of an evaluation after a counted step: no gradients to follow
            return
        self._micro_in_step += 1
        mb = ms.micro_batch
        if ms.phase == "fwd":
            chunks = self._chunks.setdefault(mb, [])
            if ms.start == 0:
                chunks.clear()
            chunks.append((ms.start, ms.stop))
            self._fwd_first_sm[(mb, ms.start)] = first_sm
            self._next_bwd = None
        elif ms.phase == "loss":
            self._next_bwd = (mb, self._chunks[mb][-1][0])
        elif ms.phase == "bwd":
            chunks = self._chunks[mb]
            i = chunks.index((ms.start, ms.stop))
            self._next_bwd = (mb, chunks[i - 1][0]) if i > 0 else None
        else:  # optim: the step is complete
            self._micro_per_step = self._micro_in_step
            self._micro_in_step = 0
            self._oom_streak = 0
            self._chunks.clear()
            self._fwd_first_sm.clear()
            self._next_bwd = None

    def _take_rebuild(self, micro_batch: int, start: int) -> bool:
        """The trainer asks, before a chunk's backward, whether to rebuild the chunk's forward first."""
        if self._rebuild != (micro_batch, start):
            return False
        self._rebuild = None
        self.rebuilt_chunks += 1
        self._fwd_first_sm.pop((micro_batch, start), None)
        return True

    def _stale(self, decode_sms: int) -> bool:
        """Whether the next micro-step is a backward whose forward ran on SMs decode now holds."""
        if self._next_bwd is None:
            return False
        first_sm = self._fwd_first_sm.get(self._next_bwd)
        return first_sm is not None and first_sm < decode_sms

    # ---- completion ----------------------------------------------------------------------------------
    def _observe(self, seconds: float, kind: str) -> None:
        self.gpu_s += seconds
        self.ewma_s = seconds if self.ewma_s == 0 else self.ewma_s + 0.2 * (seconds - self.ewma_s)
        self._kind_s.setdefault(kind, deque(maxlen=5)).append(seconds)
        self._recent.append(seconds)
        if self.on_slice is not None:  # a median: one stalled micro-step must not pause the trainer for good
            self.on_slice(sorted(self._recent)[len(self._recent) // 2])

    def poll(self) -> None:
        """Retire finished micro-steps (GPU) and fold their durations into the estimates."""
        while self.in_flight and self.in_flight[0][1].query():
            start, end, kind = self.in_flight.popleft()
            self._observe(start.elapsed_time(end) * 1e-3, kind)

    def drain(self) -> None:
        """Wait for every queued micro-step."""
        with self._exclusive():
            self._drain()

    def _drain(self) -> None:
        if self.in_flight:
            with self.priority.yielded():
                self.in_flight[-1][1].synchronize()
        self.poll()

    # ---- abandoning ----------------------------------------------------------------------------------
    def rollback(self) -> None:
        """Forget the step in flight (gradients, data position, RNG); the next launch starts it afresh."""
        with self._exclusive():
            self._rollback()

    def _rollback(self) -> None:
        tr = self.trainer
        tr.abandon_step()
        self.gen = tr.micro_steps()
        self._reset_tracking()

    def settle(self) -> None:
        """If an optimizer step has run but is not yet counted, let the trainer count it (and checkpoint)."""
        with self._exclusive():
            if self.last_phase != "optim" or self.done:
                return
            self._drain()
        try:
            with self._memory_scope():
                ms = next(self.gen)  # counts the step, then launches the next step's first chunk
            self._track(ms, 0)
        except StopIteration:
            self.done = True

    def abandon_step(self, reason: str) -> None:
        """Drop the step in flight and start it again from its first micro-step.

        No wait for its queued work: it only reads the adapter (no optimizer step ran) and writes tensors
        that are being dropped, whose memory torch hands out again only on the same stream, after it.
        """
        with self._exclusive():
            self.settle()
            if self.done:
                return
            self.gen.close()
            self.rollback()
            self.abandoned_steps += 1
        log.info("trainer step %d restarted: %s", self.trainer.step + 1, reason)

    def _recover_oom(self, err: BaseException) -> None:
        self.oom_recoveries += 1
        self._oom_streak += 1
        log.warning(
            "trainer ran out of memory at step %d (%s): step abandoned, releasing memory",
            self.trainer.step + 1,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        with contextlib.suppress(*OOM_ERRORS):
            self.drain()
        self.in_flight.clear()
        self.rollback()  # the generator died with the error; a fresh one redoes the step
        try:
            self.hook.on_trainer_oom()
        except Exception as hook_err:  # the serving side must not fail because the hook did
            log.warning("memory hook failed after a trainer OOM: %s", hook_err)
        if self._oom_streak >= self.max_oom_retries:
            log.warning(
                "trainer out of memory %d times in a row: paused for %d decode steps",
                self._oom_streak,
                self.oom_backoff,
            )
            self.hold(self.oom_backoff)
            self._oom_streak = 0

    def release_memory(self, decisions: int) -> None:
        """Decode needs memory: abandon the trainer's step, free its cache and hold it back a while."""
        with self._exclusive():
            self.abandon_step("decode ran out of memory")
            with contextlib.suppress(Exception):
                self.hook.on_trainer_oom()
            self.hold(decisions)

    def close(self) -> None:
        self.stop()
        self.drain()
        self.gen.close()

    # ---- the trainer thread --------------------------------------------------------------------------
    @property
    def threaded(self) -> bool:
        return self._thread is not None

    @property
    def launching(self) -> bool:
        """Whether the trainer thread is inside a launch round now (its host work competes with decode's)."""
        return self._running

    def start(self) -> None:
        """Launch from a thread of its own from now on (until ``stop()``)."""
        if self._thread is not None or self.done:
            return
        device = torch.cuda.current_device() if self.on_gpu else None
        self._quit, self._plan, self._error, self._pending_oom = False, None, None, None
        self._thread = threading.Thread(target=self._worker, args=(device,), name="harli-train", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the trainer thread at the next micro-step boundary and join it; launches are then the
        caller's again. A pending OOM is recovered from; another error of the thread is raised."""
        thread = self._thread
        if thread is None:
            return
        with self._cv:
            self._quit = True
            self._cv.notify_all()
        with self.priority.yielded():
            thread.join()
        self._thread = None
        if self._pending_oom is not None:
            err, self._pending_oom = self._pending_oom, None
            self._recover_oom(err)
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def pause(self) -> None:
        """The trainer thread launches nothing more until the next publish of work beside decode."""
        if self._thread is None:
            return
        with self._cv:
            self._plan = None
            self._plan_gen += 1
            self._cv.notify_all()

    def check(self) -> None:
        """Decode thread, once per decision: recover from an OOM the trainer thread hit; raise its error."""
        if self._thread is None:
            return
        if self._error is not None:
            self.stop()  # raises it
        if self._pending_oom is not None:
            with self._exclusive():
                err, self._pending_oom = self._pending_oom, None
                if err is not None:
                    self._recover_oom(err)
            with self._cv:
                self._cv.notify_all()

    def _publish(self, plan: StepPlan) -> int:
        with self._cv:
            launched = self._launched_total - self._launched_reported
            self._launched_reported = self._launched_total
            self._plan = plan
            self._plan_gen += 1
            self._cv.notify_all()
        return launched

    def _preempted(self) -> bool:
        """In the trainer thread: a newer plan, a pause, a stop, an OOM or the decode thread's turn."""
        if threading.current_thread() is not self._thread:
            return False
        return (
            self._plan_gen != self._round_gen or self._want > 0 or self._quit or self._pending_oom is not None
        )

    @contextlib.contextmanager
    def _exclusive(self):
        """The feeder to the calling (decode) thread alone: the trainer thread is kept between micro-steps."""
        thread = self._thread
        if thread is None or threading.current_thread() is thread or self._excl_depth:
            yield
            return
        with self._cv, self.priority.yielded():
            self._want += 1
            while self._running:
                self._cv.wait()
        self._excl_depth += 1
        try:
            yield
        finally:
            self._excl_depth -= 1
            with self._cv:
                self._want -= 1
                self._cv.notify_all()

    def _worker(self, device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)  # the current device is per thread
        seen = 0
        try:
            while True:
                with self._cv:
                    t_wait = time.perf_counter()
                    while not self._quit and (
                        self._want
                        or self._plan is None
                        or self._plan_gen == seen
                        or self._pending_oom is not None
                        or self.done
                    ):
                        self._cv.wait()
                    self.wait_s += time.perf_counter() - t_wait
                    if self._quit:
                        return
                    plan, seen = self._plan, self._plan_gen
                    self._round_gen, self._running = seen, True
                launched = 0
                try:
                    launched = self._feed_now(plan)
                finally:
                    with self._cv:
                        self._running = False
                        self._launched_total += launched
                        self._cv.notify_all()
        except BaseException as err:  # handed to the decode thread (check / stop)
            if not isinstance(err, TrainingDiverged):  # that one is the run's own one-line message
                log.error("the trainer thread failed: %s", err)
            self._error = err
