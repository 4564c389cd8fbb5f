"""RunEnd: how a co-located run stops and ends (a part of ``ColocatedRuntime``).

A run stops at a step boundary, and ``summary.json``'s ``stop_reason`` says why:

- ``trained``: training is done (``until="train"``; running requests finish first, within the drain);
- ``window``: the load's window closed before training was done (``until="load"``, for benchmarks);
- ``interrupted``: Ctrl-C or SIGTERM (``request_stop``), or a second Ctrl-C wherever the loop was;
- ``out_of_memory``: the trainer kept running out of memory with nothing else running (``AlonePhases``);
- ``decode_out_of_memory``: engine steps kept running out of memory with the trainer's memory released.

However it stops, the trainer keeps its last completed step: an optimizer step that ran is counted and
checkpointed, one half done is rolled back; the requests still running are aborted (and recorded so), and
the summary, the step records and the plots are written.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from harli_train.colocate import report

log = logging.getLogger("harli_train.colocate.runtime")


class RunEnd:
    """``ColocatedRuntime``'s stops and its end (a mixin over its worker, engine, policy, options and
    records; it calls the runtime's ``_mark``, ``_hold``, ``_progress`` and ``_record``)."""

    _stop: threading.Event
    _hard_stop: bool
    _host_from: float | None
    _steps_file: Any
    out_dir: Path
    tpot_s: float
    progress: Any
    worker: Any
    trainer: Any
    engine: Any
    policy: Any
    opts: Any
    stop_reason: str
    decode_ooms: int
    decode_oom_recoveries: int
    decode_oom_s: float

    def _decode_oom(self, err: BaseException, t_start: float) -> None:
        """A step ran out of memory: release the trainer's memory and hold it back, so the step runs again at
        the next decision (its tokens are not lost: the scheduler re-plans it), and record an ``oom`` row with
        the recovery's time. Past ``opts.max_decode_ooms`` in a row the engine's steps do not fit beside the
        trainer: the run stops as ``decode_out_of_memory`` and the trainer keeps its last completed step."""
        self.decode_ooms += 1
        self.decode_oom_recoveries += 1
        what = str(err).splitlines()[0] if str(err) else type(err).__name__
        if self.decode_ooms > self.opts.max_decode_ooms:
            log.error(
                "decode ran out of memory %d times in a row with the trainer's memory released (%s): "
                "its steps do not fit beside the trainer; stopping",
                self.decode_ooms,
                what,
            )
            self.stop_reason = "decode_out_of_memory"
            self._stop.set()
            return
        log.warning(
            "decode step ran out of memory (%s): releasing the trainer's memory and holding it back", what
        )
        self.worker.release_memory(decisions=256)
        spent = time.perf_counter() - t_start
        self.decode_oom_s += spent
        self._record({"kind": "oom", "error": what, "recovery_s": spent})
        self._host_from = time.perf_counter()

    def _install_signals(self):
        """Ctrl-C / SIGTERM ask the loop to stop at the next step boundary; a second Ctrl-C interrupts."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def ask_stop(signum, frame):
            if self._stop.is_set() and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop.set()

        previous = {s: signal.signal(s, ask_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(s, h) for s, h in previous.items()]

    def request_stop(self) -> None:
        """Stop at the next step boundary, as Ctrl-C does."""
        self._stop.set()

    def _finish(self) -> dict[str, Any]:
        worker, trainer = self.worker, self.trainer
        self._mark("end")
        self._hold(None)
        if self.stop_reason == "trained" and not worker.done:
            self.stop_reason = "window"
        if not self.opts.quiet:
            self._progress(force=True)
            self.progress.end_line()
        worker.drain()
        end_tokens = worker.progress_tokens()
        if not self._hard_stop:
            worker.settle()  # an optimizer step that ran is counted (and checkpointed) before stopping
        if not worker.done:
            worker.close()
            if self.stop_reason == "interrupted":
                trainer.interrupt()  # back to the last completed step; finish() checkpoints it
            else:
                worker.rollback()
        if self.opts.port is not None:
            self.opts.port.close()  # its clients learn their requests ended (the records keep them)
        aborted = self.engine.abort_all() if self.engine.has_unfinished() else 0
        self._steps_file.close()
        if self.opts.finish:
            trained = trainer.finish()
        else:
            trainer.metrics.close()
            trained = {
                "steps": trainer.step,
                "total_steps": trainer.total_steps,
                "loss": trainer.last_loss,
                "eval_loss": trainer.last_eval_loss,
                "interrupted": self.stop_reason == "interrupted",
            }
        serving = self.engine.metrics.write(self.out_dir / "serve")
        summary = report.build_summary(self, serving, trained, aborted, end_tokens)
        if self.opts.plots:
            summary["files"].update(
                report.write_plots(
                    self.out_dir, self.tpot_s, self.policy.budget_s, title=f"{self.policy.name}"
                )
            )
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        return summary
