"""PrefillPlacement: where harli runs a pure prefill step (nothing decodes) and where the trainer goes then.

A prefill is compute-bound and outside the decode model. Modes (``harli:prefill=MODE``):
- ``rung`` (default): on a rung of its own (``prefill_sms``, half the GPU by default, as a fixed split
  would), the trainer going on on the other SMs.
- ``paused``: on the whole GPU with the trainer held back (what it has queued still runs).
- ``beside``: on the whole GPU, the trainer still launching on its trailing rung beside it (the two share the
  trainer's SMs for the prefill's length).
In ``rung`` and ``beside`` the plan is a transient detour: the trainer's rung does not trail it, and a
backward whose forward's SMs the prefill covers waits there (it is not rebuilt). While the controller holds
the whole GPU for decode, a prefill keeps the trainer paused: waking it would spill its micro-step into the
decode steps after the prefill.

With ``ahead`` (``harli:ahead=on``) the placement looks past the prefill: when the decode step after it (its
batch grown by the prompts the prefill finishes) needs more SMs than the trainer's rung leaves, the trainer
moves for the prefill's length to a rung clear of that share, or pauses when that step needs the whole GPU.
"""

from __future__ import annotations

from collections.abc import Callable

from harli_train.colocate.controller import Controller
from harli_train.colocate.policy.plan import Ewma, StepPlan, beside, paused
from harli_train.colocate.policy.trainer_rungs import TrainerRungs
from harli_train.colocate.sm import Partition, SMLadder
from harli_train.policy_names import PREFILL_MODES


class PrefillPlacement:
    """Plans pure prefill steps for harli; ``share_after(batch, kv)`` is the decode share the step after a
    prefill will need (harli's rule, headroom included)."""

    def __init__(
        self,
        ladder: SMLadder,
        rungs: TrainerRungs,
        controller: Controller,
        mode: str,
        prefill_sms: int | None,
        ahead: bool,
        share_after: Callable[[int, int], int],
        initial_s: float,
    ) -> None:
        if mode not in PREFILL_MODES:
            raise ValueError(f"harli: prefill mode is one of {PREFILL_MODES}, got {mode!r}")
        self.ladder, self.rungs, self.controller = ladder, rungs, controller
        self.mode, self.ahead, self.share_after = mode, ahead, share_after
        rung = rungs.select(prefill_sms if prefill_sms is not None else ladder.total_sms // 2)
        # On a ladder without partitions (time slicing) prefill keeps the whole GPU, the trainer paused.
        self.rung: Partition | None = None if ladder.time_sliced or rung.exclusive else rung
        self.estimate = Ewma(initial_s)  # the trainer work queued beside a prefill: about its length

    def plan(self, after: tuple[int, int] | None) -> StepPlan:
        """The plan of a prefill step; ``after`` is the (batch, KV tokens) of the decode step after it."""
        self.controller.restart_shrink_streak()
        full, tag = self.ladder.full, "prefill"
        if self.controller.holds_whole_gpu:
            return paused(full, f"{tag}: whole GPU, decode holds it (trainer stays paused)")
        if self.mode == "rung" and self.rung is not None:
            trainer, need = self._clear_of_next(self.rung, after)
            if need is None:
                return self._beside(self.rung, self.rung, f"{tag}: {self.rung.infer_sms} SMs")
            if trainer.exclusive:
                return paused(
                    full, f"{tag}: whole GPU, the decode after it needs {need} SMs (trainer paused)"
                )
            # Moved for the decode after it, the trainer leaves the prefill the rest of the GPU.
            return self._beside(
                trainer, trainer, f"{tag}: {trainer.infer_sms} SMs, the decode after it needs {need}"
            )
        trainer = None if self.ladder.time_sliced else self.rungs.trail(None)
        if self.mode == "paused" or trainer is None or trainer.exclusive:
            return paused(full, f"{tag}: whole GPU")
        trainer, need = self._clear_of_next(trainer, after)
        ahead = "" if need is None else f", the decode after it needs {need} SMs"
        if trainer.exclusive:
            return paused(full, f"{tag}: whole GPU{ahead} (trainer paused)")
        return self._beside(
            full, trainer, f"{tag}: whole GPU, trainer beside on {trainer.train_sms} SMs{ahead}"
        )

    def observe(self, measured_s: float) -> None:
        """A prefill step's measured latency."""
        self.estimate.update(measured_s)

    def _beside(self, decode: Partition, trainer: Partition, reason: str) -> StepPlan:
        return beside(decode, trainer, self.estimate.value, None, reason, strict=False, transient=True)

    def _clear_of_next(
        self, trainer: Partition, after: tuple[int, int] | None
    ) -> tuple[Partition, int | None]:
        """With ``ahead``: the trainer's rung clear of the share the decode step after the prefill needs (the
        full rung when none leaves decode that much: the trainer then pauses),
        and that share when it moved."""
        if not self.ahead or after is None or self.ladder.time_sliced:
            return trainer, None
        need = self.share_after(*after)
        if trainer.infer_sms >= need:
            return trainer, None
        return self.rungs.select(need), need
