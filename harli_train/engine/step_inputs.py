"""What a model runner needs to run one step's forward, once the scheduler has decided it.

Rank 0 of a tensor-parallel engine publishes these (``ModelRunner.publish``) so that every other rank runs
the same forward over its own slice of the model and its own heads of the KV cache (``ModelRunner.follow``),
without a scheduler or block manager of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class StepInputs:
    """``kind``: 'decode' (one token per row), 'varlen' (packed rows of new tokens over their caches) or
    'partition' (register ``partition`` with ``num_sms`` SMs: on a GPU, capture its graphs)."""

    kind: str
    partition: str
    ids: list[int] = field(default_factory=list)
    positions: np.ndarray | None = None
    slots: np.ndarray | None = None
    context_lens: np.ndarray | None = None
    tables: np.ndarray | None = None
    num_tokens: list[int] = field(default_factory=list)  # varlen: new tokens per row
    sampling: list[int] = field(default_factory=list)  # varlen: rows whose last token gets logits
    num_sms: int = 0
