"""``harli``: the controller's least sufficient SM share for each decode step, the trainer on the rest.

Composed of three parts: the ``Controller`` (decode's share, with hysteresis, settling and a learnt margin),
``TrainerRungs`` (which rung the trainer launches on: the complement of decode's recent peak share) and
``PrefillPlacement`` (pure prefill steps). A mixed step (decode plus prefill chunks) takes the smallest share,
at least decode's own, that fits ``prefill_floor`` prefill tokens within the budget, filled with as many as
fit; the whole GPU with the trainer paused when none does. The whole GPU is the mixed step's only once the
trainer has nothing left on it: a pause launches nothing new, but the micro-steps it queued run on (up to
``max_in_flight`` of them, tens of milliseconds) on SMs the step counts as its own, so until they have ended
decode steps alone on its share, the trainer paused, and the prefill waits (docs/design.md has the
measurement).

``prefill_floor`` (``harli:floor=N``, default 128) is that least chunk: a smaller one keeps the trainer
running through more prompts, in more and smaller chunks. ``floor_match`` (``harli:floor=match``): where no
share fits the floor, a share that fits as many prefill tokens as the whole GPU would (its graphs' token
buckets can cap the whole GPU's chunk below the floor) is taken, the trainer running beside it, rather than
pausing the trainer for no larger a chunk.

``backward_aware`` (``harli:backward=on``) sizes a mixed step beside the trainer by the recent mixed steps
planned with a trainer backward on the GPU, when one is there now (``LatencyPredictor.correction``).

``grow_headroom`` (``harli:grow=H``, ``grow=0`` off) anticipates a grow: while decode's predicted step on its
share is within ``H`` of the budget, the trainer's next micro-steps go to a rung clear of the next larger
share too, since a grow would otherwise land on SMs where the trainer's queued work still runs.

``trainer_window_s`` (``harli:window=S``, default 0.3): how long the trainer's rung stays clear of a decode
share after decode last used it (``TrainerRungs``).

``launch_ahead`` (``harli:launch=ahead|wait``; None: the recipe's ``colocation.launch_ahead``): whether this
policy's steps are launched one ahead (``ColocatedRuntime._step``).

``handoff_gpu`` (``harli:handoff=gpu``): the whole-GPU mixed step is planned while the paused trainer's
queued work is still expected to run for less than the budget, its chunk sized for the budget less that
time, and starts on the GPU once that work has ended (``StepPlan.after_trainer``). Without it the step is
planned once that work is seen to have ended; where steps are launched ahead that is one step late, a step
decode runs alone on its share (``bench/step_breakdown.py``'s ``drain_alone_s``).

``neighbour_aware`` (``harli:neighbour=on``): a decode step beside the trainer is sized for the excess of
decode's prediction error learnt beside the kinds of micro-step the trainer has on the GPU as the step is
planned (``Controller``'s ``neighbours``).
"""

from __future__ import annotations

from harli_train.colocate.controller import Controller
from harli_train.colocate.neighbours import NeighbourExcess
from harli_train.colocate.policy.base import MIN_CHUNK, ControlledPolicy, Policy, chunk_fits, largest_chunk
from harli_train.colocate.policy.plan import IDLE_HORIZON_S, StepPlan, beside, paused
from harli_train.colocate.policy.prefill_placement import PrefillPlacement
from harli_train.colocate.policy.trainer_rungs import TrainerRungs
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import Partition, SMLadder
from harli_train.engine.step_work import StepPreview
from harli_train.policy_names import (
    DEFAULT_BACKWARD_AWARE,
    DEFAULT_FLOOR_MATCH,
    DEFAULT_GROW_HEADROOM,
    DEFAULT_HANDOFF_GPU,
    DEFAULT_LEARN_MARGIN,
    DEFAULT_NEIGHBOUR_AWARE,
    DEFAULT_PREFILL_AHEAD,
    DEFAULT_PREFILL_FLOOR,
    DEFAULT_SETTLE,
    DEFAULT_TRAINER_STRIDE,
    DEFAULT_TRAINER_WINDOW_S,
    PREFILL_MODES,
    harli_name,
)


class HarliPolicy(ControlledPolicy):
    """Dynamic SM partitioning: per step, the least decode share that meets the objective."""

    name = "harli"

    def __init__(
        self,
        ladder: SMLadder,
        predictor: LatencyPredictor,
        tpot_s: float,
        margin: float,
        hysteresis_steps: int = 8,
        trainer_window_s: float = DEFAULT_TRAINER_WINDOW_S,
        prefill_sms: int | None = None,
        prefill: str = PREFILL_MODES[0],
        trainer_stride: int = DEFAULT_TRAINER_STRIDE,
        grow_headroom: float = DEFAULT_GROW_HEADROOM,
        prefill_ahead: bool = DEFAULT_PREFILL_AHEAD,
        prefill_floor: int = DEFAULT_PREFILL_FLOOR,
        settle: bool = DEFAULT_SETTLE,
        learn_margin: bool = DEFAULT_LEARN_MARGIN,
        backward_aware: bool = DEFAULT_BACKWARD_AWARE,
        floor_match: bool = DEFAULT_FLOOR_MATCH,
        launch_ahead: bool | None = None,
        handoff_gpu: bool = DEFAULT_HANDOFF_GPU,
        neighbour_aware: bool = DEFAULT_NEIGHBOUR_AWARE,
    ) -> None:
        if not 0 <= grow_headroom < 0.5:
            raise ValueError(f"harli: grow_headroom must be in [0, 0.5), got {grow_headroom}")
        if prefill_floor < MIN_CHUNK:
            raise ValueError(f"harli: prefill_floor must be at least {MIN_CHUNK}, got {prefill_floor}")
        super().__init__(ladder, tpot_s, margin, predictor)
        self.name = harli_name(
            prefill,
            grow_headroom,
            prefill_ahead,
            settle,
            learn_margin,
            trainer_stride,
            backward_aware,
            prefill_floor,
            floor_match,
            trainer_window_s,
            launch_ahead,
            handoff_gpu=handoff_gpu,
            neighbour_aware=neighbour_aware,
        )
        self.launch_ahead, self.handoff_gpu = launch_ahead, handoff_gpu
        self.backward_aware = backward_aware
        self.grow_headroom, self.prefill_floor, self.floor_match = grow_headroom, prefill_floor, floor_match
        self._held = False  # the last plan paused the trainer
        self.rungs = TrainerRungs(ladder, trainer_stride, trainer_window_s)
        self.controller = Controller(
            predictor,
            ladder,
            tpot_s,
            margin,
            hysteresis_steps,
            settle=settle,
            learn_margin=learn_margin,
            neighbours=NeighbourExcess() if neighbour_aware else None,
        )
        self.prefill = PrefillPlacement(
            ladder,
            self.rungs,
            self.controller,
            prefill,
            prefill_sms,
            prefill_ahead,
            self._share_after,
            self.budget_s,
        )

    @property
    def trainer_rungs(self) -> list[Partition]:
        """The spatial rungs the trainer launches on (ascending decode share)."""
        return self.rungs.rungs

    def partitions(self) -> list[Partition]:
        return list(self.ladder.partitions)

    def trainer_partitions(self) -> list[Partition]:
        return [*self.rungs.rungs, self.ladder.full]

    def limit_trainer_streams(self, count: int) -> bool:
        return self.rungs.limit(count, self.share_weights())

    def share_weights(self, contexts: tuple[int, ...] = (256, 1024, 4096)) -> dict[int, float]:
        """How much the objective calls for each spatial decode share: over every batch the predictor was
        profiled for and each of ``contexts`` (cached tokens a sequence), 1 for the least share whose
        predicted step meets the budget and 1/2 for the share above it (the one a grow, or the trainer's trail
        of the recent peak, takes the trainer clear of)."""
        weights: dict[int, float] = {}
        shares = [p.infer_sms for p in self.ladder.spatial]
        for batch in range(1, max(self.predictor.batch_max, 1) + 1):
            for context in contexts:
                part, _ = self.controller.target(batch, batch * context)
                if part is None or part.infer_sms not in shares:
                    continue
                i = shares.index(part.infer_sms)
                weights[shares[i]] = weights.get(shares[i], 0.0) + 1.0
                if i + 1 < len(shares):
                    weights[shares[i + 1]] = weights.get(shares[i + 1], 0.0) + 0.5
        return weights

    def plan_step(self, preview: StepPreview) -> StepPlan:
        if preview.kind == "prefill":
            return self.prefill.plan(preview.decode_after())
        if preview.kind == "mixed" and self.predictor.mixed is not None:
            return self._mixed(preview)
        return self.with_chunk(
            self._decode(preview.decode_seqs, preview.decode_kv_tokens, preview.lora_slots), preview
        )

    def _decode(self, batch: int, kv_tokens: int, lora_slots: int = 0) -> StepPlan:
        beside = self.trainer_on_gpu() if self.controller.neighbours is not None else ()
        d = self.controller.decide(batch, kv_tokens, lora_slots, beside)
        if d.pause_trainer or d.mode == "alternate":
            return self.decode_plan(d, None)
        trainer = self.rungs.trail(d.partition.infer_sms)
        if self._near_budget(d.predicted_s):
            trainer = self.rungs.clear_of(trainer, self._next_share(d.partition))
        return self.decode_plan(d, trainer)

    def _mixed(self, preview: StepPreview) -> StepPlan:
        """A decode step carrying prefill chunks; a one-step detour: the controller's decode share and its
        shrink count are left as they are. Beside the trainer only while it runs: a mixed step never resumes
        a paused trainer (the next decode step does), since a chunk that fills the budget beside a trainer
        that is starting again overruns it (the measurements are in docs/design.md)."""
        if not self.ladder.time_sliced and not self._held:
            own, _ = self.controller.target(preview.decode_seqs, preview.decode_kv_tokens, preview.lora_slots)
            start = own.infer_sms if own is not None else self.ladder.total_sms
            backward = self.backward_aware and any(k in ("bwd", "rebuild") for k in self.trainer_on_gpu())
            floor = min(self.prefill_floor, preview.prefill_tokens)
            plan = self._beside(preview, floor, start, backward)
            if plan is None and self.floor_match:
                # No share beside the trainer fits the floor: would the whole GPU fit more than one does?
                whole, _, _ = largest_chunk(
                    self.predictor, preview, self.ladder.total_sms, False, self.budget_s
                )
                if whole < floor:
                    plan = self._beside(preview, whole, start, backward, matched=True)
            if plan is not None:
                return plan
        if not self.ladder.time_sliced and not self._held:
            return self._clear_gpu(preview)
        if not self.ladder.time_sliced and self.trainer_busy():
            handoff = self._hand_off(preview) if self.handoff_gpu else None
            return handoff or self._clear_gpu(preview)
        return self._whole_gpu(preview, self.budget_s)

    def _whole_gpu(self, preview: StepPreview, room_s: float, after_trainer: bool = False) -> StepPlan:
        """The mixed step on the whole GPU, the trainer paused, with as many prefill tokens as fit ``room_s``
        (``after_trainer``: it starts once the trainer's queued work has ended)."""
        n, t, raw = largest_chunk(self.predictor, preview, self.ladder.full.infer_sms, False, room_s)
        waits = "once the trainer's queued work ends" if after_trainer else "(trainer paused)"
        plan = paused(self.ladder.full, f"mixed: whole GPU for {n} prefill tokens {waits}", t)
        plan.prefill_tokens, plan.mixed_raw_s, plan.corun, plan.after_trainer = n, raw, False, after_trainer
        return plan

    def _hand_off(self, preview: StepPreview) -> StepPlan | None:
        """The whole-GPU mixed step launched while the paused trainer's queued work still runs, sized for the
        budget less the time that work is expected to run still; None where not even the least chunk fits."""
        room = self.budget_s - self.trainer_left_s()
        if room <= 0:
            return None
        plan = self._whole_gpu(preview, room, after_trainer=True)
        return plan if plan.predicted_s is not None and plan.predicted_s <= room else None

    def _beside(
        self, preview: StepPreview, floor: int, start: int, backward: bool, matched: bool = False
    ) -> StepPlan | None:
        """The mixed step on the smallest share of at least ``start`` SMs (decode's own) that fits ``floor``
        prefill tokens beside the running trainer (``backward``: sized as beside a trainer backward), filled
        with as many as fit there; None where none does."""
        for part in self.ladder.spatial:
            # One prediction rules out a share where even the floor does not fit; the bisection runs on the
            # share chosen (a mixed step's planning is host time inside its token interval).
            if part.infer_sms < start or not chunk_fits(
                self.predictor, preview, floor, part.infer_sms, True, self.budget_s, backward
            ):
                continue
            n, t, raw = largest_chunk(self.predictor, preview, part.infer_sms, True, self.budget_s, backward)
            if n < floor or t > self.budget_s:
                continue
            trainer = self.rungs.beside(part.infer_sms)
            if trainer is None or trainer.exclusive:
                return None
            reason = f"mixed: {part.infer_sms} SMs fit {n} prefill tokens"
            plan = beside(
                part,
                trainer,
                t,
                t,
                reason + (" (as many as the whole GPU)" if matched else ""),
                transient=True,
            )
            plan.prefill_tokens, plan.mixed_raw_s, plan.beside_backward = n, raw, backward
            return plan
        return None

    def _clear_gpu(self, preview: StepPreview) -> StepPlan:
        """Decode alone on its own share with the trainer paused and no prefill, while the trainer's queued
        micro-steps leave the GPU (the step before it may still have launched some)."""
        d = self.controller.decide(preview.decode_seqs, preview.decode_kv_tokens, preview.lora_slots)
        waiting = "the trainer's queued work ends" if self._held else "the trainer stops launching"
        plan = paused(
            d.partition,
            f"mixed: decode alone on {d.partition.infer_sms} SMs, its prefill waits until {waiting}",
            d.predicted_s,
            d,
        )
        plan.prefill_tokens = 0
        return plan

    def _drain_waits(self, preview: StepPreview, due: float) -> StepPlan:
        return self._clear_gpu(preview)

    def plan(self, preview: StepPreview) -> StepPlan:
        plan = super().plan(preview)
        self._held = plan.paused  # the trainer has been told to launch nothing more
        return plan

    def _share_after(self, batch: int, kv_tokens: int) -> int:
        """The decode share a step of ``batch`` x ``kv_tokens`` needs, one share more within the headroom."""
        part, t = self.controller.target(batch, kv_tokens)
        if part is None:
            return self.ladder.total_sms
        if self._near_budget(t):
            return self._next_share(part) or self.ladder.total_sms
        return part.infer_sms

    def _near_budget(self, predicted_s: float) -> bool:
        """A decode step predicted within ``grow_headroom`` of the budget: it may grow next."""
        return (
            bool(self.grow_headroom) and predicted_s > (1.0 - self.grow_headroom) * self.controller.budget_s
        )

    def _next_share(self, part: Partition) -> int | None:
        """The next larger spatial decode share than ``part``'s (None past the largest)."""
        return next((p.infer_sms for p in self.ladder.spatial if p.infer_sms > part.infer_sms), None)

    def idle_plan(self) -> StepPlan:
        trainer = None if self.ladder.time_sliced else self.rungs.trail(None)
        if trainer is None or trainer.exclusive:
            return Policy.idle_plan(self)
        return beside(trainer, trainer, IDLE_HORIZON_S, None, "idle (recent decode share kept)", strict=False)

    def observe(self, plan: StepPlan, measured_s: float) -> None:
        if plan.after_trainer:
            return  # its interval includes the wait for the trainer's queued work: no measure of the step
        if plan.transient and plan.mixed_raw_s is None:
            self.prefill.observe(measured_s)
            return
        super().observe(plan, measured_s)
