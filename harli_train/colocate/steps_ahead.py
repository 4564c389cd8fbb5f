"""StepsAhead: the plans of the steps the co-located loop launches one ahead (``colocation.launch_ahead``).

Launched ahead, a step's successor is on the GPU before the step's tokens are read back, so a call of
``ColocatedRuntime._step`` plans the step after the one in flight and completes the one launched before.
The rules, each stated once here:

- the step a call completes is recorded and learnt under the plan that launched it (``take``);
- a plan that slices time (the trainer runs after the step on its SMs) is never launched ahead, and a
  one-step detour (``transient``) only as the step it was made for (``may_launch``);
- a plan made for a successor the engine did not launch ahead (its trainer work fed, decode's share
  switched) is the step's plan in the next call when that call previews the same step, so the policy
  plans each step once (``take``, ``after_step``);
- the trainer's work under a plan waits on the GPU for the step in flight when the plan gives the trainer
  SMs that step runs on (``gate``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harli_train.colocate.policy import AFTER, StepPlan
from harli_train.engine.step_work import StepPreview

# (plan, the trainer's snapshot at its launch, the trainer's micro-steps on the GPU as it started)
Flying = tuple[StepPlan, Any, Any]


class StepsAhead:
    """The step in flight and the plan carried over to the next call; ``on``: steps are launched ahead."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.flying: Flying | None = None  # the step launched ahead, which the next call completes
        self._unlaunched: tuple[StepPlan, tuple] | None = None  # a plan carried out, its step not launched

    def take(self, in_flight: bool, preview: StepPreview) -> tuple[Flying | None, StepPlan | None]:
        """At the start of a call: (the step in flight that this call completes, when the engine still has
        one; the plan carried over for the step ``preview`` describes, when it was made for that step)."""
        done = self.flying if in_flight else None
        self.flying = None
        carried, self._unlaunched = self._unlaunched, None
        if done is None and carried is not None and carried[1] == preview_key(preview):
            return None, carried[0]
        return done, None

    def may_launch(self, plan: StepPlan, for_itself: bool) -> bool:
        """Whether the engine may launch a step ahead under ``plan``: the step it was made for
        (``for_itself``: it follows a step in flight), or the successor of the step it places now."""
        return self.on and may_launch_ahead(plan, for_itself)

    def after_step(
        self,
        plan: StepPlan | None,
        done: Flying | None,
        in_flight: bool,
        flying: Flying,
        preview: StepPreview,
    ) -> bool:
        """After the engine's step: keep ``flying`` (``plan``'s) when a step is now in flight under ``plan``
        (returns True), or carry ``plan`` over when it was made for a successor the engine did not launch."""
        if plan is not None and in_flight:
            self.flying = flying
            return True
        if plan is not None and done is not None and plan.train != AFTER:
            self._unlaunched = (plan, preview_key(preview))
        return False


def launches_ahead(policy_choice: bool | None, run_choice: bool | None) -> bool:
    """Whether a run launches steps ahead: its policy's own choice (``harli:launch=ahead|wait``) when it made
    one, else the run's (``colocation.launch_ahead``)."""
    return bool(run_choice if policy_choice is None else policy_choice)


def gate(plan: StepPlan, done: Flying | None, last_step_event: Callable[[], Any]) -> Any:
    """What the trainer's work under ``plan`` waits for on the GPU: the engine's last step (``done``'s plan
    placed it) when it runs on SMs ``plan`` gives the trainer (the whole GPU, or a larger share than
    decode's next), so that the step runs alone as it was planned (None: nothing to wait for)."""
    if done is None or not plan.isolated or plan.train_from_sm >= done[0].partition.infer_sms:
        return None
    return last_step_event()


def preview_key(preview: StepPreview) -> tuple:
    """What a plan is made from, of a preview:
    a plan made for one preview stands for another with the same."""
    return (
        preview.kind,
        preview.decode_seqs,
        preview.decode_kv_tokens,
        preview.prefill_tokens,
        preview.decode_adapters,
    )


def may_launch_ahead(plan: StepPlan, for_itself: bool) -> bool:
    """Whether a step may be launched ahead under ``plan`` (see ``StepsAhead.may_launch``): never when the
    trainer runs after the step on its SMs (time slicing);
    a one-step detour (``transient``) only for itself."""
    if plan.train == AFTER or plan.partition.time_sliced:
        return False
    return for_itself or not plan.transient
