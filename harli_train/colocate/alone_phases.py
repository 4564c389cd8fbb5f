"""AlonePhases: the co-located loop's phases where the trainer has the GPU to itself (a part of
``ColocatedRuntime``): between requests (``_idle``), and after the load or for ``exclusive``'s second half
(``_solo``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from harli_train.engine.load import TraceReplay

log = logging.getLogger("harli_train.colocate.runtime")


class AlonePhases:
    """``ColocatedRuntime``'s trainer-alone phases (a mixin over its worker, policy, options and records)."""

    _stop: Any
    worker: Any
    policy: Any
    opts: Any
    stop_reason: str
    _last_kind: str

    def _solo_wanted(self) -> bool:
        if self._stop.is_set() or self.worker.done:
            return False
        return self.opts.until == "train" or self.policy.serve_alone

    def _solo(self) -> None:
        """The trainer alone on the whole GPU (after the load, or exclusive's second half)."""
        self._mark("solo")
        self._memory_hook()  # one decision for the idle engine: its cache gives back the groups it holds idle
        end = self._now() + self.opts.solo_s if self.opts.until == "load" else float("inf")
        plan = self.policy.idle_plan()
        self._hold(plan)
        snap = self.worker.snapshot
        step0, ooms0 = snap.step, snap.oom_recoveries
        while not self._stop.is_set() and not self.worker.done and self._now() < end:
            self.worker.tick()
            if not self.worker.feed(plan) or self.worker.threaded:
                time.sleep(1e-3 if self.worker.threaded else 2e-4)
            self._progress()
            snap = self.worker.snapshot
            if snap.step != step0:
                step0, ooms0 = snap.step, snap.oom_recoveries
            elif snap.oom_recoveries - ooms0 >= self.opts.max_solo_ooms:
                # Decode holds nothing it could give up and the hook freed what it could after each OOM.
                self.stop_reason = "out_of_memory"
                log.error(
                    "trainer ran out of memory %d times in a row at step %d with nothing else running: "
                    "it does not fit; stopping",
                    snap.oom_recoveries - ooms0,
                    snap.step + 1,
                )
                return
        if self._stop.is_set():
            self.stop_reason = "interrupted"

    def _idle(self, replay: TraceReplay, closed: bool) -> None:
        """Nothing to decode: the trainer runs until the next arrival (unless it must wait for the load)."""
        self.gc_pauses.full_if_due()  # the collector's turn: no token interval is open
        launched = 0
        if not (self.policy.serve_alone or self.worker.done):
            self.worker.tick()
            plan = self.policy.idle_plan()
            self._hold(plan)
            launched = self.worker.feed(plan)
            if launched:
                self._record(
                    {
                        "kind": "idle",
                        "infer_sms": 0,
                        "train_sms": plan.train_sms,
                        "train": plan.train,
                        "micro_steps": launched,
                    }
                )
        if not launched or self.worker.threaded:  # the trainer thread works meanwhile
            nxt = None if closed else replay.next_arrival_s()
            wait = 2e-3 if nxt is None else min(max(nxt - self._now(), 0.0), 2e-3)
            time.sleep(wait)
        self._last_kind = "idle"
