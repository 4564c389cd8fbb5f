"""TrainerSide: the trainer's micro-steps launched onto the streams and SM budgets plans name.

The trainer is a generator of micro-steps that *launch* GPU work; a launch round decides how many to launch
for a plan so that about one micro-step is queued past the next decision, and tracks them with CUDA events
(on the CPU stand-ins every launch runs synchronously and is timed directly).

Three things make this more than ``next(gen)``:

- The call after an optimizer step host-syncs (the trainer reads the loss), so it is made only once the
  trainer's queue has drained: it then costs nothing.
- A backward whose forward ran on SMs decode has since taken is rebuilt on the current trainer stream
  (``MicroTracker``): one chunk's forward of extra work, where holding the backward would idle the trainer
  until decode shrinks, and redoing the step would throw the step's work away.
- Running out of memory abandons the step in flight, reports it (``on_oom``: the memory hook gives back what
  the serving side can spare and the trainer's own caches, ``memory_hook``) and restarts the step; repeated
  failures hold the trainer back for a number of decode decisions, longer while no step completes
  (`OomBackoff`).

Abandoning a step restores the data position and RNG saved at the step's start, so the redone step computes
exactly what the abandoned one would have: co-location changes when work runs, never what is computed.

One owner at a time: every method is called from one thread (the trainer worker's, or the decode thread's
when there is no worker); other threads read ``TrainerWorker.snapshot``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from harli_train import kernels
from harli_train.colocate.host_priority import HostPriority
from harli_train.colocate.launch_gate import LaunchGate
from harli_train.colocate.micro_step_times import MicroStepTimes
from harli_train.colocate.micro_tracker import MicroTracker
from harli_train.colocate.oom_backoff import OomBackoff
from harli_train.colocate.policy import AFTER, StepPlan
from harli_train.colocate.sm import StandInEvent, is_cuda_stream
from harli_train.train.shape_graphs import GraphCaptureError

log = logging.getLogger(__name__)
OOM_ERRORS: tuple[type[BaseException], ...] = (
    getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),
)


class TrainerSide:
    """Owns the trainer's micro-step generator and launches it onto the streams plans name."""

    def __init__(
        self,
        trainer: Any,
        on_oom: Callable[[], None],
        priority: HostPriority,
        memory_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        on_slice: Callable[[float], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        max_oom_retries: int = 3,
        oom_backoff_steps: int = 64,
        log_limit: int = 4096,
        max_in_flight: int = 2,
        on_optimizer_step: Callable[[int], None] | None = None,
        estimates: dict[str, float] | None = None,
    ) -> None:
        self.trainer, self.on_oom, self.priority = trainer, on_oom, priority
        # Entered around every resumption of the trainer's generator
        # (the page pool: where its allocations go).
        self.memory_scope = memory_scope
        # Called with the step's number right after each optimizer update is launched, on the launching
        # thread with the trainer's stream current (the live adapter's refresh).
        self.on_optimizer_step = on_optimizer_step
        self.on_slice, self.should_stop = on_slice, should_stop
        self.backoff = OomBackoff(max_oom_retries, oom_backoff_steps)
        self.on_gpu = trainer.device.type == "cuda"
        train = trainer.cfg.train
        self.tracker = MicroTracker(
            trainer.model.config.num_layers, train.layers_per_microstep, train.grad_accum
        )
        trainer.recompute_chunk = self.tracker.take_rebuild
        self.gen = trainer.micro_steps()
        self.done = trainer.done
        self.in_flight: deque[tuple[Any, Any, str]] = deque()  # (start, end, kind) of queued micro-steps
        self.times = MicroStepTimes(estimates)
        self.gate = LaunchGate(self.times, max_in_flight)
        self.last_stream: Any = None
        self._last_rung: tuple[Any, int, int] | None = None  # (stream, SMs, first SM) of the last launch
        self.stayed = 0  # launches kept on the last rung until the micro-batch ended (graphs)
        self.launching_kind: str | None = None  # the micro-step kind being launched now (fwd, bwd, optim...)
        self.launches: deque[tuple[str, str, int]] = deque(maxlen=log_limit)  # (phase, stream, SM budget)
        self.oom_recoveries = self.abandoned_steps = self.launched_total = 0
        self.decisions = self._held_until = 0
        cfg = trainer.cfg
        self._step_tokens = cfg.train.batch_size * cfg.data.seq_len * cfg.train.grad_accum
        # Where the trainer's time goes (for the run summary): GPU time of retired micro-steps, host time
        # spent launching them, and why launch rounds stopped.
        self.gpu_s = self.launch_host_s = 0.0
        self.rounds = 0
        self.stops: dict[str, int] = {}
        self.on_launch: Callable[[], None] = lambda: None  # called around every launch (snapshots)

    # ---- state ---------------------------------------------------------------------------------------
    @property
    def last_phase(self) -> str | None:
        return self.tracker.last_phase

    @property
    def micro_steps(self) -> int:
        return self.tracker.micro_steps

    @property
    def rebuilt_chunks(self) -> int:
        graphs = self.trainer.graphs
        return self.tracker.rebuilt_chunks + (graphs.rebuilds if graphs is not None else 0)

    def at_decision(self, decisions: int) -> None:
        """The decode loop has made ``decisions`` decisions (the unit of the OOM back-off)."""
        self.decisions = max(self.decisions, decisions)

    @property
    def held(self) -> bool:
        return self.decisions < self._held_until

    def hold(self, decisions: int) -> None:
        """Launch nothing for the next ``decisions`` decode decisions."""
        self._held_until = max(self._held_until, self.decisions + decisions)

    def queued_s(self) -> float:
        """GPU work the trainer has queued that is still to run, in seconds (`MicroStepTimes.queued_s`)."""
        return self.times.queued_s(bool(self.in_flight))

    def progress_tokens(self) -> float:
        """Tokens trained so far, counting the launched part of the step in flight pro rata."""
        tokens = float(self.trainer.tokens_seen)
        if self.tracker.last_phase == "optim":  # the step is done; the trainer counts it on its next call
            return tokens + self._step_tokens
        return tokens + self._step_tokens * self.tracker.done_fraction(len(self.in_flight))

    def expected_s(self, kind: str) -> float:
        """Expected duration of a micro-step of ``kind`` (`MicroStepTimes.expected_s`)."""
        return self.times.expected_s(kind)

    # ---- launching -----------------------------------------------------------------------------------
    def launch_round(
        self, plan: StepPlan, preempted: Callable[[], bool] = lambda: False, after: Any = None
    ) -> int:
        """Launch the micro-steps ``plan`` allows (stopping early when ``preempted()``); returns how many.
        ``after`` (an event): the round's work starts on the GPU only once it is reached (an engine step
        still running on SMs the plan gives the trainer)."""
        if self.done or plan.paused or self.held:
            return 0
        self.poll()
        first_sm = plan.train_from_sm if plan.isolated else 0
        sync = not self.on_gpu
        budget = self.gate.budget(plan, sync, self.queued_s())
        launched, why = 0, "done"
        self.rounds += 1
        tracker = self.tracker
        while not self.done:
            if self.should_stop() or preempted():
                why = "preempted"
                break
            # A transient detour (a prefill) may share the SMs of a backward's forward for its one step:
            # the backward goes on there. Captured steps rebuild by themselves (`StepGraphs`).
            stale = (
                plan.isolated
                and not plan.transient
                and not self.trainer.rebuilds_itself
                and tracker.stale(plan.partition.infer_sms)
            )
            kind = "rebuild" if stale else tracker.next_kind()
            cost = self.expected_s(kind)
            if stale and kind not in self.times.by_kind:
                cost = self.expected_s("fwd") + self.expected_s("bwd")
            if not self.gate.allows(plan, sync, budget, cost, launched, kind, len(self.in_flight)):
                why = "budget"
                break
            if tracker.last_phase == "optim" and self.in_flight:
                why = "step_boundary"
                break  # the next call host-syncs on the loss: make it once the queue is empty
            tracker.arm_rebuild(stale)
            t0, ooms, abandoned = time.perf_counter(), self.oom_recoveries, self.abandoned_steps
            stream, sms, at_sm = self._rung_for(plan, first_sm)
            seconds = self._launch(stream, sms, at_sm, kind, after)
            after = None  # the round's later launches follow this one (its stream, or a handoff)
            host = time.perf_counter() - t0
            self.launch_host_s += host
            if self.oom_recoveries != ooms or self.abandoned_steps != abandoned:
                why = "oom" if self.oom_recoveries != ooms else "graphs_dropped"
                break  # the step was abandoned: the next try waits for a decision
            if not sync:
                self.times.launched(t0, host, cost)
            launched += 1
            if plan.train == AFTER:
                self.gate.fed()
            budget -= seconds if sync else (cost or float("inf"))
        key = f"{why}_after_launch" if launched else why
        self.stops[key] = self.stops.get(key, 0) + 1
        self.launched_total += launched
        return launched

    def _rung_for(self, plan: StepPlan, first_sm: int) -> tuple[Any, int, int]:
        """(stream, SM budget, first SM) to launch the next micro-step on for ``plan``: its own, except that
        a trainer on graphs whose sets do not share saved tensors stays on its last rung until its
        micro-batch ends when ``plan`` only offers a larger one (decode shrank): its SMs are still clear of
        decode's, and moving would replay the micro-batch's forwards again on the larger rung's graphs
        (`StepGraphs.rebuilds_on_move`)."""
        last = self._last_rung
        graphs = self.trainer.step_graphs
        if (
            last is not None
            and plan.isolated
            and graphs is not None
            and graphs.rebuilds_on_move
            and self.tracker.mid_micro_batch
            and last[0] is not plan.train_stream
            and plan.partition.infer_sms <= last[2]
            and last[1] < plan.train_sms
        ):
            self.stayed += 1
            return last
        return plan.train_stream, plan.train_sms, first_sm

    def _launch(self, stream: Any, sms: int, first_sm: int, kind: str, after: Any = None) -> float:
        """One micro-step (``kind``, for its timing) on ``stream`` sized for ``sms`` SMs, its work waiting on
        the GPU for event ``after`` (None: nothing); returns its duration when synchronous."""
        self._handoff(stream)
        if after is not None and hasattr(stream, "wait_event"):
            stream.wait_event(after)
        cuda = is_cuda_stream(stream)
        ctx = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
        t0 = time.perf_counter()
        self.launching_kind = kind
        self.on_launch()
        try:
            with ctx, kernels.sm_budget(max(sms, 1)), self.memory_scope():
                ms = next(self.gen)
                if ms.phase == "optim" and self.on_optimizer_step is not None:
                    self.on_optimizer_step(self.trainer.step + 1)  # counted at the generator's next call
        except StopIteration:
            self.done = True
            return 0.0
        except OOM_ERRORS as err:
            self.tracker.rebuild = None
            self.recover_oom(err)
            return 0.0
        except GraphCaptureError as err:
            with contextlib.suppress(*OOM_ERRORS):
                self.drain()
            self.in_flight.clear()
            self.trainer.drop_graphs(err)
            self.rollback()  # the generator died with the error; a fresh one redoes the step eagerly
            self.abandoned_steps += 1
            return 0.0
        finally:
            self.launching_kind = None
        seconds = time.perf_counter() - t0
        self.last_stream = stream
        self._last_rung = (stream, sms, first_sm)
        self.launches.append((ms.phase, getattr(stream, "name", None) or repr(stream), sms))
        if self.tracker.track(ms, first_sm):
            self.backoff.completed()
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self.in_flight.append((start, end, kind))
        else:
            self._observe(seconds, kind)
        self.on_launch()
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

    # ---- completion ----------------------------------------------------------------------------------
    def _observe(self, seconds: float, kind: str) -> None:
        self.gpu_s += seconds
        typical = self.times.observe(seconds, kind)
        if self.on_slice is not None:  # a median: one stalled micro-step must not pause the trainer for good
            self.on_slice(typical)

    def poll(self) -> None:
        """Retire finished micro-steps (GPU) and fold their durations into the estimates."""
        while self.in_flight and self.in_flight[0][1].query():
            start, end, kind = self.in_flight.popleft()
            self._observe(start.elapsed_time(end) * 1e-3, kind)

    def drain(self) -> None:
        """Wait for every queued micro-step."""
        if self.in_flight:
            with self.priority.yielded():
                self.in_flight[-1][1].synchronize()
        self.poll()

    # ---- abandoning ----------------------------------------------------------------------------------
    def rollback(self) -> None:
        """Forget the step in flight (gradients, data position, RNG); the next launch starts it afresh."""
        self.trainer.abandon_step()
        self.gen = self.trainer.micro_steps()
        self.tracker.reset()

    def settle(self) -> None:
        """If an optimizer step has run but is not yet counted, let the trainer count it (and checkpoint)."""
        if self.tracker.last_phase != "optim" or self.done:
            return
        self.drain()
        try:
            self.tracker.track(
                next(self.gen), 0
            )  # counts the step, then launches the next step's first chunk
        except StopIteration:
            self.done = True

    def abandon_step(self, reason: str) -> None:
        """Drop the step in flight and start it again from its first micro-step.

        No wait for its queued work: it only reads the adapter (no optimizer step ran) and writes tensors
        that are being dropped, whose memory torch hands out again only on the same stream, after it.
        """
        self.settle()
        if self.done:
            return
        self.gen.close()
        self.rollback()
        self.abandoned_steps += 1
        log.info("trainer step %d restarted: %s", self.trainer.step + 1, reason)

    def recover_oom(self, err: BaseException) -> None:
        """The trainer ran out of memory: abandon its step, report it, hold it back after repeated ones."""
        self.oom_recoveries += 1
        log.warning(
            "trainer ran out of memory at step %d (%s): step abandoned, releasing memory",
            self.trainer.step + 1,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        with contextlib.suppress(*OOM_ERRORS):
            self.drain()
        self.in_flight.clear()
        self.rollback()  # the generator died with the error; a fresh one redoes the step
        self.on_oom()
        hold = self.backoff.failed()
        if hold:
            log.warning(
                "trainer out of memory %d times in a row: paused for %d decode steps (pause %d since its "
                "last completed step)",
                self.backoff.retries,
                hold,
                self.backoff.doublings,
            )
            self.hold(hold)

    def close(self) -> None:
        self.drain()
        self.gen.close()

    def _graph_stats(self) -> dict[str, int] | None:
        """train.cuda_graphs: the sets of graphs captured, the chunks rebuilt and the bytes of the
        saved-tensor arena (None: eager)."""
        graphs = self.trainer.graphs
        if graphs is None:
            return None
        return {"sets": graphs.captures, "rebuilds": graphs.rebuilds, "arena_bytes": graphs.arena_bytes}

    def stats(self) -> dict[str, Any]:
        """Where the trainer's time went: launch rounds and why they stopped, host and GPU seconds."""
        return {
            "micro_steps": self.micro_steps,
            "ewma_micro_step_ms": self.times.ewma_s * 1e3,
            "oom_recoveries": self.oom_recoveries,
            "oom_pauses": self.backoff.pauses,
            "rounds": self.rounds,
            "round_stops": dict(sorted(self.stops.items())),
            "gpu_busy_s": self.gpu_s,
            "launch_host_s": self.launch_host_s,
            "rebuilt_chunks": self.rebuilt_chunks,
            "stayed_on_rung": self.stayed,
            "graphs": self._graph_stats(),
            "abandoned_steps": self.abandoned_steps,
            "micro_step_ms": {k: 1e3 * s for k, s in self.times.medians().items()},
            "host_priority": self.priority.stats(),
        }
