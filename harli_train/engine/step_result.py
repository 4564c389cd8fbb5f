"""What one engine step did (``StepResult``),
and the error of a request that can never run (``RequestRefused``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harli_train.engine.engine_config import EngineError
from harli_train.engine.sequence import Sequence


class RequestRefused(EngineError):
    """A request that can never run in this engine (too long for the model length or the whole cache);
    `seq` is its sequence, finished with finish_reason 'refused' and `error` set."""

    def __init__(self, message: str, seq: Sequence):
        super().__init__(message)
        self.seq = seq


@dataclass(slots=True)
class StepResult:
    """What one `step()` did; `latency_s` spans scheduling, the model, sampling and bookkeeping."""

    kind: str  # "decode", "mixed" (decode rows and prefill chunks), "prefill" or "idle" (nothing to run)
    num_seqs: int = 0
    num_tokens: int = 0
    kv_tokens: int = 0
    num_decode: int = 0  # decode rows (each drew a token a running request waited for)
    prefill_tokens: int = 0
    latency_s: float = 0.0
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    gpu_s: float | None = None  # the step's span on its stream (GPU only): latency_s less this is host time
    launch_s: float | None = None  # host time queuing the step's work (GPU only), which gpu_s includes
    adapter_rows: int = 0  # rows that ran on an adapter slot (the step's LoRA work)
    # The part of launch_s until the model's forward was queued (its inputs staged, its graph replayed or its
    # kernels launched); the rest queued the sampling and the tokens' copy (GPU only).
    forward_launch_s: float | None = None
