"""A tensor-parallel decode engine: one scheduler on rank 0, every rank running its slice of each step.

Rank 0 runs an ordinary ``DecodeEngine`` over its slice of the model (its KV cache holds its KV heads); its
runner publishes each forward's inputs (``StepInputs``: ids, positions, cache slots, block tables) over the
engine's control channel before running it. Every other rank runs ``follow_engine``: an engine of the same
configuration over its own slice, whose runner runs each published forward (``ModelRunner.follow``). The
all-reduces inside the layers and the logits' all-gather then pair up rank for rank. Only rank 0 samples
and keeps request state. Steps are never launched ahead under TP (the followers run what rank 0 published).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harli_train.engine import DecodeEngine, EngineConfig
from harli_train.engine.engine_config import EngineError
from harli_train.engine.kv_cache import KVCacheSpec, kv_cache_blocks
from harli_train.engine.step_inputs import StepInputs
from harli_train.parallel.channel import Channel, Message
from harli_train.parallel.collectives import local_only
from harli_train.parallel.group import TPGroups
from harli_train.parallel.share import AGREE, ShareAgreement

log = logging.getLogger(__name__)

DECODE, VARLEN, PARTITION, STOP = 1, 2, 3, 9
_KINDS = {"decode": DECODE, "varlen": VARLEN, "partition": PARTITION}


def engine_channel(tp: TPGroups) -> Channel:
    return Channel(tp.engine_ctl)


def publisher(channel: Channel) -> Callable[[StepInputs], None]:
    """The runner's ``publish`` hook on rank 0: each forward's inputs to the other ranks."""

    def publish(inputs: StepInputs) -> None:
        if inputs.kind == "partition":
            channel.send(PARTITION, [inputs.num_sms], inputs.partition)
            return
        arrays = [inputs.ids, inputs.positions, inputs.slots, inputs.context_lens, np.asarray(inputs.tables)]
        if inputs.kind == "varlen":
            arrays += [inputs.num_tokens, inputs.sampling]
        channel.send(_KINDS[inputs.kind], [], inputs.partition, arrays)

    return publish


def _inputs(msg: Message) -> StepInputs:
    if msg.kind == PARTITION:
        return StepInputs("partition", msg.text, num_sms=msg.ints[0])
    ids, positions, slots, lens, tables, *rest = msg.arrays
    kind = "decode" if msg.kind == DECODE else "varlen"
    inputs = StepInputs(kind, msg.text, ids.tolist(), positions, slots, lens, tables)
    if rest:
        inputs.num_tokens, inputs.sampling = rest[0].tolist(), rest[1].tolist()
    return inputs


def agreed_kv_blocks(model: Any, config: EngineConfig, tp: TPGroups) -> int:
    """The KV blocks every rank's cache gets: the least any rank's memory allows (each rank sizes its own
    cache of its heads without collectives, then the ranks take the minimum)."""
    spec = KVCacheSpec.for_model(model.config, config.block_size, model.lm_head.weight.dtype)
    with local_only():
        blocks = kv_cache_blocks(model, config, spec)
    t = torch.tensor([blocks], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.engine_ctl)
    return int(t.item())


def lead_engine(engine: DecodeEngine, tp: TPGroups) -> Channel:
    """Make rank 0's ``engine`` publish its forwards; returns the channel (``stop_followers`` ends them)."""
    if engine.overlap:
        raise EngineError("a tensor-parallel engine needs overlap=False (followers run published steps)")
    channel = engine_channel(tp)
    engine.runner.publish = publisher(channel)
    return channel


def stop_followers(channel: Channel) -> None:
    channel.send(STOP)


def follow_engine(
    engine: DecodeEngine,
    tp: TPGroups,
    stream_for: Callable[[str, int], Any] = lambda key, sms: None,
    agreement: ShareAgreement | None = None,
    propose: Callable[[int, int], int] | None = None,
) -> int:
    """Run rank 0's published forwards on this rank's ``engine`` until it stops them; returns how many
    steps ran. ``stream_for(key, num_sms)``: this rank's stream for a partition rank 0 registers;
    ``agreement``/``propose``: this rank's part in each step's share (``parallel.share``)."""
    channel, steps = engine_channel(tp), 0
    while True:
        msg = channel.recv()
        if msg.kind == STOP:
            return steps
        if msg.kind == AGREE:
            if agreement is None:
                raise EngineError("rank 0 asked for a share agreement this rank was not set up for")
            agreement.answer(msg.ints, propose)
            continue
        inputs = _inputs(msg)
        stream = stream_for(inputs.partition, inputs.num_sms) if inputs.kind == "partition" else None
        engine.runner.follow(inputs, stream)
        steps += inputs.kind != "partition"
