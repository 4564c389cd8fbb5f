"""The co-location bench's windows: one policy at a time on the assembly, each on a fresh trainer.

A window is a ``ColocatedRuntime`` run made by the ``Colocation`` (``until="load"``): a fresh policy (the
predictor's corrections start again), a fresh adapter and optimizer on the shared weights, the trainer's
streams warmed for that policy, then the cell's requests for the window's length (and, for the standalone
rates, the trainer alone for ``solo_s``). What it keeps is the matrix's row (``colocate_matrix.policy_row``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import colocate_matrix
import torch
from stall_sampler import HostCounters, StallSampler, stall_spans

from harli_train.colocate import report
from harli_train.colocate.colocation import Colocation
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.engine.load import TraceRequest

WINDOW_OVERHEAD_S = 5.0  # a window's cost besides its length, until one has been measured
log = logging.getLogger("bench_colocate")


def _trainer_mode(graphs: bool) -> str:
    return "graphed" if graphs else "eager"


def gpu_name() -> str:
    """The name of this process's GPU (``"cpu"`` without one): what standalone rates are valid on."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class OutOfTime(Exception):
    """The next window would end past the call's time budget; ``kept``: the row (and step records) of the
    windows of a ``Windows.repeated`` that did run before it, if any."""

    def __init__(self, name: str, kept: tuple[dict[str, Any], list[dict[str, Any]]] | None = None) -> None:
        super().__init__(name)
        self.kept = kept


class Windows:
    """Runs windows on ``col`` and keeps their rows; refuses (``OutOfTime``) a window that would end more
    than ``budget_s`` after ``t0``, judging its cost by the windows run so far.

    ``options``: the ``RuntimeOptions`` fields every window shares (trainer thread, queue depth, host
    priority); ``keep_steps``: step records each row keeps; ``sample_stalls``: thread stacks inside decode's
    host stalls, for diagnosis (the sampler perturbs what it measures a little)."""

    def __init__(
        self,
        col: Colocation,
        scratch: Path,
        t0: float,
        budget_s: float,
        options: dict[str, Any] | None = None,
        keep_steps: int = 0,
        sample_stalls: bool = False,
    ) -> None:
        self.col, self.scratch, self.t0, self.budget_s = col, scratch, t0, budget_s
        self.options, self.keep_steps, self.sample_stalls = dict(options or {}), keep_steps, sample_stalls
        self.overheads: list[float] = []

    def run(
        self,
        name: str,
        tpot_s: float,
        requests: tuple[TraceRequest, ...] = (),
        *,
        window_s: float = 0.0,
        time_scale: float = 1.0,
        solo_s: float = 0.0,
        plot_to: Path | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One window of policy ``name`` held to ``tpot_s``: its row (an ``error`` row when it failed, so the
        other windows still run) and its step records; harli's timeline copied to ``plot_to``."""
        overhead = sum(self.overheads) / len(self.overheads) if self.overheads else WINDOW_OVERHEAD_S
        if time.perf_counter() - self.t0 + window_s + solo_s + overhead > self.budget_s:
            raise OutOfTime(name)
        started = time.perf_counter()
        run_dir = Path(tempfile.mkdtemp(dir=self.scratch))
        gc.collect()  # the last window's trainer, before this one's allocates
        try:
            self.col.new_trainer(run_dir / "train")
            policy = self.col.prepare(self.col.new_policy(name, tpot_s))
            opts = RuntimeOptions(
                until="load",
                window_s=window_s,
                solo_s=solo_s,
                time_scale=time_scale,
                quiet=True,
                finish=False,
                plots=plot_to is not None,
                **self.options,
            )
            rt = self.col.runtime(policy, list(requests), run_dir / "colocate", opts)
            sampler = StallSampler() if self.sample_stalls else None
            counters = HostCounters().start()  # the decode loop runs on this thread
            with sampler or contextlib.nullcontext():
                summary = rt.run()
            steps = report.read_steps(run_dir / "colocate" / "steps.jsonl")
            row = colocate_matrix.policy_row(summary, steps, self.keep_steps)
            row["host_counters"] = counters.delta()
            if sampler is not None:
                longest = sorted(stall_spans(steps), key=lambda span: span[0] - span[1])[:20]
                row["stall_samples"] = sampler.around(sorted(longest), rt.t0)
            if plot_to is not None:
                plot_to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(run_dir / "colocate" / "timeline.png", plot_to)
        except Exception as err:
            log.error("%s failed: %s", name, err)
            row, steps = {"policy": name, "error": f"{type(err).__name__}: {err}"}, []
            row["trace"] = traceback.format_exc()[-3000:]
        shutil.rmtree(run_dir, ignore_errors=True)
        self.overheads.append(time.perf_counter() - started - window_s - solo_s)
        return row, steps

    def repeated(
        self, repeats: int, name: str, tpot_s: float, requests: tuple[TraceRequest, ...], **window: Any
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """``repeats`` windows of ``run``'s arguments, as one row (``colocate_matrix.repeated``: the median
        window when all are clean, else the one that violated most) with that window's step records and
        timeline (``plot_to``). When the time budget stops the repeats part way, ``OutOfTime.kept`` holds
        the row of those that ran."""
        plot_to: Path | None = window.pop("plot_to", None)
        runs, pngs = [], []
        stopped: OutOfTime | None = None
        for i in range(repeats):
            png = None if plot_to is None else plot_to.with_name(f"{plot_to.stem}-{i}{plot_to.suffix}")
            try:
                runs.append(self.run(name, tpot_s, requests, plot_to=png, **window))
            except OutOfTime as stop:
                if not runs:
                    raise
                stopped = stop
                break
            pngs.append(png)
        row, steps = colocate_matrix.repeated(runs)
        for run, png in zip(runs, pngs, strict=True):  # the chosen window's timeline is the cell's
            if png is None or not png.exists():
                continue
            if run[1] is steps:
                png.replace(plot_to)
            else:
                png.unlink()
        if stopped is not None:
            row["repeats_cut"] = f"{len(runs)} of {repeats}: out of time"
            raise OutOfTime(str(stopped), (row, steps))
        return row, steps

    def whole_gpu_now(self, repeats: int, solo_s: float) -> dict[str, Any]:
        """The trainer alone on the whole GPU now (``exclusive``, ``solo_s`` each, ``repeats`` times): the
        median, which each cell of the call keeps as the light bar's denominator."""
        rates = [
            self.run("exclusive", self.col.tpot_s, solo_s=solo_s)[0].get("solo_tokens_per_s")
            for _ in range(repeats)
        ]
        ok = [r for r in rates if r]
        return {"tokens_per_s": statistics.median_low(ok) if ok else None, "runs": rates, "solo_s": solo_s}

    def standalone(self, path: Path | None, solo_s: float) -> dict[str, Any]:
        """The trainer alone, ``solo_s`` each, on the whole GPU (``exclusive``) and on the trainer side of
        every split (``exclusive:N``), keyed by its SMs (the whole GPU's too), with the GPU's name and
        whether the trainer's steps ran as CUDA graphs (``cuda_graphs``): read from ``path`` when that exists
        and was measured on a GPU of this name with the trainer as this run's (a file without the key was
        measured eager), else measured (and written to ``path`` unless it holds other rates)."""
        here, graphs = gpu_name(), bool(self.col.cfg.train.cuda_graphs)
        if path is not None and path.is_file():
            stored = json.loads(path.read_text())
            theirs = (stored.get("gpu_name"), bool(stored.get("cuda_graphs", False)))
            if theirs == (here, graphs):
                return {**stored, "source": str(path)}
            log.warning(
                "%s holds standalone rates of %s with the trainer %s, this run is %s with it %s: measuring "
                "them again",
                path,
                theirs[0] or "an unnamed GPU",
                _trainer_mode(theirs[1]),
                here,
                _trainer_mode(graphs),
            )
            path = None

        def rate(name: str) -> float | None:
            return self.run(name, self.col.tpot_s, solo_s=solo_s)[0].get("solo_tokens_per_s")

        whole = rate("exclusive")
        by_sms = {str(p.train_sms): rate(f"exclusive:{p.infer_sms}") for p in self.col.ladder.spatial}
        out = {
            "whole_gpu_tokens_per_s": whole,
            "by_train_sms": {**by_sms, str(self.col.ladder.total_sms): whole},
            "solo_s": solo_s,
            "gpu_name": here,
            "cuda_graphs": graphs,
        }
        if path is not None:
            path.write_text(json.dumps(out, indent=1))
        return out
