"""Policy, the base every co-location policy refines, and the one rule that sizes a mixed step's chunk."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any

from harli_train.colocate.controller import Controller, Decision
from harli_train.colocate.mixed_model import attention_pairs
from harli_train.colocate.policy.plan import IDLE_HORIZON_S, Ewma, StepPlan, after, beside, paused, whole_gpu
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import Partition, SMLadder
from harli_train.engine.step_work import StepPreview

MIN_CHUNK = 32  # prefill tokens a mixed step takes even where fewer would fit: prefill must progress
# A backlog of prompts is drained on the whole GPU once this many times the time it needs there is all that
# is left before a prompt's deadline (ttft_plan). The time is predicted, and predictions of mixed steps miss
# both ways; a drain started at the last moment goes past the TPOT budget (docs/design.md, "Measured facts
# behind the defaults").
DRAIN_HEADROOM = 2.0


def mixed_raw_s(predictor: LatencyPredictor, preview: StepPreview, n: int, sms: int, corun: bool) -> float:
    """The uncorrected predicted seconds of ``preview``'s mixed step on ``sms`` with ``n`` prefill tokens (its
    adapters: the decode rows' and those of the chunks it takes)."""
    pairs = attention_pairs([(p.tokens, p.context) for p in preview.take(n)])
    return predictor.predict_mixed(
        preview.decode_seqs,
        preview.decode_kv_tokens,
        n,
        pairs,
        sms,
        corun,
        raw=True,
        lora_slots=preview.adapters(n),
    )


def graph_room(predictor: LatencyPredictor, preview: StepPreview) -> int:
    """The most prefill tokens a mixed step beside ``preview``'s decode rows may take and still replay a
    CUDA graph: the largest token bucket less the decode rows (all that is pending where the engine runs
    mixed steps eagerly). A step past it runs eagerly, which costs more than the tokens it adds."""
    buckets = predictor.mixed.buckets if predictor.mixed is not None else ()
    if not buckets:
        return preview.prefill_tokens
    return max(buckets[-1] - preview.decode_seqs, 1)


def chunk_fits(
    predictor: LatencyPredictor,
    preview: StepPreview,
    n: int,
    sms: int,
    corun: bool,
    budget_s: float,
    beside_backward: bool = False,
) -> bool:
    """Whether the mixed step of ``preview`` with ``n`` prefill tokens on ``sms`` is predicted within
    ``budget_s`` (corrected as ``largest_chunk`` corrects it): one prediction."""
    corr = predictor.correction(sms, corun, mixed=True, beside_backward=beside_backward)
    return mixed_raw_s(predictor, preview, n, sms, corun) * corr <= budget_s


def largest_chunk(
    predictor: LatencyPredictor,
    preview: StepPreview,
    sms: int,
    corun: bool,
    budget_s: float,
    beside_backward: bool = False,
) -> tuple[int, float, float]:
    """The most prefill tokens of ``preview`` whose mixed step on ``sms`` is predicted within ``budget_s``
    (at least ``MIN_CHUNK`` or all that is pending, whichever is less; at most ``graph_room``), with the
    step's corrected and raw prediction (``beside_backward``: corrected as a co-run step beside a trainer
    backward, see ``LatencyPredictor.correction``). The cost grows with the tokens, so a bisection finds it
    in ~log2(pending) predictions."""
    corr = predictor.correction(sms, corun, mixed=True, beside_backward=beside_backward)

    def raw(n: int) -> float:
        return mixed_raw_s(predictor, preview, n, sms, corun)

    hi = min(preview.prefill_tokens, graph_room(predictor, preview))
    lo = min(MIN_CHUNK, hi)
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


class Policy:
    """Base: decode on the whole GPU, the trainer beside it when idle; subclasses override ``plan``.

    With a predictor that models mixed steps, every policy sizes the prefill chunk riding in a decode step
    the same way (``chunk``): the most prefill tokens whose mixed step on the step's share is predicted
    within the budget, so each policy keeps the objective by its own share and none is favoured."""

    name = "policy"
    serve_alone = False  # the trainer waits until the load is over (exclusive)
    launch_ahead: bool | None = None  # steps launched one ahead whatever the run's options say (None: theirs)

    def __init__(
        self, ladder: SMLadder, tpot_s: float, margin: float, predictor: LatencyPredictor | None = None
    ) -> None:
        self.ladder, self.tpot_s, self.margin = ladder, tpot_s, margin
        self.budget_s = tpot_s * (1.0 - margin)
        self.ttft_s: float | None = None  # the TTFT objective (colocation.ttft_ms), if any: see ttft_plan
        # Whether the trainer may have work on the GPU now (the runtime's TrainerWorker.gpu_busy): a plan
        # that pauses the trainer launches nothing new, but what it queued runs on.
        self.trainer_busy: Callable[[], bool] = lambda: False
        # Estimated seconds until the trainer's queued work ends on the GPU (the runtime's
        # TrainerWorker.gpu_left_s; infinite while it may still launch more).
        self.trainer_left_s: Callable[[], float] = lambda: 0.0
        # The kinds of the trainer's micro-steps on the GPU now (the runtime's TrainerSnapshot.on_gpu).
        self.trainer_on_gpu: Callable[[], tuple[str, ...]] = lambda: ()
        self.step_estimate = Ewma(self.budget_s / 2)
        self.predictor = predictor
        self._full_prefill_rate: float | None = None  # see ttft_plan

    def partitions(self) -> list[Partition]:
        """Every partition a step may run on (the engine prepares each one's decode graphs)."""
        return [self.ladder.full]

    def trainer_partitions(self) -> list[Partition]:
        """The partitions whose trainer streams the trainer launches on (warmed up before serving)."""
        return self.partitions()

    def limit_trainer_streams(self, count: int) -> bool:
        """Launch the trainer on at most ``count`` streams besides the whole GPU's (each grows its own copy
        of the trainer's working set in torch's cache); whether the policy dropped any.
        This one's are fixed."""
        return False

    def plan(self, preview: StepPreview) -> StepPlan:
        """Where the step ``preview`` describes runs, its prefill budget, and what the trainer does: the
        TTFT objective's plan when a prompt is due (``ttft_plan``), else the policy's own (``plan_step``)."""
        return self.ttft_plan(preview) or self.plan_step(preview)

    def plan_step(self, preview: StepPreview) -> StepPlan:
        """The policy's own plan for the step ``preview`` describes."""
        raise NotImplementedError

    def ttft_plan(self, preview: StepPreview) -> StepPlan | None:
        """With a TTFT objective (``ttft_s``): the step that keeps every pending prompt's first token within
        the objective less the margin (its deadline), when the policy's own plan might not; None otherwise.
        A drain whose least chunk would overrun the TPOT budget beside the trainer's queued work waits for
        that work to leave (``_drain_waits``) while every prompt's drain, at that overrunning pace, would
        still end a step before its deadline.

        Prompts are computed in line (``preview.pieces``, their waits in ``prefill_waits``). The whole GPU,
        the trainer launching nothing new (what it queued runs on: the step is predicted as co-run while
        ``trainer_busy``), computes ``fit`` prefill tokens a step within the TPOT budget (``chunk``), a step
        lasting ``period`` (its prediction). A prompt with ``c`` tokens up to its end needs
        ``ceil(c / fit)`` such steps: once ``DRAIN_HEADROOM`` times the time they take, plus this step, is all
        that is left before its deadline, this step is the whole GPU's with ``fit`` tokens, so a burst is
        drained at the TPOT budget before any prompt is due. Where the steps left before a deadline are
        fewer than it needs, the step takes enough to reach that prompt in them (all of it when none is
        left), past the TPOT budget: the objective the user set bounds how far the TPOT budget may throttle
        prefill. Without a mixed model: the first prompt, all of it, once it is due."""
        waits = preview.prefill_waits
        if self.ttft_s is None or preview.kind != "mixed" or not waits:
            return None
        deadline = self.ttft_s * (1.0 - self.margin)
        slack = [deadline - w for w in waits]
        reach = list(accumulate(p.tokens for p in preview.pieces[: len(waits)]))
        rate = self._full_prefill_rate  # tokens/s of the whole GPU at the budget, when last computed
        far = 2.0 * DRAIN_HEADROOM
        if rate and all(s > far * (c / rate + self.budget_s) for s, c in zip(slack, reach, strict=True)):
            return None  # far from every deadline: no bisection (it is host time in the token interval)
        full, corun = self.ladder.full, self.trainer_busy()
        fit, period, _ = self.chunk(preview, full.infer_sms, corun)
        if fit is None or period is None:
            if slack[0] > 0:
                return None
            n = preview.pieces[0].tokens
        else:
            period = max(period, 1e-4)
            self._full_prefill_rate = fit / period
            n, wait = 0, corun and period > self.budget_s
            for s, c in zip(slack, reach, strict=True):
                steps = -(-c // fit)
                if s >= (DRAIN_HEADROOM * steps + 1) * period:
                    continue  # in time even if this step computed none of it
                left = int(s // period)  # whole-GPU steps that end before its deadline, this one included
                n = max(n, fit if left >= steps else -(-c // max(left, 1)))
                wait = wait and s >= (steps + 2) * period  # this step, the drain's, and one to spare
            if n == 0:
                return None
            if wait:
                return self._drain_waits(preview, min(slack) + self.ttft_s * self.margin)
        n = min(n, preview.prefill_tokens)
        raw = predicted = None
        if fit is not None:  # a mixed model: the step's prediction, for the record and the correction
            n = min(n, graph_room(self.predictor, preview))  # past the largest graph it would run eagerly
            raw = mixed_raw_s(self.predictor, preview, n, full.infer_sms, corun)
            predicted = raw * self.predictor.correction(full.infer_sms, corun, mixed=True)
        due = min(slack) + self.ttft_s * self.margin
        plan = paused(full, f"ttft: a prompt due in {due * 1e3:.0f} ms: {n} prefill tokens now", predicted)
        plan.prefill_tokens, plan.mixed_raw_s, plan.corun = n, raw, corun
        return plan

    def decode_alone(self) -> Partition:
        """Where decode runs while the trainer's queued work leaves the GPU: the whole GPU here; a policy
        whose decode has SMs of its own, there (clear of that work)."""
        return self.ladder.full

    def _drain_waits(self, preview: StepPreview, due: float) -> StepPlan:
        """The step before a drain whose least chunk overruns the TPOT budget beside the trainer's queued
        work (``ttft_plan``): decode alone (``decode_alone``), no prefill, the trainer launching nothing new,
        so that the drain starts once that work has left the GPU."""
        reason = f"ttft: a prompt due in {due * 1e3:.0f} ms: decode alone until the trainer's queue ends"
        plan = paused(self.decode_alone(), reason)
        plan.prefill_tokens = 0
        return plan

    def idle_plan(self) -> StepPlan:
        """Where the trainer runs when there is nothing to decode: the whole GPU."""
        return whole_gpu(self.ladder.full, self.ladder.total_sms, IDLE_HORIZON_S, "idle", strict=False)

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
        """The measured latency of the step ``plan`` planned."""
        if plan.mixed_raw_s is not None and self.predictor is not None:
            self.predictor.observe(
                plan.partition.infer_sms, plan.corun, measured_s, plan.mixed_raw_s, True, plan.beside_backward
            )
            return
        self.step_estimate.update(measured_s)

    def observe_train_slice(self, seconds: float) -> None:
        """Typical duration of one micro-step, reported by the trainer's side."""

    def summary(self) -> dict[str, Any]:
        return {"policy": self.name}

    @property
    def margin_learned(self) -> bool:
        """Whether the margin in force follows the observed prediction error (``margin``: its start)."""
        return False


class ControlledPolicy(Policy):
    """A policy whose decode steps a ``Controller`` places (harli, temporal): it learns from every decode
    step the controller decided and reports the controller in its summary."""

    controller: Controller

    def observe(self, plan: StepPlan, measured_s: float) -> None:
        super().observe(plan, measured_s)
        if plan.mixed_raw_s is None and plan.decision is not None:
            self.controller.observe(plan.decision, measured_s)
        elif plan.mixed_raw_s is not None and plan.predicted_s:
            self.controller.observe_margin(measured_s, plan.predicted_s)  # its chunk was sized to the budget
        self.budget_s = self.controller.budget_s  # a learnt margin moves it

    def observe_train_slice(self, seconds: float) -> None:
        self.controller.observe_train_slice(seconds)

    def decode_plan(self, d: Decision, trainer: Partition | None) -> StepPlan:
        """The plan of decision ``d``: paused, time-sliced (the slack after the predicted step) or the
        trainer beside decode on ``trainer``'s rung."""
        if d.pause_trainer:
            return paused(d.partition, d.reason, d.predicted_s, d)
        if d.mode == "alternate" or trainer is None:
            slack = max(self.controller.budget_s - d.predicted_s, 0.0)
            return after(d.partition, self.ladder.total_sms, slack, d)
        return beside(d.partition, trainer, d.predicted_s, d.predicted_s, d.reason, d)

    def summary(self) -> dict[str, Any]:
        return {"policy": self.name, "controller": self.controller.summary()}

    @property
    def margin_learned(self) -> bool:
        return self.controller.learned_margin is not None
