"""TrainerWorker: the trainer side owned by one thread, reached through a mailbox, read through a snapshot.

On a GPU, launching a micro-step costs host time (a chunk's forward or backward is hundreds of kernel
launches through Python and autograd), which would delay the next decode step if the decode thread did it. So
the trainer side (``TrainerSide``) can be owned by a thread of its own (``start()``). The decode thread then:

- posts messages to its mailbox: a ``plan`` of work beside the next decode step (served by one launch round,
  cut short when a newer message arrives), a ``pause``, or a ``call`` (drain, roll back, settle, abandon,
  time-sliced work after a step) whose result it waits for;
- reads ``snapshot``, an immutable ``TrainerSnapshot`` the owner replaces around every launch and call;
- marks its decisions (``tick`` opens one, ``decided`` closes it): with ``refill``, between decisions the
  worker waits for the oldest queued micro-step to end and launches what the plan in force allows in its
  place, so that a queue of one micro-step does not leave the trainer's SMs idle until the next plan. It
  publishes the round (``in_round``) before it checks that no decision is open, and a decision opens before
  it reads the snapshot, so a decision either sees the round or stops it before it launches.

Nothing else is shared. The worker reports back through an outbox: an out-of-memory recovery (the decode
thread then runs the memory hook's serving half, which touches the engine and waits for nothing, and hands the
worker its ticket; the worker runs the trainer's half, waiting for what was ordered, and goes on) or the error
that ended it (raised in the decode thread at its next decision). Without a thread (the CPU default, or before
``start``) every message is handled at once on the caller's thread, by the same code.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from harli_train.colocate.host_priority import HostPriority
from harli_train.colocate.host_profile import host_profile
from harli_train.colocate.memory_hook import CacheReleaseHook, MemoryHook
from harli_train.colocate.policy import BESIDE, StepPlan
from harli_train.colocate.trainer_side import TrainerSide
from harli_train.colocate.trainer_snapshot import TrainerSnapshot
from harli_train.host_threads import single_threaded_ops
from harli_train.train.divergence import TrainingDiverged

log = logging.getLogger(__name__)
_PLAN, _PAUSE, _CALL, _HOOK_DONE, _STOP = "plan", "pause", "call", "hook_done", "stop"


class TrainerWorker:
    """The trainer side behind a mailbox; inline (the caller's thread) until ``start()``."""

    def __init__(
        self,
        trainer: Any,
        memory_hook: MemoryHook | None = None,
        on_slice: Callable[[float], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        max_in_flight: int = 2,
        refill: bool = False,
        **side_options: Any,
    ) -> None:
        self.hook = memory_hook or CacheReleaseHook()
        # The decode thread's claim on the host; every wait of the decode thread for the worker opens it.
        self.priority = HostPriority()
        self.side = TrainerSide(
            trainer,
            self._on_oom,
            self.priority,
            getattr(self.hook, "trainer_scope", contextlib.nullcontext),
            on_slice=on_slice,
            should_stop=should_stop,
            max_in_flight=max_in_flight,
            **side_options,
        )
        self.side.on_launch = self._publish
        self.on_gpu = self.side.on_gpu
        self._decisions = 0  # the decode thread's count, carried by every plan
        self._reported = 0  # launched_total as last reported by feed()
        self._thread: threading.Thread | None = None
        self._mailbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._in_round = False
        self._awaiting_hook = False  # worker: an OOM was reported, the hook has not run yet
        self.wait_s = 0.0  # the worker's time waiting: for messages, and (refill) for its oldest micro-step
        self.refill = refill
        self._deciding = False  # the decode thread: a decision is open (tick .. decided)
        self._plan: StepPlan | None = None  # worker: the plan in force, beside decode (None: paused)
        self.refills = 0  # worker: rounds launched as a queued micro-step ended, between decisions
        self.snapshot = self._take_snapshot()

    # ---- reading -------------------------------------------------------------------------------------
    @property
    def threaded(self) -> bool:
        return self._thread is not None

    @property
    def done(self) -> bool:
        return self.snapshot.done

    def progress_tokens(self) -> float:
        return self.snapshot.tokens

    def _take_snapshot(self) -> TrainerSnapshot:
        side, tr = self.side, self.side.trainer
        return TrainerSnapshot(
            done=side.done,
            step=tr.step,
            total_steps=tr.total_steps,
            last_loss=float(tr.last_loss),
            tokens=side.progress_tokens(),
            queue=tuple(k for *_, k in side.in_flight),
            queue_end=side.in_flight[-1][1] if side.in_flight else None,
            launching_kind=side.launching_kind,
            in_round=self._in_round,
            launched_total=side.launched_total,
            oom_recoveries=side.oom_recoveries,
            queue_ends=tuple(end for _, end, _ in side.in_flight),
            finish_at=side.times.finish_at,
            ewma_s=side.times.ewma_s,
        )

    def _publish(self) -> None:
        self.snapshot = self._take_snapshot()  # one reference swap: readers see the old or the new one

    def gpu_busy(self) -> bool:
        """`TrainerSnapshot.gpu_busy` of the latest snapshot."""
        return self.snapshot.gpu_busy()

    def gpu_left_s(self) -> float:
        """`TrainerSnapshot.gpu_left_s` of the latest snapshot."""
        return self.snapshot.gpu_left_s()

    # ---- the decode thread's side --------------------------------------------------------------------
    def tick(self) -> None:
        """One decode decision passed: run the memory hook for an OOM the worker recovered from; raise the
        error that ended the worker."""
        self._deciding = True  # before anything reads the snapshot
        self._decisions += 1
        if self._thread is not None:
            self._read_outbox()
        else:
            self.side.at_decision(self._decisions)

    def decided(self) -> None:
        """The decision ``tick`` opened is made and handed over (its plan posted, or the trainer paused)."""
        self._deciding = False

    def feed(self, plan: StepPlan, after: Any = None) -> int:
        """Launch (or, with the worker, hand over) the micro-steps ``plan`` allows; returns how many launched
        since the last call (with the worker: what it launched since then, the plan going on there).
        ``after``: an event their work waits for on the GPU (`TrainerSide.launch_round`)."""
        if self._thread is None:
            launched = self.side.launch_round(plan, after=after)
            self._publish()
            return launched
        if plan.train == BESIDE and not plan.paused:
            self._mailbox.put((_PLAN, (plan, after), self._decisions))
            total = self.snapshot.launched_total
            launched, self._reported = total - self._reported, total
            return launched
        self.pause()
        if plan.paused:
            return 0
        # Time slicing: the step is done, the worker fills the slack while this thread waits.
        launched = self._call(lambda: self.side.launch_round(plan, self._preempted, after))
        self._reported = self.snapshot.launched_total
        return launched

    def pause(self) -> None:
        """Launch nothing more beside decode until the next plan."""
        if self._thread is not None:
            self._mailbox.put((_PAUSE, None, self._decisions))

    def drain(self) -> None:
        """Wait for every queued micro-step."""
        self._call(self.side.drain)

    def rollback(self) -> None:
        """Forget the step in flight; the next launch starts it afresh."""
        self._call(self.side.rollback)

    def settle(self) -> None:
        """Count an optimizer step that ran but is not yet counted (and checkpoint it)."""
        self._call(self.side.settle)

    def release_memory(self, decisions: int) -> None:
        """Decode needs memory: abandon the trainer's step, free its cache and hold it back a while (decode
        waits for all of it: its step runs again only then)."""
        self._call(lambda: self.side.abandon_step("decode ran out of memory"))
        ticket = self._serving_side_release()
        self._call(lambda: self._trainer_side_release(ticket))
        self._call(lambda: self.side.hold(decisions))

    def stats(self) -> dict[str, Any]:
        """The trainer side's figures (TrainerSide.stats), the worker's waits (``thread_wait_s``: for
        messages, and with refill for its oldest queued micro-step to end) and its refill rounds."""
        return {**self._call(self.side.stats), "thread_wait_s": self.wait_s, "refills": self.refills}

    def close(self) -> None:
        self.stop()
        self.side.close()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the owner's thread, between micro-steps; its result (or its error, raised here)."""
        if self._thread is None:
            out = fn()
            self._publish()
            return out
        fut: Future = Future()
        self._mailbox.put((_CALL, (fn, fut), self._decisions))
        with self.priority.yielded():
            while True:
                try:
                    return fut.result(timeout=0.05)
                except TimeoutError:
                    self._read_outbox()  # a worker that died fails no future: its error comes here

    def _on_oom(self) -> None:
        """The side abandoned a step that ran out of memory. Inline, the hook's two halves run now; with the
        worker, the decode thread runs the serving side's (``tick``) and hands its ticket back, and the worker
        runs its own half when that arrives, launching nothing meanwhile."""
        if self._thread is None or threading.current_thread() is not self._thread:
            self._trainer_side_release(self._serving_side_release())
            return
        self._awaiting_hook = True
        self._outbox.put(("oom", None))

    def _serving_side_release(self) -> Any:
        """Decode thread: what the serving side gives up after a trainer OOM, without waiting (the hook's
        ``on_trainer_oom``); returns the hook's ticket."""
        try:
            return self.hook.on_trainer_oom()
        except Exception as err:  # the serving side must not fail because the hook did
            log.warning("memory hook failed after a trainer OOM: %s", err)
            return None

    def _trainer_side_release(self, ticket: Any) -> None:
        """Trainer's thread: the hook's ``after_trainer_oom`` (its own caches, and waiting for the ticket)."""
        try:
            self.hook.after_trainer_oom(ticket)
        except Exception as err:  # nor may the trainer's recovery fail because of it: its next try will tell
            log.warning("memory hook failed after a trainer OOM: %s", err)

    def _read_outbox(self) -> None:
        while True:
            try:
                kind, payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            if kind == "oom":
                ticket = self._serving_side_release()
                if self._thread is None:  # the worker has ended (``stop``): its half runs here
                    self._trainer_side_release(ticket)
                else:
                    self._mailbox.put((_HOOK_DONE, ticket, self._decisions))
            else:  # the worker's error: it has ended
                self._join()
                raise payload

    # ---- the worker thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Hand the trainer side to a thread of its own (until ``stop()``)."""
        if self._thread is not None or self.side.done:
            return
        device = torch.cuda.current_device() if self.on_gpu else None
        self._thread = threading.Thread(target=self._run, args=(device,), name="harli-train", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the worker at the next micro-step boundary and join it; the side is the caller's again. An
        OOM it reported gets its hook; the error that ended it is raised."""
        if self._thread is None:
            return
        self._mailbox.put((_STOP, None, self._decisions))
        self._join()
        self._read_outbox()

    def _join(self) -> None:
        """Join the worker; what it left in the mailbox is dropped (plans for steps that are over)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            with self.priority.yielded():
                thread.join()
        self._mailbox = queue.SimpleQueue()
        self._awaiting_hook = False

    def _run(self, device: int | None) -> None:
        with host_profile("trainer-thread"):
            self._loop(device)

    def _loop(self, device: int | None) -> None:
        if device is not None:
            gpu_thread_setup(device)
        mailbox, side = self._mailbox, self.side
        try:
            while True:
                kind, payload, decisions = self._next_message()
                side.at_decision(decisions)
                self._plan = None  # a plan is in force from its round on, until the next message
                if kind == _STOP:
                    return
                if kind == _HOOK_DONE:
                    self._trainer_side_release(payload)
                    self._awaiting_hook = False
                elif kind == _CALL:
                    fn, fut = payload
                    try:
                        fut.set_result(fn())
                    except BaseException as err:
                        fut.set_exception(err)
                elif kind == _PLAN and mailbox.empty() and not self._awaiting_hook:
                    # One round per plan, cut short by any newer message (a newer plan supersedes it).
                    self._in_round = True
                    try:
                        plan, after = payload
                        side.launch_round(plan, self._preempted, after)
                        self._plan = plan
                    finally:
                        self._in_round = False
                self._publish()
        except BaseException as err:  # handed to the decode thread (tick / stop)
            if not isinstance(err, TrainingDiverged):  # that one is the run's own one-line message
                log.error("the trainer thread failed: %s", err)
            self._fail_pending(err)
            self._outbox.put(("error", err))

    def _preempted(self) -> bool:
        """In the worker: a newer message, or an OOM whose hook has not run yet, ends the round."""
        return self._awaiting_hook or not self._mailbox.empty()

    def _next_message(self) -> tuple[str, Any, int]:
        """In the worker: the next message; while none comes, with ``refill``, the plan in force refilled."""
        while self.refill and self._mailbox.empty() and self._refill():
            pass
        t_wait = time.perf_counter()
        message = self._mailbox.get()
        self.wait_s += time.perf_counter() - t_wait
        return message

    def _refill(self) -> bool:
        """In the worker: wait for the oldest queued micro-step to end, then launch under the plan in force
        what it allows in its place; False (nothing launched) when there is no plan in force or nothing queued
        to wait for, or once a message or a decision has come."""
        plan, side = self._plan, self.side
        if plan is None or self._awaiting_hook or not side.in_flight:
            return False
        t_wait = time.perf_counter()
        side.in_flight[0][1].synchronize()  # the GIL released meanwhile
        self.wait_s += time.perf_counter() - t_wait
        if self._deciding or not self._mailbox.empty():
            return False
        self._in_round = True
        self._publish()  # before the check: a decision opened after it sees the round
        try:
            if self._deciding:
                return False
            self.refills += side.launch_round(plan, lambda: self._deciding or self._preempted()) > 0
        finally:
            self._in_round = False
            self._publish()
        return True

    def _fail_pending(self, err: BaseException) -> None:
        """The worker ends: every call still in the mailbox fails with its error."""
        while True:
            try:
                kind, payload, _ = self._mailbox.get_nowait()
            except queue.Empty:
                return
            if kind == _CALL:
                payload[1].set_exception(err)


def gpu_thread_setup(device: int) -> None:
    """The trainer thread's set-up on a GPU: ``device`` current (it is per thread), and torch's CPU ops run on
    this thread alone. Its CPU tensor work there is its data (a batch's layout, an epoch's packing at its
    boundary); an OpenMP team of its own would spin its idle workers on the cores the decode thread launches
    from (``host_threads``)."""
    torch.cuda.set_device(device)
    single_threaded_ops()
