"""Co-location policies: where each decode step runs and how much trainer work may go with it.

Every policy answers one question per engine step with a ``StepPlan``: the partition whose inference stream
runs the step, and whether trainer micro-steps go *beside* it (launched before the step on a stream of
their own, ``horizon_s`` of work queued), *after* it (time slicing: filling ``horizon_s`` of slack on the
same stream once the step is done) or not at all (paused).

- ``harli``: the controller picks the least SM share that meets the TPOT objective each step; the trainer
  runs on the complementary SMs, pauses when no share fits, and alternates on a time-sliced ladder.
- ``static:N``: decode always on the N-SM rung, the trainer always on the rest.
- ``streams``: two ordinary streams (decode at high priority) over the whole GPU, no partition.
- ``temporal``: decode and trainer alternate on the whole GPU, the trainer filling the slack the
  objective leaves after each step (the controller's time-slicing mode).
- ``exclusive``: decode alone while there is load, then the trainer alone (the two references);
  ``exclusive:N``: the trainer then alone on ``static:N``'s trainer SMs (the reference for that split).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from harli_train.colocate.controller import Controller, Decision
from harli_train.colocate.mixed_model import attention_pairs
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import Partition, SMLadder, TimeSliceLadder
from harli_train.config import (
    DEFAULT_GROW_HEADROOM,
    DEFAULT_LEARN_MARGIN,
    DEFAULT_MARGIN,
    DEFAULT_PREFILL_AHEAD,
    DEFAULT_SETTLE,
    PREFILL_MODES,
    harli_name,
    parse_harli_options,
)
from harli_train.engine.scheduler import StepPreview

BESIDE, AFTER, NONE = "beside", "after", "none"
# With nothing to decode the loop comes back every few ms; keeping the trainer's queue that short means
# little of its work is still running on decode's SMs when the next request arrives.
IDLE_HORIZON_S = 5e-3


@dataclass(slots=True)
class StepPlan:
    """Where the next engine step runs and what the trainer may do meanwhile."""

    partition: Partition  # the step runs on partition.infer_stream
    train: str  # BESIDE, AFTER or NONE
    train_stream: Any
    train_sms: int
    horizon_s: float  # BESIDE: trainer work to keep queued; AFTER: slack to fill after the step
    predicted_s: float | None
    reason: str
    decision: Decision | None = None
    isolated: bool = False  # the trainer's SMs are disjoint from decode's (a green-context rung)
    train_from_sm: int = 0  # isolated: the trainer's rung gives it SMs [train_from_sm, total)
    strict: bool = True  # the horizon is a hard limit (an objective is at stake), not a pacing hint
    transient: bool = False  # a one-step detour (a prefill): backwards it strands wait, never restart
    prefill_tokens: int | None = None  # the prefill budget of the step (None: the engine's default)
    mixed_raw_s: float | None = None  # a mixed step: the uncorrected prediction, for the online correction
    corun: bool = True  # the prediction assumes the trainer beside the step

    @property
    def paused(self) -> bool:
        return self.train == NONE


def _paused(
    part: Partition, reason: str, predicted: float | None = None, d: Decision | None = None
) -> StepPlan:
    return StepPlan(part, NONE, part.train_stream, 0, 0.0, predicted, reason, d)


def _beside(
    decode: Partition,
    trainer: Partition,
    horizon: float,
    predicted: float | None,
    reason: str,
    d: Decision | None = None,
    strict: bool = True,
    transient: bool = False,
) -> StepPlan:
    """The trainer on ``trainer``'s rung (SMs disjoint from ``decode``'s) while decode runs."""
    return StepPlan(
        decode,
        BESIDE,
        trainer.train_stream,
        trainer.train_sms,
        horizon,
        predicted,
        reason,
        d,
        isolated=True,
        train_from_sm=trainer.infer_sms,
        strict=strict,
        transient=transient,
    )


def _whole_gpu(part: Partition, total_sms: int, horizon: float, reason: str, strict: bool = True) -> StepPlan:
    """The trainer on an ordinary stream over the whole GPU (no partition)."""
    return StepPlan(part, BESIDE, part.train_stream, total_sms, horizon, None, reason, strict=strict)


class _Ewma:
    """Running estimate of a latency, for policies without a predictor."""

    def __init__(self, initial: float, alpha: float = 0.2) -> None:
        self.value, self.alpha = initial, alpha

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


class Policy:
    """Base: decode on the whole GPU, the trainer beside it when idle; subclasses override ``plan``.

    With a predictor that models mixed steps, every policy sizes the prefill chunk riding in a decode step
    the same way (``chunk``): the most prefill tokens whose mixed step on the step's share is predicted
    within the budget, so each policy keeps the objective by its own share and none is favoured."""

    name = "policy"
    serve_alone = False  # the trainer waits until the load is over (exclusive)

    def __init__(
        self, ladder: SMLadder, tpot_s: float, margin: float, predictor: LatencyPredictor | None = None
    ) -> None:
        self.ladder, self.tpot_s, self.margin = ladder, tpot_s, margin
        self.budget_s = tpot_s * (1.0 - margin)
        self.step_estimate = _Ewma(self.budget_s / 2)
        self.predictor = predictor

    def partitions(self) -> list[Partition]:
        """Every partition a step may run on (the engine prepares each one's decode graphs)."""
        return [self.ladder.full]

    def trainer_partitions(self) -> list[Partition]:
        """The partitions whose trainer streams the trainer launches on (warmed up before serving)."""
        return self.partitions()

    def plan(self, preview: StepPreview) -> StepPlan:
        """Where the step ``preview`` describes runs, its prefill budget, and what the trainer does."""
        raise NotImplementedError

    def idle_plan(self) -> StepPlan:
        """Where the trainer runs when there is nothing to decode: the whole GPU."""
        return _whole_gpu(self.ladder.full, self.ladder.total_sms, IDLE_HORIZON_S, "idle", strict=False)

    def chunk(
        self, preview: StepPreview, sms: int, corun: bool
    ) -> tuple[int | None, float | None, float | None]:
        """(prefill tokens, corrected and raw predicted seconds) of the largest chunk whose mixed step on
        ``sms`` SMs fits the budget, at least ``MIN_CHUNK`` (or what is pending); (None, None, None) without
        a mixed model (the engine's default budget then applies)."""
        pred = self.predictor
        if pred is None or pred.mixed is None or preview.kind != "mixed":
            return None, None, None
        return largest_chunk(pred, preview, sms, corun, self.budget_s)

    def with_chunk(self, plan: StepPlan, preview: StepPreview) -> StepPlan:
        """``plan`` with the chunk its share fits, for a mixed step (unchanged otherwise)."""
        if preview.kind != "mixed":
            return plan
        sms = plan.partition.infer_sms
        n, t, raw = self.chunk(preview, sms, not plan.paused)
        plan.prefill_tokens, plan.mixed_raw_s, plan.corun = n, raw, not plan.paused
        if t is not None:
            plan.predicted_s = t
        return plan

    def observe(self, plan: StepPlan, measured_s: float) -> None:
        if plan.mixed_raw_s is not None and self.predictor is not None:
            self.predictor.observe(plan.partition.infer_sms, plan.corun, measured_s, plan.mixed_raw_s, True)
            return
        self.step_estimate.update(measured_s)

    def observe_train_slice(self, seconds: float) -> None:
        """Typical duration of one micro-step, reported by the feeder."""

    def summary(self) -> dict[str, Any]:
        return {"policy": self.name}


MIN_CHUNK = 32  # prefill tokens a mixed step takes even where fewer would fit: prefill must progress


def largest_chunk(
    predictor: LatencyPredictor, preview: StepPreview, sms: int, corun: bool, budget_s: float
) -> tuple[int, float, float]:
    """The most prefill tokens of ``preview`` whose mixed step on ``sms`` is predicted within ``budget_s``
    (at least ``MIN_CHUNK`` or all that is pending, whichever is less), with the step's corrected and raw
    prediction. The cost grows with the tokens, so a bisection finds it in ~log2(pending) predictions."""
    b, kv = preview.decode_seqs, preview.decode_kv_tokens
    corr = predictor.correction(sms, corun, mixed=True)

    def raw(n: int) -> float:
        pieces = preview.take(n)
        return predictor.predict_mixed(
            b, kv, n, attention_pairs([(p.tokens, p.context) for p in pieces]), sms, corun, raw=True
        )

    lo, hi = min(MIN_CHUNK, preview.prefill_tokens), preview.prefill_tokens
    if raw(hi) * corr <= budget_s:
        lo = hi
    hi -= lo < hi  # hi does not fit
    while lo < hi:  # invariant: lo fits (or is the floor), hi + 1 does not
        mid = (lo + hi + 1) // 2
        if raw(mid) * corr <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    t = raw(lo)
    return lo, t * corr, t


def _whole_gpu_pair(ladder: SMLadder) -> Partition:
    """Decode on the full rung's high-priority stream, the trainer on its ordinary stream, no partition."""
    full = ladder.full
    return Partition(
        ladder.total_sms,
        ladder.total_sms,
        full.infer_stream,
        full.train_stream,
        index=full.index,
        infer_event=full.infer_event,
        train_event=full.train_event,
    )


def _time_slice(ladder: SMLadder) -> TimeSliceLadder:
    """A one-rung time-slicing view of the ladder's full rung (decode and trainer on one stream)."""
    if ladder.time_sliced:
        return ladder  # type: ignore[return-value]
    full = ladder.full
    part = Partition(
        ladder.total_sms,
        ladder.total_sms,
        full.infer_stream,
        full.infer_stream,
        infer_event=full.infer_event,
        train_event=full.infer_event,
    )
    return TimeSliceLadder(
        [part], ladder.total_sms, kind="timeslice-view", device=ladder.device, time_sliced=True
    )


DEFAULT_PREFILL = PREFILL_MODES[0]


class HarliPolicy(Policy):
    """The controller's per-step choice for decode steps; prefill steps as ``prefill`` says.

    The trainer's rung trails the largest decode share of the last ``trainer_window_s``: autograd runs a
    chunk's backward on the stream its forward ran on, so a forward launched on SMs that decode takes back
    a few steps later leaves a backward that must be rebuilt (its chunk's forward again). Giving the trainer
    the complement of the recent peak keeps the usual ups and downs of the share from doing that.

    A prefill is compute-bound and outside the decode model. Modes:
    - ``rung`` (default): on a rung of its own (``prefill_sms``, half the GPU by default, as a static split
      would), the trainer going on on the other SMs. On the H200, in the runs that had both (objective at
      1.5x and 1.75x the whole GPU's step, bench/results/2026-11-29-bench_colocate-objective1.5x-final.json.gz
      and -objective1.75x.json), it had 4 objective violations in 12 cells against 12 paused, equal or more
      finetune throughput in 6 of 12 and never the paused mode's drops (4.5k against 5.9k tokens/s in
      bursty/medium), at a similar p99 TTFT (96-284 ms against 67-282).
    - ``paused``: on the whole GPU with the trainer held back (what it has queued still runs). The trainer
      loses the prefills' time: 0.5-1.5 s of each 5 s window on the H200, which at looser objectives left
      harli below a static split that trains through its prefills.
    - ``beside``: on the whole GPU, the trainer still launching on its rung beside it (the two share the
      trainer's SMs for the prefill's length). It keeps the trainer's queue full, but the queue it builds
      during the prefill still holds SMs when decode grows right after it (new sequences joined), and
      the prefill's TTFT suffers: on the H200 its p99 TTFT was 95-272 ms against 48-103 ms paused, with
      objective violations in the bursty cells that ``paused`` did not have
      (bench/results/2026-11-29-bench_colocate-correction.json.gz).
    In ``beside`` and ``rung`` the plan is a transient detour: the trainer's rung does not trail it, and a
    backward whose forward's SMs the prefill covers goes on there (it is not rebuilt).

    The trainer launches on every ``trainer_stride``-th spatial rung only, counted down from the largest decode
    share (with ladder step 16: 20, 52, 84 and 116 SMs), decode on any. torch's caching allocator hands a freed
    block out again only on the stream that allocated it, so every stream the trainer uses grows its own copy of
    its working set (~19 GiB for Llama-3-8B at batch 4 x 1024): on the H200 the trainer on all 7 rungs' streams
    ran the GPU out of memory in 4 of 6 harli windows, and each allocator retry (a device-wide sync and ~2800
    cudaFree calls) held the decode loop for up to 266 ms (bench/results/2026-11-29-bench_colocate-s6-first.json.gz).
    The trainer gives up the SMs between its rungs and the decode share (16 at most with stride 2).

    ``grow_headroom`` (``harli:grow=H``, 0.05 by default, ``grow=0`` turns it off) anticipates a grow: while
    decode's predicted step on its share is within ``H`` of the budget, the trainer's next micro-steps go to a
    rung clear of the next larger share too. A grow lands on SMs where the trainer's queued work still runs
    (up to ``max_in_flight`` micro-steps, launched for the old split); without it, harli's violations in the
    all-policy runs on the H200 were such steps (9.9 ms on the GPU against 7.4 predicted, 9.2 against 8.6 in
    bench/results/2026-11-29-bench_colocate-s7-all-gate.json.gz and -s7-all-gate-decode.json.gz). In one run of
    both (bench/results/2026-11-29-bench_colocate-s8-grow-ab.json.gz), harli without it had 2 violations in 6
    cells, both on a grow right after a prefill; with H = 0.05 it had none, at 0.94-1.12x the finetune
    throughput of the run without it, and measured/predicted after a grow fell from 1.04 (median) / 1.36 (max)
    to 0.98 / 1.14.

    ``prefill_ahead`` (``harli:ahead=on``, off by default) looks past a prefill: the runtime hands its plan the
    batch of the decode step after it (``Scheduler.peek_decode_after``), which grows by the prompts the prefill
    finishes. When that step needs more SMs than the prefill's rung leaves (one share more within
    ``grow_headroom`` of the budget), the trainer moves for the prefill's length to a rung clear of that share,
    the prefill taking the rest, or pauses when decode will need the whole GPU. It targets what grow=0.05 left:
    in 2 of 5 all-policy runs with it, harli violated on the first decode step after a run of prefills, its
    batch jumped to 33-36, on SMs where the micro-steps the trainer queued during the prefills still ran (9.9 ms
    on the GPU against 8.0 and 8.7 predicted, bench/results/2026-11-29-bench_colocate-s8-final-3.json.gz and
    -s8-final-4.json.gz). In one run of the bursty cells (-s8-ahead-ab.json.gz) neither variant violated; it
    moved the trainer in 13 of 30 prefills at medium load and 2 of 20 at heavy, at 0.93-1.0x the finetune
    throughput. It stays off until a run shows it removes those violations.
    """

    name = "harli"

    def __init__(
        self,
        ladder: SMLadder,
        predictor: LatencyPredictor,
        tpot_s: float,
        margin: float,
        hysteresis_steps: int = 8,
        trainer_window_s: float = 0.3,
        prefill_sms: int | None = None,
        prefill: str = DEFAULT_PREFILL,
        trainer_stride: int = 2,
        grow_headroom: float = DEFAULT_GROW_HEADROOM,
        prefill_ahead: bool = DEFAULT_PREFILL_AHEAD,
        prefill_floor: int = 128,
        settle: bool = DEFAULT_SETTLE,
        learn_margin: bool = DEFAULT_LEARN_MARGIN,
    ) -> None:
        if prefill not in PREFILL_MODES:
            raise ValueError(f"harli: prefill mode is one of {PREFILL_MODES}, got {prefill!r}")
        if trainer_stride < 1:
            raise ValueError(f"harli: trainer_stride must be >= 1, got {trainer_stride}")
        if not 0 <= grow_headroom < 0.5:
            raise ValueError(f"harli: grow_headroom must be in [0, 0.5), got {grow_headroom}")
        super().__init__(ladder, tpot_s, margin, predictor)
        # Ascending decode share; the rung with the least trainer SMs is always one of them.
        self.trainer_rungs = ladder.spatial[::-1][::trainer_stride][::-1]
        self.prefill_mode, self.grow_headroom, self.prefill_ahead = prefill, grow_headroom, prefill_ahead
        self.prefill_floor = prefill_floor  # prefill tokens a mixed step gets at least (when pending)
        self.name = harli_name(prefill, grow_headroom, prefill_ahead, settle, learn_margin)
        self.controller = Controller(
            predictor, ladder, tpot_s, margin, hysteresis_steps, settle=settle, learn_margin=learn_margin
        )
        self.trainer_window_s = trainer_window_s
        self._recent: deque[tuple[float, int]] = deque()  # (time, decode SMs) of recent spatial steps
        rung = self._trainer_select(prefill_sms if prefill_sms is not None else ladder.total_sms // 2)
        # On a ladder without partitions (time slicing) prefill keeps the whole GPU, the trainer paused.
        self.prefill_rung = None if ladder.time_sliced or rung.exclusive else rung
        self.prefill_estimate = _Ewma(self.budget_s)

    def partitions(self) -> list[Partition]:
        return list(self.ladder.partitions)

    def trainer_partitions(self) -> list[Partition]:
        return [*self.trainer_rungs, self.ladder.full]

    def _trainer_select(self, decode_sms: int) -> Partition:
        """The trainer's rung with the most SMs that leaves decode at least ``decode_sms`` (the full GPU past
        the largest)."""
        for p in self.trainer_rungs:
            if p.infer_sms >= decode_sms:
                return p
        return self.ladder.full

    def _trainer_rung(self, decode_sms: int | None) -> Partition | None:
        """The rung whose trainer SMs stayed clear of decode over the window (None: nothing recent)."""
        now = time.perf_counter()
        if decode_sms is not None:
            self._recent.append((now, decode_sms))
        while self._recent and self._recent[0][0] < now - self.trainer_window_s:
            self._recent.popleft()
        if not self._recent:
            return None
        return self._trainer_select(max(sms for _, sms in self._recent))

    def plan(self, preview: StepPreview) -> StepPlan:
        if preview.kind == "prefill":
            return self._prefill(preview.decode_after())
        if preview.kind == "mixed" and self.predictor.mixed is not None:
            return self._mixed(preview)
        return self.with_chunk(self._decode(preview.decode_seqs, preview.decode_kv_tokens), preview)

    def _prefill(self, after: tuple[int, int] | None) -> StepPlan:
        """A pure prefill step (nothing decodes), as ``prefill_mode`` says."""
        full, kind = self.ladder.full, "prefill"
        self.controller.restart_shrink_streak()
        horizon = self.prefill_estimate.value
        if self.controller.holds_whole_gpu:
            # Waking the trainer for a prefill while decode needs the whole GPU spills its micro-step into
            # the decode steps after it (whole-GPU steps right after the trainer ran had host gaps to 3.9 ms).
            return _paused(full, f"{kind}: whole GPU, decode holds it (trainer stays paused)")
        if self.prefill_mode == "rung" and self.prefill_rung is not None:
            rung = self.prefill_rung
            trainer, need = self._ahead_of(rung, after)
            if need is None:
                reason = f"{kind}: {rung.infer_sms} SMs"
                return _beside(rung, rung, horizon, None, reason, strict=False, transient=True)
            if trainer.exclusive:
                return _paused(
                    full, f"{kind}: whole GPU, the decode after it needs {need} SMs (trainer paused)"
                )
            # Moved for the decode after it, the trainer leaves the prefill the rest of the GPU.
            reason = f"{kind}: {trainer.infer_sms} SMs, the decode after it needs {need}"
            return _beside(trainer, trainer, horizon, None, reason, strict=False, transient=True)
        trainer = None if self.ladder.time_sliced else self._trainer_rung(None)
        if self.prefill_mode == "paused" or trainer is None or trainer.exclusive:
            return _paused(full, f"{kind}: whole GPU")
        trainer, need = self._ahead_of(trainer, after)
        ahead = "" if need is None else f", the decode after it needs {need} SMs"
        if trainer.exclusive:
            return _paused(full, f"{kind}: whole GPU{ahead} (trainer paused)")
        reason = f"{kind}: whole GPU, trainer beside on {trainer.train_sms} SMs{ahead}"
        return _beside(full, trainer, horizon, None, reason, strict=False, transient=True)

    def _mixed(self, preview: StepPreview) -> StepPlan:
        """A decode step carrying prefill chunks: the smallest share (at least decode's own) whose mixed step
        fits the budget with at least ``prefill_floor`` tokens, filled with as many as fit there; the whole
        GPU with the trainer paused when none does. A one-step detour: the controller's decode share and its
        shrink count are left as they are."""
        b, kv = preview.decode_seqs, preview.decode_kv_tokens
        floor = min(self.prefill_floor, preview.prefill_tokens)
        own, _ = self.controller.target(b, kv)
        start = own.infer_sms if own is not None else self.ladder.total_sms
        if not self.ladder.time_sliced:
            for part in self.ladder.spatial:
                if part.infer_sms < start:
                    continue
                n, t, raw = largest_chunk(self.predictor, preview, part.infer_sms, True, self.budget_s)
                if n >= floor and t <= self.budget_s:
                    trainer = self._trainer_rung(part.infer_sms)
                    if trainer is None or trainer.exclusive:
                        break
                    reason = f"mixed: {part.infer_sms} SMs fit {n} prefill tokens"
                    plan = _beside(part, trainer, t, t, reason, transient=True)
                    plan.prefill_tokens, plan.mixed_raw_s = n, raw
                    return plan
        full = self.ladder.full
        n, t, raw = largest_chunk(self.predictor, preview, full.infer_sms, False, self.budget_s)
        plan = _paused(full, f"mixed: whole GPU for {n} prefill tokens (trainer paused)", t)
        plan.prefill_tokens, plan.mixed_raw_s, plan.corun = n, raw, False
        return plan

    def _decode(self, batch: int, kv_tokens: int) -> StepPlan:
        d = self.controller.decide(batch, kv_tokens)
        part = d.partition
        if d.pause_trainer:
            return _paused(part, d.reason, d.predicted_s, d)
        if d.mode == "alternate":
            slack = max(self.controller.budget_s - d.predicted_s, 0.0)
            return StepPlan(
                part, AFTER, part.train_stream, self.ladder.total_sms, slack, d.predicted_s, d.reason, d
            )
        trainer = self._trainer_rung(part.infer_sms)
        if self._near_budget(d.predicted_s):
            trainer = self._clear_of_grow(part, trainer)
        return _beside(part, trainer, d.predicted_s, d.predicted_s, d.reason, d)

    def _ahead_of(self, trainer: Partition, after: tuple[int, int] | None) -> tuple[Partition, int | None]:
        """A prefill's trainer rung with ``prefill_ahead``: clear of the share the decode step after the prefill
        will need too (its batch grows by the prompts the prefill finishes), one share larger while that
        step's prediction is within ``grow_headroom`` of the budget; the full rung when no trainer rung leaves
        decode that much (the trainer then pauses). Its queued work would otherwise still run on SMs that
        decode grows into right after the prefill. Returns the rung and, when it moved, the share it made room
        for."""
        if not self.prefill_ahead or after is None or self.ladder.time_sliced:
            return trainer, None
        part, t = self.controller.target(*after)
        if part is None:
            need = self.ladder.total_sms
        elif self._near_budget(t):
            need = self._next_share(part) or self.ladder.total_sms
        else:
            need = part.infer_sms
        if trainer.infer_sms >= need:
            return trainer, None
        return self._trainer_select(need), need

    def _near_budget(self, predicted_s: float) -> bool:
        """A decode step predicted within ``grow_headroom`` of the budget: it may grow next."""
        return (
            bool(self.grow_headroom) and predicted_s > (1.0 - self.grow_headroom) * self.controller.budget_s
        )

    def _next_share(self, part: Partition) -> int | None:
        """The next larger spatial decode share than ``part``'s (None past the largest)."""
        return next((p.infer_sms for p in self.ladder.spatial if p.infer_sms > part.infer_sms), None)

    def _clear_of_grow(self, part: Partition, trainer: Partition) -> Partition:
        """The trainer's rung for a step whose decode may grow next: clear of the next larger spatial share
        too (``trainer`` itself when it already is, or when no trainer rung leaves decode that much)."""
        larger = self._next_share(part)
        if larger is None or trainer.infer_sms >= larger or larger > self.trainer_rungs[-1].infer_sms:
            return trainer
        return self._trainer_select(larger)

    def idle_plan(self) -> StepPlan:
        trainer = None if self.ladder.time_sliced else self._trainer_rung(None)
        if trainer is None or trainer.exclusive:
            return super().idle_plan()
        return _beside(
            trainer, trainer, IDLE_HORIZON_S, None, "idle (recent decode share kept)", strict=False
        )

    def observe(self, plan: StepPlan, measured_s: float) -> None:
        if plan.mixed_raw_s is not None:
            super().observe(plan, measured_s)  # the mixed model's correction
            return
        if plan.transient:
            self.prefill_estimate.update(measured_s)
            return
        super().observe(plan, measured_s)
        if plan.decision is not None:
            self.controller.observe(plan.decision, measured_s)
            self.budget_s = self.controller.budget_s  # a learnt margin moves it

    def observe_train_slice(self, seconds: float) -> None:
        self.controller.observe_train_slice(seconds)

    def summary(self) -> dict[str, Any]:
        return {"policy": self.name, "controller": self.controller.summary()}


class TemporalPolicy(HarliPolicy):
    """Alternation on the whole GPU: the controller's time-slicing mode over the full rung."""

    name = "temporal"

    def __init__(
        self,
        ladder: SMLadder,
        predictor: LatencyPredictor,
        tpot_s: float,
        margin: float,
        hysteresis_steps: int = 8,
    ) -> None:
        Policy.__init__(self, ladder, tpot_s, margin, predictor)
        self.slices = _time_slice(ladder)
        self.controller = Controller(predictor, self.slices, tpot_s, margin, hysteresis_steps)

    def partitions(self) -> list[Partition]:
        return [self.slices.full]

    def trainer_partitions(self) -> list[Partition]:
        return [self.slices.full]

    def plan(self, preview: StepPreview) -> StepPlan:
        if preview.kind != "decode":  # prefill work: decode and prefill alone on the whole GPU
            return self.with_chunk(_paused(self.slices.full, f"{preview.kind}: whole GPU"), preview)
        return self._decode(preview.decode_seqs, preview.decode_kv_tokens)

    def idle_plan(self) -> StepPlan:
        return _whole_gpu(self.slices.full, self.ladder.total_sms, IDLE_HORIZON_S, "idle", strict=False)


def split_rung(ladder: SMLadder, infer_sms: int, policy: str) -> Partition:
    """The rung of ``policy:infer_sms`` (static, exclusive): the least split giving decode at least
    ``infer_sms`` SMs. ValueError on a ladder without partitions or past its largest split."""
    if ladder.time_sliced or not ladder.spatial:
        raise ValueError(
            f"{policy}:{infer_sms} needs SM partitions (green contexts); this GPU's ladder is "
            f"{ladder.kind} (use harli, streams or temporal)"
        )
    part = ladder.select(infer_sms)
    if part.exclusive:
        top = ladder.spatial[-1].infer_sms
        raise ValueError(
            f"{policy}:{infer_sms} leaves the trainer no SMs (the largest split gives decode {top})"
        )
    return part


class StaticPolicy(Policy):
    """A fixed split: decode on the rung of (at least) N SMs, the trainer always on the others."""

    def __init__(
        self,
        ladder: SMLadder,
        infer_sms: int,
        tpot_s: float,
        margin: float,
        predictor: LatencyPredictor | None = None,
    ) -> None:
        super().__init__(ladder, tpot_s, margin, predictor)
        self.part = split_rung(ladder, infer_sms, "static")
        self.name = f"static:{self.part.infer_sms}"

    def partitions(self) -> list[Partition]:
        return [self.part]

    def plan(self, preview: StepPreview) -> StepPlan:
        return self.with_chunk(
            _beside(self.part, self.part, self.step_estimate.value, None, "static"), preview
        )

    def idle_plan(self) -> StepPlan:
        return _beside(self.part, self.part, IDLE_HORIZON_S, None, "idle (static)", strict=False)


class StreamsPolicy(Policy):
    """Two ordinary streams over the whole GPU, decode at the higher priority."""

    name = "streams"

    def __init__(
        self, ladder: SMLadder, tpot_s: float, margin: float, predictor: LatencyPredictor | None = None
    ) -> None:
        super().__init__(ladder, tpot_s, margin, predictor)
        self.part = _whole_gpu_pair(ladder)

    def trainer_partitions(self) -> list[Partition]:
        return [self.part]

    def plan(self, preview: StepPreview) -> StepPlan:
        plan = _whole_gpu(self.part, self.ladder.total_sms, self.step_estimate.value, "streams")
        return self.with_chunk(plan, preview)

    def idle_plan(self) -> StepPlan:
        return _whole_gpu(self.part, self.ladder.total_sms, IDLE_HORIZON_S, "idle", strict=False)


class ExclusivePolicy(Policy):
    """Decode alone on the whole GPU while there is load; the trainer runs alone once the load is over: on
    the whole GPU, or with ``infer_sms`` (``exclusive:N``) on the trainer side of ``static:N``'s rung, decode's
    side left idle (the trainer's standalone rate on that split's SMs)."""

    name = "exclusive"
    serve_alone = True

    def __init__(
        self,
        ladder: SMLadder,
        tpot_s: float,
        margin: float,
        predictor: LatencyPredictor | None = None,
        infer_sms: int | None = None,
    ) -> None:
        super().__init__(ladder, tpot_s, margin, predictor)
        self.trainer_part = None if infer_sms is None else split_rung(ladder, infer_sms, "exclusive")
        if self.trainer_part is not None:
            self.name = f"exclusive:{self.trainer_part.infer_sms}"

    def trainer_partitions(self) -> list[Partition]:
        return self.partitions() if self.trainer_part is None else [self.trainer_part]

    def plan(self, preview: StepPreview) -> StepPlan:
        return self.with_chunk(_paused(self.ladder.full, "exclusive: decode alone"), preview)

    def idle_plan(self) -> StepPlan:
        part = self.trainer_part
        if part is None:
            return super().idle_plan()
        return _beside(part, part, IDLE_HORIZON_S, None, f"alone on {part.train_sms} SMs", strict=False)


def make_policy(
    name: str,
    ladder: SMLadder,
    predictor: LatencyPredictor | None,
    tpot_s: float,
    margin: float = DEFAULT_MARGIN,
    hysteresis_steps: int = 8,
) -> Policy:
    """The policy a recipe or ``--policy`` names: harli, static:N, streams, temporal, exclusive or
    exclusive:N."""
    if name.startswith("static:"):
        return StaticPolicy(ladder, int(name.split(":", 1)[1]), tpot_s, margin, predictor)
    if name.startswith("exclusive:"):
        return ExclusivePolicy(ladder, tpot_s, margin, predictor, int(name.split(":", 1)[1]))
    base, _, option = name.partition(":")
    if name == "temporal" or base == "harli":
        options = parse_harli_options(option) if base == "harli" else {}
        if predictor is None:
            raise ValueError(f"policy {name!r} needs a latency predictor (a decode profile)")
        if name == "temporal":
            return TemporalPolicy(ladder, predictor, tpot_s, margin, hysteresis_steps)
        return HarliPolicy(ladder, predictor, tpot_s, margin, hysteresis_steps, **options)
    if name == "streams":
        return StreamsPolicy(ladder, tpot_s, margin, predictor)
    if name == "exclusive":
        return ExclusivePolicy(ladder, tpot_s, margin, predictor)
    raise ValueError(
        f"unknown co-location policy {name!r} (harli, static:N, streams, temporal, exclusive, exclusive:N)"
    )


def needs_partitions(name: str) -> bool:
    """Whether policy ``name`` runs on a split of the SMs (static:N, exclusive:N): a CPU then needs the
    stand-in ladder with partitions."""
    return name.startswith(("static:", "exclusive:"))


def profile_shares(name: str, ladder: SMLadder) -> list[int]:
    """The decode shares the predictor must cover for policy ``name``: every policy sizes its mixed steps'
    prefill chunks from it on its own share(s); harli also picks its share from it."""
    if name.startswith("static:") and ladder.spatial and not ladder.time_sliced:
        return [ladder.select(int(name.split(":", 1)[1])).infer_sms]
    if name.partition(":")[0] == "harli":
        return ladder.shares
    return [ladder.full.infer_sms]
