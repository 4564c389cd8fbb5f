"""Per-step choice of the SM partition: the least decode needs to meet the TPOT objective.

Before each decode step the controller asks the predictor for the smallest inference share whose
predicted latency beside the trainer fits ``tpot_s * (1 - margin)``. It grows decode's share at once
when a step needs it and shrinks it only after ``hysteresis_steps`` consecutive steps that would all
allow a smaller one (then to the largest of those), so the partition does not flap; a prefill restarts
that count, and leaving the whole GPU (the trainer resumes beside decode) takes ``resume_margin`` more
headroom when a share has it. The first step on a share it shrank to from a larger one (``Decision.shrunk``)
teaches the predictor that share's correction only: its miss is the share's, not the GPU's, and learnt
GPU-wide it would put the share decode left over budget too. When no share fits, decode gets the whole GPU
and the trainer pauses. On a time-sliced ladder (no green contexts) the trainer runs a micro-step between
decode steps only while step + micro-step fit the budget.

With ``settle`` a shrink must also pay for itself: moving decode from A to B SMs gives the trainer A - B more
SMs for as long as decode stays there, but costs the work the trainer has queued for the old split (about
``in_flight`` micro-steps on its T - B SMs: launched for the old rung, they run there while the new rung's SMs
wait). So it shrinks only when ``(A - B) * dwell >= in_flight * micro_step * (T - B)``, with ``dwell`` the
learnt time decode stays on a share before it grows again (an EWMA over the run): under a steady load the
share settles, under a load that flips it holds the larger share. With ``learn_margin`` the margin follows the
prediction error observed (``margin.LearnedMargin``) over every step the budget sizes (``observe``, and
``observe_margin`` for the policy's mixed steps), ``margin`` its starting value. With ``neighbours``
(``neighbours.NeighbourExcess``) a decode step beside the trainer is sized for its prediction times the excess
learnt beside the kinds of micro-step the trainer has on the GPU as the step is planned (``decide``'s
``beside``).
Every decision is logged with its prediction and, once observed, the measured latency.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from harli_train.colocate.margin import LearnedMargin
from harli_train.colocate.neighbours import NeighbourExcess
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import Partition, SMLadder
from harli_train.config import DEFAULT_MARGIN


@dataclass(slots=True)
class Decision:
    """What to run the next decode step on, and why."""

    partition: Partition
    predicted_s: float  # corrected prediction of the decode step on ``partition``
    pause_trainer: bool
    reason: str
    mode: str  # "spatial", "exclusive" (whole GPU, trainer paused) or "alternate" (time slicing)
    corun: bool  # whether the prediction assumes the trainer running beside decode
    raw_s: float  # uncorrected prediction, for the residual correction
    batch: int
    kv_tokens: int
    step: int
    shrunk: bool = False  # the first step on a share decode shrank to from a larger share (not the whole GPU)
    beside: tuple[str, ...] = ()  # the kinds of trainer micro-step on the GPU as the step was planned
    excess: float = 1.0  # the neighbour factor ``predicted_s`` includes (``NeighbourExcess.factor``)


class Controller:
    """Chooses a ladder rung per decode step from the predictor; logs every decision."""

    def __init__(
        self,
        predictor: LatencyPredictor,
        ladder: SMLadder,
        tpot_s: float,
        margin: float = DEFAULT_MARGIN,
        hysteresis_steps: int = 8,
        train_slice_s: float = 0.0,
        resume_margin: float = 0.3,
        log_path: str | os.PathLike | None = None,
        log_limit: int = 100_000,
        settle: bool = False,
        learn_margin: bool = False,
        in_flight: int = 2,
        clock: Callable[[], float] = time.perf_counter,
        neighbours: NeighbourExcess | None = None,
    ) -> None:
        if tpot_s <= 0 or not 0 <= margin < 1:
            raise ValueError(f"need tpot_s > 0 and 0 <= margin < 1, got tpot_s={tpot_s}, margin={margin}")
        self.predictor, self.ladder = predictor, ladder
        self.tpot_s, self.margin = tpot_s, margin
        self.budget_s = tpot_s * (1.0 - margin)
        self.hysteresis_steps = max(int(hysteresis_steps), 1)
        # Leaving the whole GPU for a share, the trainer restarts beside decode, and the first steps there run
        # slower than predicted (more than a shrink between shares does): that shrink goes to the least share
        # that fits a budget smaller by this fraction. When none does, it takes the plain target rather than
        # hold the whole GPU (docs/design.md, "Measured facts behind the defaults").
        self.resume_margin = resume_margin
        self.train_slice_s = train_slice_s
        self.log: deque[dict[str, Any]] = deque(maxlen=log_limit)
        self._spatial = [(p.index, p.infer_sms) for p in ladder.spatial]
        self._full = ladder.full
        # Start safe: decode alone on the whole GPU (spatial) or the trainer paused (time slicing).
        self._cur = -1 if ladder.time_sliced else ladder.full.index
        self._streak = 0  # consecutive steps that would allow a smaller share
        self._streak_max = -1  # the largest share any of those steps needed
        self._step = 0
        self._open: dict[int, dict[str, Any]] = {}  # logged decisions not yet measured, by step
        self._max_open = 64  # a runtime may decide a few steps ahead of reading their timings
        self._file: IO[str] | None = open(log_path, "a") if log_path else None
        self.settle, self.in_flight, self.clock = settle, in_flight, clock
        self.dwell_s = 1.0  # EWMA of how long decode stays on a share before it grows (settle)
        self._shrunk_at: float | None = None
        self.learned_margin = LearnedMargin(margin) if learn_margin else None
        self.neighbours = neighbours

    def set_objective(self, tpot_s: float, margin: float | None = None) -> None:
        self.tpot_s = tpot_s
        self.margin = self.margin if margin is None else margin
        self.budget_s = tpot_s * (1.0 - self.margin)

    @property
    def holds_whole_gpu(self) -> bool:
        """Decode holds the whole GPU (no share met the budget beside the trainer, and it has not shrunk)."""
        return not self.ladder.time_sliced and self._cur == self._full.index

    def restart_shrink_streak(self) -> None:
        """A prefill ran: the steps that allowed a smaller share saw a batch that has since changed, and the
        first decode steps after a prefill run slower than the model, so decode keeps its share until
        ``hysteresis_steps`` more steps allow a smaller one."""
        self._streak, self._streak_max = 0, -1

    # --- deciding --------------------------------------------------------------------------------------

    def decide(
        self, batch: int, kv_tokens: int, lora_slots: int = 0, beside: tuple[str, ...] = ()
    ) -> Decision:
        """The partition for the next decode step of ``batch`` sequences reading ``kv_tokens`` tokens, its
        rows on ``lora_slots`` distinct adapters (0: the base only), planned while the trainer has micro-steps
        of the kinds ``beside`` on the GPU (used with ``neighbours``)."""
        if self.ladder.time_sliced:
            d = self._decide_alternate(batch, kv_tokens, lora_slots)
        else:
            excess = self.neighbours.size_step(beside) if self.neighbours is not None and beside else 1.0
            d = self._decide_spatial(batch, kv_tokens, lora_slots, excess)
            d.beside = beside
        self._step += 1
        entry = {
            "step": d.step,
            "batch": batch,
            "kv_tokens": kv_tokens,
            "mode": d.mode,
            "infer_sms": d.partition.infer_sms,
            "train_sms": d.partition.train_sms,
            "pause_trainer": d.pause_trainer,
            "predicted_s": d.predicted_s,
            "measured_s": None,
            "budget_s": self.budget_s,
            "margin": self.margin,
            "reason": d.reason,
        }
        self.log.append(entry)
        self._open[d.step] = entry
        if len(self._open) > self._max_open:  # never observed: write it without a measurement
            self._write(self._open.pop(next(iter(self._open))))
        return d

    def target(self, batch: int, kv_tokens: int, lora_slots: int = 0) -> tuple[Partition | None, float]:
        """The smallest spatial share whose predicted step for ``batch`` meets the budget, and that prediction
        ((None, inf) when none does); decides nothing."""
        index, t = self._target(batch, kv_tokens, lora_slots)
        return (self.ladder.partitions[index] if index >= 0 else None), t

    def _target(
        self, batch: int, kv_tokens: int, lora_slots: int, budget: float | None = None, excess: float = 1.0
    ) -> tuple[int, float]:
        """Index and prediction (without ``excess``) of the smallest spatial rung whose prediction times
        ``excess`` is within budget; (-1, inf) when none is."""
        predict, budget = self.predictor.predict, (self.budget_s if budget is None else budget) / excess
        for index, sms in self._spatial:
            t = predict(batch, kv_tokens, sms, True, lora_slots=lora_slots)
            if t <= budget:
                return index, t
        return -1, float("inf")

    def _decide_spatial(self, batch: int, kv_tokens: int, lora_slots: int, excess: float = 1.0) -> Decision:
        target, t_target = self._target(batch, kv_tokens, lora_slots, excess=excess)
        full = self._full.index
        want = full if target < 0 else target
        cur = self._cur
        shrunk = False
        if want >= cur:
            reason = "grow: smaller shares miss the budget" if want > cur else "hold"
            if want > cur:
                self._grew()
            self._cur, self._streak, self._streak_max = want, 0, -1
        else:
            self._streak += 1
            self._streak_max = max(self._streak_max, want)
            if self._streak >= self.hysteresis_steps:
                to = self._streak_max
                if cur == full:  # leaving the whole GPU: the trainer resumes beside decode
                    strict, _ = self._target(
                        batch, kv_tokens, lora_slots, self.budget_s * (1.0 - self.resume_margin), excess
                    )
                    to = max(to, strict)  # none within the margin (-1): the plain target, not a trap
                if self.settle and not self._pays(cur, to):
                    reason = f"settle: a shrink to {self.ladder.partitions[to].infer_sms} SMs would not pay"
                    self._streak, self._streak_max = 0, -1
                else:
                    reason = f"shrink after {self._streak} steps that allow it"
                    shrunk = cur != full
                    self._cur, self._streak, self._streak_max = to, 0, -1
                    self._shrunk_at = self.clock()
            else:
                reason = f"hysteresis: keep share ({self._streak}/{self.hysteresis_steps} steps could shrink)"
        part = self.ladder.partitions[self._cur]
        if part.exclusive:
            return self._exclusive(part, batch, kv_tokens, lora_slots, target < 0, reason)
        t = (
            t_target
            if part.index == target
            else self.predictor.predict(batch, kv_tokens, part.infer_sms, True, lora_slots=lora_slots)
        )
        if t * excess > self.budget_s:
            # the model now puts a held (larger) share over budget: take the target
            self._grew()
            self._cur, self._streak, self._streak_max = want, 0, -1
            part, t, reason = (
                self.ladder.partitions[want],
                t_target,
                "held share over budget: take the target",
            )
        if excess > 1.0:
            reason += f" (sized x{excess:.3f} for the trainer's micro-steps beside it)"
        d = self._decision(part, t, False, reason, "spatial", True, batch, kv_tokens, excess)
        d.shrunk = shrunk and part.index < cur
        return d

    def _grew(self, alpha: float = 0.3) -> None:
        """Decode grows: how long it stayed on the share it shrank to last feeds the dwell estimate."""
        if self._shrunk_at is not None:
            self.dwell_s += alpha * (self.clock() - self._shrunk_at - self.dwell_s)
            self._shrunk_at = None

    def _pays(self, cur: int, to: int) -> bool:
        """Whether shrinking decode from rung ``cur`` to ``to`` gains the trainer more SM-seconds over the
        expected dwell than the queued work launched for the old split costs (see the module docstring)."""
        a, b = self.ladder.partitions[cur].infer_sms, self.ladder.partitions[to].infer_sms
        if cur == self._full.index:
            return True  # leaving the whole GPU: the trainer had nothing queued, it only gains
        cost = self.in_flight * self.train_slice_s * (self.ladder.total_sms - b)
        return (a - b) * self.dwell_s >= cost

    def _exclusive(
        self, part: Partition, batch: int, kv_tokens: int, lora_slots: int, infeasible: bool, reason: str
    ) -> Decision:
        t = self.predictor.predict(batch, kv_tokens, part.infer_sms, False, lora_slots=lora_slots)
        if infeasible:
            reason = (
                f"no share meets {self.budget_s * 1e3:.3f} ms beside the trainer: whole GPU, trainer paused"
            )
            if t > self.budget_s:
                reason += f"; alone it still needs {t * 1e3:.3f} ms"
        return self._decision(part, t, True, reason, "exclusive", False, batch, kv_tokens)

    def _decide_alternate(self, batch: int, kv_tokens: int, lora_slots: int) -> Decision:
        """Time slicing: pause at once when step + micro-step overrun; resume after the hysteresis."""
        part = self._full
        t = self.predictor.predict(batch, kv_tokens, part.infer_sms, False, lora_slots=lora_slots)
        fits = t + self.train_slice_s <= self.budget_s
        paused = self._cur == -1
        if not fits:
            self._cur, self._streak = -1, 0
            reason = (
                f"step {t * 1e3:.3f} ms + micro-step {self.train_slice_s * 1e3:.3f} ms over budget: pause"
            )
        elif paused:
            self._streak += 1
            if self._streak >= self.hysteresis_steps:
                self._cur, self._streak = part.index, 0
                reason = f"resume after {self.hysteresis_steps} steps with room for a micro-step"
            else:
                reason = f"hysteresis: stay paused ({self._streak}/{self.hysteresis_steps})"
        else:
            reason = "alternate: room for a micro-step"
        return self._decision(part, t, self._cur == -1, reason, "alternate", False, batch, kv_tokens)

    def _decision(self, part, t, pause, reason, mode, corun, batch, kv_tokens, excess=1.0) -> Decision:
        """``t``: the corrected prediction on ``part`` before the neighbour factor ``excess``."""
        corr = self.predictor.correction(part.infer_sms, corun)
        d = Decision(part, t * excess, pause, reason, mode, corun, t / corr, batch, kv_tokens, self._step)
        d.excess = excess
        return d

    # --- feedback and logging --------------------------------------------------------------------------

    def observe_margin(self, measured_s: float, predicted_s: float) -> None:
        """Fold a step sized to the budget (a decode step, or a mixed step whose chunk filled it) into the
        learned margin, if there is one: the margin covers the error of every step the budget sizes."""
        if self.learned_margin is not None:
            self.set_objective(self.tpot_s, self.learned_margin.observe(measured_s, predicted_s))

    def observe(self, decision: Decision, measured_s: float) -> None:
        """Record the measured latency of a decided step and feed the predictor's residual correction."""
        part, shrunk = decision.partition, decision.shrunk
        # What the neighbour factor foresaw is not the GPU's error: the online correction learns the rest.
        raw = decision.raw_s * decision.excess
        self.predictor.observe(part.infer_sms, decision.corun, measured_s, raw, own_share=shrunk)
        if self.neighbours is not None and decision.corun and not shrunk and decision.predicted_s > 0:
            self.neighbours.observe(decision.beside, measured_s * decision.excess / decision.predicted_s)
        self.observe_margin(measured_s, decision.predicted_s)
        entry = self._open.pop(decision.step, None)
        if entry is None:  # observed late: the entry was already written without a measurement
            entry = {
                "step": decision.step,
                "infer_sms": decision.partition.infer_sms,
                "predicted_s": decision.predicted_s,
                "late": True,
            }
            self.log.append(entry)
        entry["measured_s"] = measured_s
        entry["error_pct"] = 100.0 * (decision.predicted_s / measured_s - 1.0) if measured_s > 0 else None
        entry["violated"] = measured_s > self.tpot_s
        self._write(entry)

    def observe_train_slice(self, seconds: float, alpha: float = 0.2) -> None:
        """EWMA of the trainer's micro-step duration, which time slicing must fit between steps."""
        self.train_slice_s += alpha * (seconds - self.train_slice_s) if self.train_slice_s else seconds

    def _write(self, entry: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")

    def summary(self) -> dict[str, Any]:
        """Steps, objective violations, paused fraction and prediction error over the kept log."""
        entries = [e for e in self.log if "batch" in e]
        measured = [e for e in entries if e.get("measured_s")]
        errs = [abs(e["error_pct"]) for e in measured if e.get("error_pct") is not None]
        return {
            "steps": len(entries),
            "violations": sum(1 for e in measured if e["violated"]),
            "paused_fraction": sum(e["pause_trainer"] for e in entries) / max(len(entries), 1),
            "mean_infer_sms": sum(e["infer_sms"] for e in entries) / max(len(entries), 1),
            "observed_mape_pct": sum(errs) / len(errs) if errs else None,
            "margin": self.margin,
            "learned_margin": self._learned_margin_range(entries),
            "dwell_s": self.dwell_s if self.settle else None,
            "neighbour_excess": self.neighbours.summary() if self.neighbours is not None else None,
        }

    def _learned_margin_range(self, entries: list[dict[str, Any]]) -> dict[str, float] | None:
        """With a learnt margin: its start, the margin in force now, and the least, median and largest of the
        margins the kept log's decisions were made under and the one now (None with a fixed margin)."""
        if self.learned_margin is None:
            return None
        seen = sorted([self.margin, *(e["margin"] for e in entries if "margin" in e)])
        return {
            "start": self.learned_margin.start,
            "now": self.margin,
            "min": seen[0],
            "median": seen[len(seen) // 2],
            "max": seen[-1],
        }

    def close(self) -> None:
        for entry in self._open.values():
            self._write(entry)
        self._open.clear()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
