"""RUN_DIR/loss.png: the training loss over steps, and the eval loss where metrics.jsonl has one."""

from __future__ import annotations

import json
import math
from pathlib import Path

LOSS_PLOT = "loss.png"


def read_losses(metrics: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, loss) and (step, eval_loss) pairs of a metrics.jsonl file, in file order; lines that are not
    JSON records (a torn last line) and non-finite or missing values are skipped."""
    train, evals = [], []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        for key, out in (("loss", train), ("eval_loss", evals)):
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out.append((record["step"], float(value)))
    return train, evals


def plot_loss(metrics: Path, out: Path, title: str = "") -> Path | None:
    """Write the loss curve of `metrics` to `out` (matplotlib, Agg); None (nothing written) when the file
    holds no loss yet."""
    train, evals = read_losses(metrics)
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot(*zip(*train, strict=True), color="tab:blue", lw=1.2, label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), color="tab:orange", lw=1.5, marker="o", ms=4, label="eval loss")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss (nats per target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "loss")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
