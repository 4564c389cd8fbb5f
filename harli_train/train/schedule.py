"""Learning-rate schedules: linear warm-up, then cosine, linear or constant down to min_lr_ratio * lr."""

from __future__ import annotations

import math


def lr_at(
    step: int, base_lr: float, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float = 0.0
) -> float:
    """Learning rate for optimizer step `step` (0-based). The schedule's whole state is the step count."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        factor = 1.0 - progress
    else:
        raise ValueError(f"unknown schedule {schedule!r} (cosine, linear, constant)")
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * factor)
