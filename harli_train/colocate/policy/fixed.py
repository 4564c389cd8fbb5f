"""Fixed splits: ``static:N`` (decode on N SMs, the trainer always on the rest) and the exclusive references
(``exclusive``: decode alone while there is load, then the trainer alone; ``exclusive:N``: the trainer then
alone on ``static:N``'s trainer SMs)."""

from __future__ import annotations

from harli_train.colocate.policy.base import Policy
from harli_train.colocate.policy.plan import IDLE_HORIZON_S, StepPlan, beside, paused
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import Partition, SMLadder
from harli_train.engine.step_work import StepPreview


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

    def plan_step(self, preview: StepPreview) -> StepPlan:
        return self.with_chunk(
            beside(self.part, self.part, self.step_estimate.value, None, "static"), preview
        )

    def decode_alone(self) -> Partition:
        return self.part

    def idle_plan(self) -> StepPlan:
        return beside(self.part, self.part, IDLE_HORIZON_S, None, "idle (static)", strict=False)


class ExclusivePolicy(Policy):
    """Decode alone on the whole GPU while there is load; the trainer runs alone once the load is over: on
    the whole GPU, or with ``infer_sms`` (``exclusive:N``) on the trainer side of ``static:N``'s rung,
    decode's side left idle (the trainer's standalone rate on that split's SMs)."""

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

    def plan_step(self, preview: StepPreview) -> StepPlan:
        return self.with_chunk(paused(self.ladder.full, "exclusive: decode alone"), preview)

    def idle_plan(self) -> StepPlan:
        part = self.trainer_part
        if part is None:
            return super().idle_plan()
        return beside(part, part, IDLE_HORIZON_S, None, f"alone on {part.train_sms} SMs", strict=False)
