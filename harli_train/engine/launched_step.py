"""Where a step runs (``Partition``) and a step whose work is queued on the device (``LaunchedStep``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harli_train.engine.step_work import ScheduledBatch


@dataclass(slots=True)
class Partition:
    """Where a step runs: a stream (None: the current one) owning `num_sms` SMs."""

    stream: torch.cuda.Stream | None
    num_sms: int


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued on the device: `read()` waits for it and returns the drawn token of each
    sequence of the batch (None for those that draw nothing). `tokens` stays on the device, so the next
    decode step can take its input ids from it before they reach the host."""

    batch: ScheduledBatch
    sampling: list[int]  # rows of the batch that draw a token
    tokens: torch.Tensor | None  # [len(sampling)] int64, on the device
    host: torch.Tensor | None  # pinned [>= len(sampling)] int64 the tokens are copied into (GPU)
    event: torch.cuda.Event | None  # recorded after that copy (GPU)
    start: torch.cuda.Event | None = None  # recorded before the step's work, on the same stream (GPU)
    launch_s: float | None = None  # host seconds from `start` to `event` (GPU): a stream waiting for its host
    partition: str | None = None  # the key of the partition it was launched on
    forward_s: float | None = None  # the part of `launch_s` until the model's forward was queued (GPU)

    def gpu_s(self) -> float | None:
        """Seconds from the stream reaching the step to its tokens' copy (after `read()`; None on a CPU).
        Against the step's wall time it tells a slow GPU from a host delay."""
        if self.start is None or self.event is None:
            return None
        return self.start.elapsed_time(self.event) * 1e-3

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def read(self) -> list[int | None]:
        self.wait()
        out: list[int | None] = [None] * len(self.batch.seqs)
        if self.tokens is None:
            return out
        drawn = (self.host if self.host is not None else self.tokens)[: len(self.sampling)].tolist()
        for i, token in zip(self.sampling, drawn, strict=True):
            out[i] = token
        return out
