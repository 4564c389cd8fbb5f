"""The co-located loop: one process, one GPU, decode serving its load while the trainer harvests the rest.

Per engine step: release the requests that have arrived; ask the policy where the step runs (the harli
controller re-sizes the SM split every decode step); hand queued work over to the chosen streams; feed the
trainer's micro-steps beside the step (or after it, when time slicing); run the step on its inference
stream; measure it and tell the policy. With nothing to decode the trainer has the GPU to itself.

A run ends when training is done (``until="train"``: new requests stop, running ones finish) or when the
load's window closes (``until="load"``, for benchmarks). ``exclusive`` serves alone, then trains alone.
How a run stops and what it keeps: ``run_end.RunEnd``.

Outputs under ``out_dir``: ``steps.jsonl`` (one line per engine step: batch, KV tokens, share, predicted
and measured latency, micro-steps launched; an ``oom`` row for a step that ran out of memory and ran again),
``summary.json``, ``timeline.png``, ``throughput.png`` and the engine's per-request records under ``serve/``.

With a ``LiveAdapter`` the trainer's adapter is served under the run's name: refreshed after optimizer steps
(``TrainerSide.on_optimizer_step``), its posted versions taken up between engine steps, and the final one
served once training is done (``LiveAdapter`` has the rules).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harli_train.colocate.accounting import objective_stats
from harli_train.colocate.alone_phases import AlonePhases
from harli_train.colocate.decode_core import DecodeCore
from harli_train.colocate.engine_adapter import EngineAdapter
from harli_train.colocate.gc_pauses import GcPauses
from harli_train.colocate.host_priority import HostPriority
from harli_train.colocate.host_profile import host_profile
from harli_train.colocate.memory_hook import MemoryHook
from harli_train.colocate.policy import AFTER, BESIDE, Policy, StepPlan
from harli_train.colocate.progress import Progress, RunView
from harli_train.colocate.run_end import RunEnd
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.sm import Partition
from harli_train.colocate.step_tally import StepTally, step_row
from harli_train.colocate.steps_ahead import StepsAhead, gate, launches_ahead
from harli_train.colocate.trainer_side import OOM_ERRORS
from harli_train.colocate.trainer_worker import TrainerWorker
from harli_train.engine.load import TraceReplay, TraceRequest
from harli_train.engine.step_work import StepPreview
from harli_train.kernels.launch_config import set_launch_gate

log = logging.getLogger(__name__)


class ColocatedRuntime(AlonePhases, RunEnd):
    """Drives a ``Trainer`` and an ``EngineAdapter`` under a ``Policy``; ``run()`` returns the summary."""

    def __init__(
        self,
        trainer: Any,
        engine: EngineAdapter,
        policy: Policy,
        requests: list[TraceRequest],
        out_dir: str | Path,
        options: RuntimeOptions | None = None,
        memory_hook: MemoryHook | None = None,
        info: dict[str, Any] | None = None,
        live: Any = None,
        micro_step_s: dict[str, float] | None = None,
    ) -> None:
        self.trainer, self.engine, self.policy, self.live = trainer, engine, policy, live
        self._live_final = False  # the final adapter is served (or there is none to serve)
        self.live_refreshes0 = live.refreshes if live is not None else 0  # this run's count starts here
        self.requests, self.opts = requests, options or RuntimeOptions()
        self.out_dir = Path(out_dir)
        self.hook, self.info = memory_hook, dict(info or {})
        self._stop = threading.Event()
        self._hard_stop = False
        self.worker = TrainerWorker(
            trainer,
            memory_hook,
            on_slice=policy.observe_train_slice,
            should_stop=self._stop.is_set,
            max_in_flight=self.opts.max_in_flight,
            refill=self.opts.refill,
            on_optimizer_step=live.after_optimizer_step if live is not None else None,
            estimates=micro_step_s,
        )
        policy.trainer_busy = self.worker.gpu_busy
        policy.trainer_left_s = self.worker.gpu_left_s
        policy.trainer_on_gpu = lambda: self.worker.snapshot.on_gpu()
        engine.register(policy.partitions())
        # Prefill steps run on the full rung (harli, temporal, exclusive) or the policy's own partitions.
        engine.warm_up([*policy.partitions(), policy.ladder.full])
        engine.prepare(requests)
        self.tpot_s = policy.tpot_s
        self.stop_reason = "trained"
        self.tally = StepTally(policy.ladder.total_sms)  # streaming counts (the detail goes to steps.jsonl)
        self.decode_ooms = 0  # in a row (the run stops past ``opts.max_decode_ooms``)
        self.decode_oom_recoveries, self.decode_oom_s = 0, 0.0  # all of them, and the time they took
        self.gc_pauses = GcPauses(scheduled=self.opts.scheduled_gc)
        self._priority: HostPriority | None = None  # the decode thread's claim on the host, when installed

    # ---- the loop ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._steps_file = open(self.out_dir / "steps.jsonl", "w")
        restore = self._install_signals()
        self.engine.reset_metrics()
        if self.hook is not None and hasattr(self.hook, "begin_run"):
            self.hook.begin_run()
        self.t0 = time.perf_counter()
        opts = self.opts
        self.progress = Progress(self.policy.name, opts.progress_every_s, opts.quiet, opts.gauges, self.t0)
        self._prev: Partition | None = None
        # The steps launched ahead and their plans (``_step``).
        self.ahead = StepsAhead(launches_ahead(self.policy.launch_ahead, opts.launch_ahead))
        self._last_end, self._last_kind = 0.0, "idle"
        self._host_from: float | None = None  # perf_counter as the last step returned (host_gap_s's start)
        self.start_tokens = self.worker.progress_tokens()
        self.start_step = self.trainer.step
        threaded = self.opts.trainer_thread
        if threaded is None:
            threaded = self.worker.on_gpu
        switch_interval = sys.getswitchinterval()
        self.engine.engine.host_yield = self._gpu_wait
        with self.gc_pauses:
            try:
                if threaded:
                    # The decode thread gets the GIL back within this long of asking for it.
                    sys.setswitchinterval(self.opts.switch_interval_s)
                    if self.opts.host_priority:
                        self._prioritise(True)
                    self.worker.start()
                with host_profile("decode-loop"):  # with the trainer inline (no thread), its launches too
                    with DecodeCore() if self.opts.decode_core else contextlib.nullcontext():
                        self._serve()  # (the threads it pins are started by now)
                    if self._solo_wanted():
                        self.gc_pauses.automatic()  # nothing left to serve: CPython collects again
                        self._solo()
            except KeyboardInterrupt:  # a second Ctrl-C: stop wherever the loop was
                self.stop_reason, self._hard_stop = "interrupted", True
            except BaseException:
                # The engine outlives a failed run (a benchmark's next window): it keeps none of its requests,
                # whose next tokens would otherwise count the failure's pause in another run's intervals.
                with contextlib.suppress(Exception):
                    self.engine.abort_all()
                raise
            finally:
                try:
                    # at the next micro-step boundary; the rest of the run is this thread's
                    self.worker.stop()
                finally:
                    self._prioritise(False)
                    self.engine.engine.host_yield = contextlib.nullcontext
                    sys.setswitchinterval(switch_interval)
                    restore()
        return self._finish()

    def _prioritise(self, on: bool) -> None:
        """Install (or remove) the trainer worker's host-priority gate in every Triton launcher;
        ``_engine_step`` holds it, and the engine's waits for the GPU open it (``_gpu_wait``)."""
        gate = self.worker.priority
        gate.release()
        set_launch_gate(gate.wait if on else None)
        self._priority = gate if on else None

    @contextlib.contextmanager
    def _gpu_wait(self) -> Iterator[None]:
        """The engine's wait for a step it has launched (its ``host_yield``): the collector's turn first (the
        GPU runs the step meanwhile), then the host is the trainer's until the step's tokens are back."""
        self.gc_pauses.young_if_due()
        with self._priority.yielded() if self._priority is not None else contextlib.nullcontext():
            yield

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _mark(self, phase: str) -> None:
        self.tally.mark(phase, self._now(), self.worker.progress_tokens())

    def _serve(self) -> None:
        opts, engine, worker = self.opts, self.engine, self.worker
        replay = TraceReplay(self.requests, opts.time_scale)
        window = opts.window_s if opts.until == "load" else None
        trained_at: float | None = None
        self._mark("serve")
        self.tally.start_holding(self._now())
        port = opts.port
        while not self._stop.is_set() or self._in_grace(port):
            now = self._now()
            if worker.done and trained_at is None:
                trained_at = now
                self._mark("drain")  # training is over: the rest only finishes running requests
            closed = (window is not None and now >= window) or (
                opts.until == "train" and trained_at is not None
            )
            if not closed:
                for r in replay.due(now):
                    engine.submit(r, self.t0 + r.arrival_s * opts.time_scale)
            if port is not None:
                port.drain()
            if self.live is not None:
                self._poll_live()
            busy = engine.has_unfinished()
            if opts.serve_until_stopped:
                pass  # HTTP clients are served until the run is stopped
            elif not busy and (closed or replay.exhausted) and (port is None or closed):
                return
            elif busy and closed and (window is not None or now - trained_at > opts.drain_s):
                return  # window over, or training done and the drain took too long: abort the rest
            self._memory_hook()
            preview = engine.peek()
            if preview.kind == "idle" and not engine.in_flight:  # (in flight: the step it previews after)
                self._idle(replay, closed)
            else:
                self._engine_step(preview)
                if port is not None:
                    port.publish()
            self._progress()
        if self.stop_reason == "trained":  # (not a stop the loop decided itself)
            self.stop_reason = "interrupted"

    def _poll_live(self) -> None:
        """Take up the live adapter's new versions; once training is done, serve its final one."""
        self.live.poll()
        if self.worker.done and not self._live_final:
            self._live_final = self.live.publish_final(self.worker.snapshot.step)

    def _memory_hook(self) -> None:
        """Before every decision, idle ones included (a request waiting for blocks makes the step idle):
        the hook sizes the KV cache for what the next steps need."""
        if self.hook is None:
            return
        try:
            self.hook.before_decode(self.engine)
        except Exception as err:  # memory management must not stop serving
            log.warning("memory hook failed before a decode step: %s", err)

    def _in_grace(self, port: Any) -> bool:
        """Stopped with HTTP clients: admit no more, and let the running ones finish within ``grace_s``."""
        if port is None:
            return False
        if port.closing_at is None:
            port.request_stop(self.opts.grace_s)
            port.drain()
        return port.serving and time.perf_counter() < port.closing_at

    def _engine_step(self, preview: StepPreview) -> None:
        # Steps with decode rows only: a pure prefill step stalls nobody, and an eager prefill launches for
        # 30-100 ms, long enough for the trainer's queue to run dry behind a closed gate.
        if self._priority is None or preview.kind == "prefill":
            self._step(preview)
            return
        with self._priority.holding():  # opened while the step waits for the GPU (the engine's host_yield)
            self._step(preview)

    def _step(self, preview: StepPreview) -> None:
        """One engine step: plan it, hand the trainer its part, run it, record and learn from it.

        With ``launch_ahead`` a step's successor (a decode step, or a mixed one while prompts wait or a
        chunk continues) is launched on the GPU before the step's tokens are read back
        (``DecodeEngine.step``), so the host's work between two steps (reading tokens, bookkeeping, planning,
        feeding the trainer, staging the next step) overlaps the GPU's. ``preview`` is then of the step after
        the one in flight, the plan made in a call places the step launched ahead in it, and the step the
        call completes is the one launched ahead before, with its own plan: it is that plan the step is
        recorded and learnt under. Where no step can follow the one in flight (nothing left to decode;
        prefill-first, a prefill step next; a successor that would launch eagerly), it completes alone.
        ``StepsAhead`` keeps the plans and states the rules."""
        worker, policy = self.worker, self.policy
        t_enter = time.perf_counter()
        worker.tick()
        # The step in flight (an abort may have completed it), or the plan carried over for this step.
        done, plan = self.ahead.take(bool(self.engine.in_flight), preview)
        launched, ahead = 0, False
        if plan is not None:  # carried out in the call before: it only launches now
            ahead = self.ahead.may_launch(plan, False)
        elif (
            done is None or preview.kind == "decode" or (preview.kind != "idle" and self.engine.mixed_prefill)
        ):
            plan = policy.plan(preview)
            self._hold(plan)
            policy.ladder.switch(self._prev, plan.partition)
            self._prev = plan.partition
            if plan.train == BESIDE:
                # with the trainer thread: published, launched there
                launched = worker.feed(plan, gate(plan, done, self.engine.last_step_event))
            else:
                worker.pause()  # paused or time-sliced: the trainer thread launches nothing beside this step
            if plan.train == AFTER:
                worker.drain()  # same stream: the step must not queue behind the trainer's work
            ahead = self.ahead.may_launch(plan, done is not None)
        snap = worker.snapshot  # the trainer side as of its last launch (owned by its worker)
        on_gpu = snap.on_gpu()  # its micro-steps still on the GPU as the step starts
        if done is None:
            assert plan is not None
            done = (plan, snap, on_gpu)
        where = plan if plan is not None else done[0]
        if plan is not None and plan.after_trainer:
            self.engine.wait_before_next(snap.queue_end)  # its step follows the trainer's queued work
        worker.decided()
        t_start = time.perf_counter()
        try:
            result = self.engine.step(where.partition, where.prefill_tokens, ahead)
        except OOM_ERRORS as err:
            self._decode_oom(err, t_start)
            return
        t_end = time.perf_counter()
        self.decode_ooms = 0
        if self.ahead.after_step(plan, done, bool(self.engine.in_flight), (plan, snap, on_gpu), preview):
            self.tally.launched_ahead += 1
        measured = result.latency_s or (t_end - t_start)
        if plan is not None and plan.train == AFTER:
            launched += worker.feed(plan)
        if result.kind == "idle":
            return
        plan, snap, on_gpu = done
        end = t_end - self.t0
        row = step_row(result, plan, measured, launched, snap, on_gpu)
        # The host's time between the last step's return and this one's launch (its records, the loop's
        # submissions, the memory hook, the preview), and of that the plan (policy, switch, trainer feed).
        row.update(host_gap_s=None if self._host_from is None else t_start - self._host_from)
        row.update(plan_s=t_start - t_enter)
        if result.num_decode:
            # The step's token interval for its decode rows (from the last step that drew their tokens),
            # which the policy learns from: it is what the objective judges, host time between steps
            # included. The objective itself is counted per request, over every interval (accounting).
            interval = end - self._last_end if self._last_kind == "tokens" else None
            seen = interval if interval is not None else measured
            policy.observe(plan, max(measured, seen))
            row.update(interval_s=interval, violated=seen > self.tpot_s)
            self._last_kind = "tokens"
        else:
            if plan.transient:
                policy.observe(plan, measured)
            self._last_kind = result.kind
        self.tally.count(result.kind, result.num_decode, plan.partition.infer_sms, plan.paused)
        self._last_end = end
        self._record(row, t=end)
        self._host_from = time.perf_counter()

    def _hold(self, plan: StepPlan | None) -> None:
        """The trainer holds ``plan``'s SMs from now (None: none); closes the interval of the plan before."""
        if plan is None or plan.paused:
            self.tally.hold(self._now(), 0)
        else:
            self.tally.hold(self._now(), plan.train_sms, plan.partition.infer_sms)

    # ---- records and progress ------------------------------------------------------------------------
    def _record(self, row: dict[str, Any], t: float | None = None) -> None:
        row = {
            "t": round(self._now() if t is None else t, 6),
            **row,
            "train_step": self.worker.snapshot.step,
            "tokens": round(self.worker.progress_tokens() - self.start_tokens),
        }
        if self.hook is not None and hasattr(self.hook, "step_row"):
            row.update(self.hook.step_row())  # the page pool's tenants, for the timeline
        self._steps_file.write(json.dumps(row) + "\n")

    def _progress(self, force: bool = False) -> None:
        self.progress.update(time.perf_counter(), self._view, force)

    def _view(self) -> RunView:
        tr, now = self.worker.snapshot, time.perf_counter()
        elapsed = max(now - self.t0, 1e-9)
        return RunView(
            elapsed_s=elapsed,
            train_step=tr.step,
            train_total_steps=tr.total_steps,
            train_loss=tr.last_loss,
            trainer_tokens_per_s=(tr.tokens - self.start_tokens) / elapsed,
            running_requests=len(self.engine.running()),
            decode_sms=None if self._prev is None else self._prev.infer_sms,
            trainer_sms=self.tally.held_sms,
            total_sms=self.policy.ladder.total_sms,
            paused_fraction=self.tally.paused_fraction,
            objective=self.objective(),  # one pass over the requests for both
        )

    def objective(self) -> dict[str, Any]:
        """The objective figures over every request so far (recorded, running and queued): what the console
        shows and, at the end, the summary (``accounting.objective_stats``)."""
        eng = self.engine
        return objective_stats(
            eng.metrics, self.tpot_s, eng.running(), self.policy.ttft_s, eng.waiting(), eng.now()
        )
