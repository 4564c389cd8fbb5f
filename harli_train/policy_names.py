"""The co-location policies' names: the policies a recipe or ``--policy`` may name, harli's option grammar
(``harli:prefill=MODE,grow=H,...``) with its defaults, and the canonical name of a harli variant."""

from __future__ import annotations

import re
from typing import Any

# Named policies; besides them static:N (a fixed split at N SMs) and exclusive:N (exclusive's trainer alone on
# static:N's trainer SMs).
POLICIES = ("harli", "streams", "temporal", "exclusive")
PREFILL_MODES = ("rung", "paused", "beside")  # harli:prefill=MODE (the first is harli's default)
# harli:grow=H, harli's default: anticipate a grow while decode is within 5 % of its budget (0 turns it off).
DEFAULT_GROW_HEADROOM = 0.05
# harli:ahead=on: a prefill's trainer stays clear of the share the decode step after it will need.
DEFAULT_PREFILL_AHEAD = False
# harli:settle=on: a shrink must pay for the queued trainer work it strands (off until an A/B on the GPU says
# otherwise). harli:margin=learn (the default): the margin follows the prediction error observed, with
# colocation.margin its start; harli:margin=fixed keeps colocation.margin throughout.
DEFAULT_SETTLE = False
DEFAULT_LEARN_MARGIN = True
# harli:stride=N: the trainer launches on every N-th rung. Each rung's stream caches its own working set: when
# the memory holds fewer streams, the set-up keeps the rungs beside the decode shares the objective calls for
# most (TrainerRungs.limit).
DEFAULT_TRAINER_STRIDE = 1
# harli:backward=on: a mixed step planned with a trainer backward on the GPU is sized by the quantile of the
# recent ones (LatencyPredictor.correction). Off until an A/B on the GPU says otherwise.
DEFAULT_BACKWARD_AWARE = False
# harli:floor=N: the least prefill tokens (or the rest of the prompt, when fewer) a mixed step must fit on a
# share beside the trainer; where none fits that many, the mixed step takes the whole GPU, the trainer paused.
# A smaller floor keeps the trainer running through more prompts, in smaller chunks (more steps to the first
# token). At least the least chunk a mixed step takes (policy.base.MIN_CHUNK). harli:floor=match: the floor is
# at most what the whole GPU itself would fit in the step (a share beside the trainer that fits as much
# prefill as the whole GPU is taken rather than pausing the trainer).
DEFAULT_PREFILL_FLOOR = 128
MIN_PREFILL_FLOOR = 32
DEFAULT_FLOOR_MATCH = False
# harli:window=S: the trainer's rung stays clear of every decode share of the last S seconds
# (policy.trainer_rungs.TrainerRungs says why it trails decode's recent peak). A shorter window gives the
# trainer back the SMs of a one-off grow sooner, and strands more backwards on SMs decode takes back.
# 0.3 until an A/B on the GPU says otherwise.
DEFAULT_TRAINER_WINDOW_S = 0.3
MAX_TRAINER_WINDOW_S = 10.0
# harli:launch=ahead|wait: this policy's steps launched one ahead or not, whatever colocation.launch_ahead
# says (None: the recipe's): an A/B of launching ahead on one set-up.
LAUNCH_MODES = ("ahead", "wait")
# harli:handoff=gpu|host: how a prompt's whole-GPU mixed step follows the paused trainer's queued work. host
# (the default until an A/B on the GPU says otherwise): it is planned once the host sees that work ended, one
# step late where steps are launched ahead (decode runs alone meanwhile). gpu: it is planned while the work is
# expected to end within the budget, its chunk sized for the budget less that time, and waits for the work's
# end on the GPU.
HANDOFF_MODES = ("host", "gpu")
DEFAULT_HANDOFF_GPU = False
# harli:neighbour=on: a decode step beside the trainer is sized for the excess of decode's prediction error
# learnt beside the kinds of micro-step the trainer has on the GPU as the step is planned
# (colocate.neighbours.NeighbourExcess). Off until an A/B on the GPU says otherwise.
DEFAULT_NEIGHBOUR_AWARE = False
HARLI_OPTIONS = (
    f"harli:prefill={'|'.join(PREFILL_MODES)},grow=H (H in [0, 0.5), default {DEFAULT_GROW_HEADROOM:g}),"
    f"ahead=on|off (default {'on' if DEFAULT_PREFILL_AHEAD else 'off'}),settle=on|off (default off),"
    f"margin=learn|fixed (default {'learn' if DEFAULT_LEARN_MARGIN else 'fixed'}),"
    f"stride=N (N >= 1, default {DEFAULT_TRAINER_STRIDE}),"
    f"backward=on|off (default {'on' if DEFAULT_BACKWARD_AWARE else 'off'}),"
    f"floor=N|match (N >= {MIN_PREFILL_FLOOR}, default {DEFAULT_PREFILL_FLOOR}),"
    f"window=S (seconds in [0, {MAX_TRAINER_WINDOW_S:g}], default {DEFAULT_TRAINER_WINDOW_S:g}),"
    f"launch={'|'.join(LAUNCH_MODES)} (default: colocation.launch_ahead),"
    f"handoff={'|'.join(HANDOFF_MODES)} (default {HANDOFF_MODES[int(DEFAULT_HANDOFF_GPU)]}),"
    f"neighbour=on|off (default {'on' if DEFAULT_NEIGHBOUR_AWARE else 'off'})"
)


def parse_harli_options(text: str) -> dict[str, Any]:
    """``prefill=MODE,grow=H,ahead=on|off,settle=on|off,margin=learn|fixed,stride=N,backward=on|off,floor=N``,
    ``floor=match``, ``window=S``, ``launch=ahead|wait``, ``handoff=host|gpu`` and ``neighbour=on|off`` (any
    of them, in any order; "" for none) as HarliPolicy keyword arguments."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "prefill" and value in PREFILL_MODES:
            out["prefill"] = value
        elif key == "grow" and re.fullmatch(r"\d*\.?\d+", value) and float(value) < 0.5:
            out["grow_headroom"] = float(value)
        elif key == "ahead" and value in ("on", "off"):
            out["prefill_ahead"] = value == "on"
        elif key == "settle" and value in ("on", "off"):
            out["settle"] = value == "on"
        elif key == "margin" and value in ("learn", "fixed"):
            out["learn_margin"] = value == "learn"
        elif key == "stride" and re.fullmatch(r"[1-9]\d*", value):
            out["trainer_stride"] = int(value)
        elif key == "backward" and value in ("on", "off"):
            out["backward_aware"] = value == "on"
        elif key == "floor" and re.fullmatch(r"[1-9]\d*", value) and int(value) >= MIN_PREFILL_FLOOR:
            out["prefill_floor"] = int(value)
        elif key == "floor" and value == "match":
            out["floor_match"] = True
        elif key == "window" and re.fullmatch(r"\d*\.?\d+", value) and float(value) <= MAX_TRAINER_WINDOW_S:
            out["trainer_window_s"] = float(value)
        elif key == "launch" and value in LAUNCH_MODES:
            out["launch_ahead"] = value == "ahead"
        elif key == "handoff" and value in HANDOFF_MODES:
            out["handoff_gpu"] = value == "gpu"
        elif key == "neighbour" and value in ("on", "off"):
            out["neighbour_aware"] = value == "on"
        else:
            raise ValueError(f"unknown harli option {item!r} (options: {HARLI_OPTIONS})")
    return out


def harli_name(
    prefill: str = PREFILL_MODES[0],
    grow_headroom: float = DEFAULT_GROW_HEADROOM,
    prefill_ahead: bool = DEFAULT_PREFILL_AHEAD,
    settle: bool = DEFAULT_SETTLE,
    learn_margin: bool = DEFAULT_LEARN_MARGIN,
    trainer_stride: int = DEFAULT_TRAINER_STRIDE,
    backward_aware: bool = DEFAULT_BACKWARD_AWARE,
    prefill_floor: int = DEFAULT_PREFILL_FLOOR,
    floor_match: bool = DEFAULT_FLOOR_MATCH,
    trainer_window_s: float = DEFAULT_TRAINER_WINDOW_S,
    launch_ahead: bool | None = None,
    handoff_gpu: bool = DEFAULT_HANDOFF_GPU,
    neighbour_aware: bool = DEFAULT_NEIGHBOUR_AWARE,
) -> str:
    """The canonical name of a harli variant: options that differ from the defaults, in a fixed order."""
    options = [f"prefill={prefill}"] if prefill != PREFILL_MODES[0] else []
    if grow_headroom != DEFAULT_GROW_HEADROOM:
        options.append(f"grow={grow_headroom:g}")
    if prefill_ahead != DEFAULT_PREFILL_AHEAD:
        options.append(f"ahead={'on' if prefill_ahead else 'off'}")
    if settle != DEFAULT_SETTLE:
        options.append(f"settle={'on' if settle else 'off'}")
    if learn_margin != DEFAULT_LEARN_MARGIN:
        options.append(f"margin={'learn' if learn_margin else 'fixed'}")
    if trainer_stride != DEFAULT_TRAINER_STRIDE:
        options.append(f"stride={trainer_stride}")
    if backward_aware != DEFAULT_BACKWARD_AWARE:
        options.append(f"backward={'on' if backward_aware else 'off'}")
    if prefill_floor != DEFAULT_PREFILL_FLOOR:
        options.append(f"floor={prefill_floor}")
    if floor_match != DEFAULT_FLOOR_MATCH:
        options.append("floor=match")
    if trainer_window_s != DEFAULT_TRAINER_WINDOW_S:
        options.append(f"window={trainer_window_s:g}")
    if launch_ahead is not None:
        options.append(f"launch={'ahead' if launch_ahead else 'wait'}")
    if handoff_gpu != DEFAULT_HANDOFF_GPU:
        options.append(f"handoff={HANDOFF_MODES[int(handoff_gpu)]}")
    if neighbour_aware != DEFAULT_NEIGHBOUR_AWARE:
        options.append(f"neighbour={'on' if neighbour_aware else 'off'}")
    return "harli" + (":" + ",".join(options) if options else "")


def is_policy(v: str) -> bool:
    split = re.fullmatch(r"(?:static|exclusive):(\d+)", v)
    if split:
        return 1 <= int(split.group(1)) <= 1024
    base, sep, options = v.partition(":")
    if base == "harli" and sep:
        try:
            parse_harli_options(options)
        except ValueError:
            return False
        return bool(options)
    return v in POLICIES
