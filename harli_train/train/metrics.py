"""Training metrics: one JSON line per optimizer step; a progress bar on a terminal, log lines elsewhere."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from harli_train.train.checkpoint import CheckpointError
from harli_train.train.log_sinks import Sink

log = logging.getLogger(__name__)


def memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def progress_bar(console: Any = None, get_time: Callable[[], float] | None = None) -> Any:
    """The training progress bar (rich): "train", a 20-cell bar, steps done/total, the time left, then the
    task's `status` field. Only the status gives way to a narrow terminal (it is cut with an ellipsis), so
    the bar, the step count and the time left stay whole down to about 60 columns."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TimeRemainingColumn
    from rich.text import Text

    class StatusColumn(ProgressColumn):
        # A column rich may shrink (it shrinks wrappable ones first), whose text never wraps to a second line.
        def render(self, task: Any) -> Text:
            return Text(task.fields.get("status", ""), no_wrap=True, overflow="ellipsis")

    extra = {} if get_time is None else {"get_time": get_time}
    return Progress(
        "train",
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        StatusColumn(),
        console=console,
        transient=False,
        **extra,
    )


def _read_steps(path: Path) -> list[tuple[str, int]]:
    """(line, step) for each record in a metrics file. A torn last line (the run was killed mid-write) is
    dropped with a warning; a damaged line before it is a CheckpointError naming the file and line."""
    lines = path.read_text(errors="replace").splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        try:
            step = json.loads(line)["step"]
            if not isinstance(step, int):
                raise TypeError(f"step {step!r} is not an integer")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            if number == len(lines):
                log.warning(
                    "%s: dropping its torn last line %d (a run was killed while writing it)", path, number
                )
                break
            raise CheckpointError(
                f"{path}: line {number} is not a metrics record ({type(e).__name__}: {e}); the run cannot be "
                "resumed with it (move the file away to resume without the earlier steps' records)"
            ) from None
        out.append((line, step))
    return out


class MetricsLogger:
    """Appends one JSON line per step to ``path`` (resuming: keeps the lines of steps up to
    ``resume_step``), hands each record to the ``sinks`` (TensorBoard, W&B; closed with the logger) and
    shows progress on the console; a step that was evaluated has an ``eval_loss`` key, which the progress
    line shows from then on (and a log line is printed for that step)."""

    def __init__(
        self,
        path: Path,
        total_steps: int,
        log_every: int,
        resume_step: int | None = None,
        quiet: bool = False,
        sinks: Sequence[Sink] = (),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and path.is_file():
            # A run that died after its last checkpoint logged steps that the resumed run will redo.
            kept = [line for line, step in _read_steps(path) if step <= resume_step]
        self.file = open(path, "w")
        self.file.writelines(line + "\n" for line in kept)
        self.total_steps, self.log_every, self.quiet = total_steps, max(1, log_every), quiet
        self.sinks = list(sinks)
        self.start = time.perf_counter()
        self.last_eval = ""  # the latest evaluation's loss, as the progress line shows it
        self.progress = None
        if not quiet and sys.stderr.isatty():
            self.progress = progress_bar()
            self.task = self.progress.add_task(
                "train", total=total_steps, completed=resume_step or 0, status=""
            )
            self.progress.start()

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for sink in self.sinks:
            sink.log(record)
        if self.quiet:
            return
        step = record["step"]
        evaluated = record.get("eval_loss") is not None
        if evaluated:
            self.last_eval = f"eval {record['eval_loss']:.4f}  "
        status = (
            f"loss {record['loss']:.4f}  {self.last_eval}lr {record['lr']:.2e}  "
            f"|g| {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s  "
            f"{record['memory_gib']:.2f} GiB  epoch {record['epoch']:.2f}"
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=step, status=status)
        elif evaluated or step % self.log_every == 0 or step == self.total_steps:
            elapsed = time.perf_counter() - self.start
            print(
                f"step {step:>6}/{self.total_steps}  {status}  [{elapsed:,.0f}s]", file=sys.stderr, flush=True
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self.file.close()
        sinks, self.sinks = self.sinks, []  # closed once, however often close() is called
        for sink in sinks:
            sink.close()
