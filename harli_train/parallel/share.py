"""The decode share every rank runs a step on: each rank's controller proposes one, the largest wins.

A tensor-parallel decode step is as slow as its slowest rank (every layer ends in an all-reduce), so the
ranks agree before each step on the largest share any of them asks for (an all-reduce max over the engine's
control group). NCCL's kernels run on the decode stream's SMs too and need all their thread blocks resident
at once (they spin on each other), so no share is below the CTAs NCCL may launch (``nccl_sms``): the process
sets NCCL_MAX_CTAS to ``DEFAULT_NCCL_CTAS`` unless the environment names a limit.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harli_train.parallel.channel import Channel

AGREE = 4  # the engine channel's message kind: rank 0 asks for proposals
DEFAULT_NCCL_CTAS = 16


def limit_nccl_ctas() -> None:
    """Cap NCCL's thread blocks per collective (before the communicators exist), unless already set."""
    if "NCCL_MAX_CTAS" not in os.environ and "NCCL_MAX_NCHANNELS" not in os.environ:
        os.environ["NCCL_MAX_CTAS"] = str(DEFAULT_NCCL_CTAS)


def nccl_sms(device: torch.device) -> int:
    """The SMs a decode share must hold for NCCL's kernels: 0 on a CPU (gloo runs on the host)."""
    if device.type != "cuda":
        return 0
    limit = os.environ.get("NCCL_MAX_CTAS") or os.environ.get("NCCL_MAX_NCHANNELS")
    return int(limit) if limit else DEFAULT_NCCL_CTAS


class ShareAgreement:
    """``agree`` on rank 0 (it asks the others over the engine's control channel), ``answer`` on the others
    when that message arrives; both return the agreed share."""

    def __init__(self, channel: Channel, group: Any, floor: int):
        self.channel, self.group, self.floor = channel, group, floor
        self.raised = 0  # steps whose share another rank (or NCCL's floor) raised

    def _reduce(self, share: int) -> int:
        t = torch.tensor([max(share, self.floor)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def agree(self, share: int, batch: int = 0, kv_tokens: int = 0) -> int:
        self.channel.send(AGREE, [share, batch, kv_tokens])
        agreed = self._reduce(share)
        self.raised += agreed > share
        return agreed

    def answer(self, ints: list[int], propose: Callable[[int, int], int] | None = None) -> int:
        """``propose(batch, kv_tokens)``: this rank's own share for the step (None: no opinion, 0)."""
        _, batch, kv_tokens = ints
        return self._reduce(propose(batch, kv_tokens) if propose is not None else 0)


class AgreedPolicy:
    """``policy`` whose every plan runs on the share the ranks agree on (the policy's own, or the smallest of
    its partitions that holds a larger one asked for elsewhere); everything else is the policy's."""

    def __init__(self, policy: Any, agreement: ShareAgreement):
        self._policy, self.agreement = policy, agreement

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def plan(self, preview: Any) -> Any:
        plan = self._policy.plan(preview)
        own = plan.partition.infer_sms
        agreed = self.agreement.agree(own, preview.decode_seqs, preview.decode_kv_tokens)
        if agreed <= own:
            return plan
        bigger = sorted(
            (p for p in self._policy.partitions() if p.infer_sms >= agreed), key=lambda p: p.infer_sms
        )
        part = bigger[0] if bigger else self._policy.ladder.full
        return dataclasses.replace(
            plan,
            partition=part,
            train_stream=part.train_stream,
            train_sms=0 if plan.paused else part.train_sms,
            train_from_sm=part.infer_sms if plan.isolated else plan.train_from_sm,
            reason=f"{plan.reason}; share raised to {agreed} SMs across ranks",
        )
