"""``streams``: two ordinary streams over the whole GPU, decode at the higher priority, no partition."""

from __future__ import annotations

from harli_train.colocate.policy.base import Policy
from harli_train.colocate.policy.plan import IDLE_HORIZON_S, StepPlan, whole_gpu
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import Partition, SMLadder
from harli_train.engine.step_work import StepPreview


def whole_gpu_pair(ladder: SMLadder) -> Partition:
    """Decode on the full rung's high-priority stream, the trainer on its ordinary stream, no partition."""
    full = ladder.full
    return Partition(
        ladder.total_sms,
        ladder.total_sms,
        full.infer_stream,
        full.train_stream,
        index=full.index,
        infer_event=full.infer_event,
    )


class StreamsPolicy(Policy):
    """Two ordinary streams over the whole GPU, decode at the higher priority."""

    name = "streams"

    def __init__(
        self, ladder: SMLadder, tpot_s: float, margin: float, predictor: LatencyPredictor | None = None
    ) -> None:
        super().__init__(ladder, tpot_s, margin, predictor)
        self.part = whole_gpu_pair(ladder)

    def trainer_partitions(self) -> list[Partition]:
        return [self.part]

    def plan_step(self, preview: StepPreview) -> StepPlan:
        plan = whole_gpu(self.part, self.ladder.total_sms, self.step_estimate.value, "streams")
        return self.with_chunk(plan, preview)

    def idle_plan(self) -> StepPlan:
        return whole_gpu(self.part, self.ladder.total_sms, IDLE_HORIZON_S, "idle", strict=False)
