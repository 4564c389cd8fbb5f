"""``temporal``: decode and trainer alternate on the whole GPU, the trainer filling the slack the objective
leaves after each decode step (the controller's time-slicing mode over a one-rung view of the GPU)."""

from __future__ import annotations

from harli_train.colocate.controller import Controller
from harli_train.colocate.policy.base import ControlledPolicy
from harli_train.colocate.policy.plan import IDLE_HORIZON_S, StepPlan, paused, whole_gpu
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import Partition, SMLadder, TimeSliceLadder
from harli_train.engine.step_work import StepPreview


def time_slice_view(ladder: SMLadder) -> TimeSliceLadder:
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
    )
    return TimeSliceLadder(
        [part], ladder.total_sms, kind="timeslice-view", device=ladder.device, time_sliced=True
    )


class TemporalPolicy(ControlledPolicy):
    """Alternation on the whole GPU: prefill work alone, each decode step followed by the slack's worth of
    trainer work (none when the step alone fills the budget)."""

    name = "temporal"

    def __init__(
        self,
        ladder: SMLadder,
        predictor: LatencyPredictor,
        tpot_s: float,
        margin: float,
        hysteresis_steps: int = 8,
    ) -> None:
        super().__init__(ladder, tpot_s, margin, predictor)
        self.slices = time_slice_view(ladder)
        self.controller = Controller(predictor, self.slices, tpot_s, margin, hysteresis_steps)

    def partitions(self) -> list[Partition]:
        return [self.slices.full]

    def trainer_partitions(self) -> list[Partition]:
        return [self.slices.full]

    def plan_step(self, preview: StepPreview) -> StepPlan:
        if preview.kind != "decode":  # prefill work: alone on the whole GPU
            return self.with_chunk(paused(self.slices.full, f"{preview.kind}: whole GPU"), preview)
        d = self.controller.decide(preview.decode_seqs, preview.decode_kv_tokens, preview.lora_slots)
        return self.decode_plan(d, None)

    def idle_plan(self) -> StepPlan:
        # Decode shares the trainer's stream: a request that arrives waits for everything queued there, so
        # idle time keeps one micro-step queued, not the runtime's usual two.
        return whole_gpu(
            self.slices.full, self.ladder.total_sms, IDLE_HORIZON_S, "idle", strict=False, max_queued=1
        )
