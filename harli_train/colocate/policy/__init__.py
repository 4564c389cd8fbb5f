"""Co-location policies: where each engine step runs and how much trainer work may go with it.

Every policy answers one question per engine step with a ``StepPlan`` (``plan.py``):

- ``harli``: the controller picks the least SM share that meets the TPOT objective each step; the trainer
  runs on the complementary SMs, pauses when no share fits, and alternates on a time-sliced ladder.
- ``static:N``: decode always on the N-SM rung, the trainer always on the rest.
- ``streams``: two ordinary streams (decode at high priority) over the whole GPU, no partition.
- ``temporal``: decode and trainer alternate on the whole GPU, the trainer filling the slack the
  objective leaves after each step (the controller's time-slicing mode).
- ``exclusive``: decode alone while there is load, then the trainer alone (the two references);
  ``exclusive:N``: the trainer then alone on ``static:N``'s trainer SMs (the reference for that split).

``make_policy`` is the one reader of the policy grammar.
"""

from __future__ import annotations

from harli_train.colocate.policy.base import (
    DRAIN_HEADROOM,
    MIN_CHUNK,
    ControlledPolicy,
    Policy,
    largest_chunk,
)
from harli_train.colocate.policy.fixed import ExclusivePolicy, StaticPolicy, split_rung
from harli_train.colocate.policy.harli import HarliPolicy
from harli_train.colocate.policy.plan import AFTER, BESIDE, IDLE_HORIZON_S, NONE, StepPlan
from harli_train.colocate.policy.streams import StreamsPolicy
from harli_train.colocate.policy.temporal import TemporalPolicy
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import SMLadder
from harli_train.config import DEFAULT_MARGIN
from harli_train.policy_names import parse_harli_options

__all__ = [
    "AFTER",
    "BESIDE",
    "IDLE_HORIZON_S",
    "DRAIN_HEADROOM",
    "MIN_CHUNK",
    "NONE",
    "ControlledPolicy",
    "ExclusivePolicy",
    "HarliPolicy",
    "Policy",
    "StaticPolicy",
    "StepPlan",
    "StreamsPolicy",
    "TemporalPolicy",
    "largest_chunk",
    "make_policy",
    "needs_partitions",
    "profile_shares",
    "split_rung",
]


def make_policy(
    name: str,
    ladder: SMLadder,
    predictor: LatencyPredictor | None,
    tpot_s: float,
    margin: float = DEFAULT_MARGIN,
    hysteresis_steps: int = 8,
) -> Policy:
    """The policy a recipe or ``--policy`` names: harli[:options], static:N, streams, temporal, exclusive or
    exclusive:N. ValueError names what is wrong."""
    if name.startswith("static:"):
        return StaticPolicy(ladder, int(name.split(":", 1)[1]), tpot_s, margin, predictor)
    if name.startswith("exclusive:"):
        return ExclusivePolicy(ladder, tpot_s, margin, predictor, int(name.split(":", 1)[1]))
    base, _, option = name.partition(":")
    if name == "temporal" or base == "harli":
        if predictor is None:
            raise ValueError(f"policy {name!r} needs a latency predictor (a decode profile)")
        if name == "temporal":
            return TemporalPolicy(ladder, predictor, tpot_s, margin, hysteresis_steps)
        return HarliPolicy(ladder, predictor, tpot_s, margin, hysteresis_steps, **parse_harli_options(option))
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
