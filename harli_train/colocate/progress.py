"""Progress: the co-located run's console line and its live gauges, both from one view of the run.

The line (every ``every_s``; one line rewritten in place on a terminal, cut to its width) and the gauges
(every ``board.every_s``, for the HTTP front end's ``/metrics``) show the same figures of the same moment:
the objective's are ``accounting.objective_stats`` over every request so far, as the run's last line gives
them (``report.objective_text``).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harli_train.colocate import report
from harli_train.colocate.gauges import GaugeBoard, RuntimeGauges


@dataclass(frozen=True, slots=True)
class RunView:
    """The run at one moment, as the console and the gauges show it."""

    elapsed_s: float
    train_step: int
    train_total_steps: int
    train_loss: float
    trainer_tokens_per_s: float
    running_requests: int
    decode_sms: int | None  # None before the first step
    trainer_sms: int
    total_sms: int
    paused_fraction: float
    objective: dict[str, Any]  # accounting.objective_stats

    def gauges(self) -> RuntimeGauges:
        obj = self.objective
        return RuntimeGauges(
            train_step=self.train_step,
            train_total_steps=self.train_total_steps,
            train_loss=self.train_loss,
            trainer_tokens_per_s=self.trainer_tokens_per_s,
            decode_sms=self.decode_sms or 0,
            trainer_sms=self.trainer_sms,
            total_sms=self.total_sms,
            token_intervals=obj["intervals"],
            objective_violations=obj["violations"],
            violation_rate=obj["violation_rate"] or 0.0,
            trainer_paused_fraction=self.paused_fraction,
        )

    def line(self, policy: str, width: int | None = None) -> str:
        """The whole line; past ``width`` columns a short form of the same figures (cut to ``width``)."""
        share = "-" if self.decode_sms is None else f"{self.decode_sms}/{self.total_sms} SMs"
        whole = (
            f"[{policy}] train {self.train_step}/{self.train_total_steps} loss {self.train_loss:.3f}"
            f", {self.trainer_tokens_per_s:,.0f} tok/s"
            f" | serve {self.running_requests} seqs, {report.objective_text(self.objective)}"
            f" | decode on {share}, trainer paused {100 * self.paused_fraction:.0f}% [{self.elapsed_s:,.0f}s]"
        )
        if width is None or len(whole) <= width:
            return whole
        obj = self.objective
        p99 = "-" if not obj["requests_judged"] else f"{obj['tpot_ms']['p99']:.1f}"
        short = (
            f"{self.train_step}/{self.train_total_steps} loss {self.train_loss:.3f} "
            f"{self.trainer_tokens_per_s / 1e3:.1f}k tok/s | {self.running_requests} seqs, "
            f"TPOT p99 {p99} ms, {obj['violations']}/{obj['intervals']} over | {share}"
        )
        return short[:width]


class Progress:
    """Prints the line and publishes the gauges, each when its period is due (or when forced)."""

    def __init__(
        self, policy: str, every_s: float, quiet: bool, board: GaugeBoard | None, start: float
    ) -> None:
        self.policy, self.every_s, self.quiet, self.board = policy, every_s, quiet, board
        self._last_line = self._last_gauges = start

    def update(self, now: float, view: Callable[[], RunView], force: bool = False) -> None:
        """``view()`` is taken only when something is due (it walks every request)."""
        board = self.board
        gauges_due = board is not None and (force or now - self._last_gauges >= board.every_s)
        line_due = not self.quiet and (force or now - self._last_line >= self.every_s)
        if not (gauges_due or line_due):
            return
        snap = view()
        if gauges_due:
            self._last_gauges = now
            board.publish(snap.gauges())
        if line_due:
            self._last_line = now
            if sys.stderr.isatty():  # one line rewritten in place: it must fit the terminal
                width = shutil.get_terminal_size((200, 24)).columns - 1
                print("\r" + snap.line(self.policy, width) + "\x1b[K", end="", file=sys.stderr, flush=True)
            else:
                print(snap.line(self.policy), file=sys.stderr, flush=True)

    def end_line(self) -> None:
        """Ends the line rewritten in place (a terminal), before what the run prints after it."""
        if not self.quiet and sys.stderr.isatty():
            print(file=sys.stderr)
