"""Probe: where does the trainer's host time per micro-step go? (Llama-3-8B shapes, the colocation recipe)

In bench_colocate the trainer thread spent 22-32 ms of host time launching each micro-step (4 layers x 4 x 1024
tokens), against about 15 ms when training alone, and the GPU ran that micro-step in about 25 ms on the
trainer's usual 60-75 SMs: the trainer is host-bound beside decode. This probe runs the trainer's micro-step
generator alone and measures, per micro-step kind:
- host seconds to launch it, with the GPU idle before it (synchronised: the launch alone) and queued (as the
  trainer side runs it), and its GPU seconds (events on the stream);
- under cProfile, the functions that take the host time;
- under torch.profiler, the kernels and CUDA API calls each micro-step makes.

    python bench/probe_trainer_host.py            # H200: $OUT/probe_trainer_host.json, a table last
    python bench/probe_trainer_host.py --graphs   # the same with train.cuda_graphs (a replay per micro-step)
    python bench/probe_trainer_host.py --dry-run  # CPU: the tiny model, the same code paths
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
import common  # noqa: E402
import torch  # noqa: E402

from harli_train import kernels  # noqa: E402
from harli_train.config import load_recipe  # noqa: E402
from harli_train.train.trainer import Trainer  # noqa: E402


class DecodeLike:
    """A thread that behaves like the decode loop on the host: waits ``WAIT_S`` without the GIL (the step's
    event), then runs ``WORK_S`` of Python (decide, schedule, launch); with the runtime's switch interval."""

    WAIT_S, WORK_S = 8e-3, 0.5e-3

    def __init__(self, switch_interval_s: float) -> None:
        self.switch, self.loops = switch_interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.WAIT_S)
            end = time.perf_counter() + self.WORK_S
            x = 0
            while time.perf_counter() < end:
                x += sum(range(50))
            self.loops += 1

    def __enter__(self) -> DecodeLike:
        self._saved = sys.getswitchinterval()
        sys.setswitchinterval(self.switch)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._saved)


def make_trainer(args) -> Trainer:
    overrides = [f"train.steps={10**6}", "train.log_every=1000000", "output.checkpoint_every=0"]
    overrides.append(f"output.dir={common.out_dir() / 'probe_run'}")
    overrides.append(f"train.cuda_graphs={str(args.graphs).lower()}")
    if args.dry_run:
        overrides += ["model.name=tiny", "train.device=cpu", "model.dtype=float32", "data.seq_len=64"]
    trainer = Trainer(load_recipe(args.recipe, overrides), quiet=True)
    trainer.setup()
    return trainer


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(gen, n: int, synced: bool) -> dict[str, list[tuple[float, float | None]]]:
    """(host s, GPU s) of ``n`` micro-steps by phase; ``synced``: the GPU is idle before each launch."""
    out: dict[str, list[tuple[float, float | None]]] = defaultdict(list)
    events = []
    for _ in range(n):
        if synced:
            sync()
        start = end = None
        if torch.cuda.is_available():
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        ms = next(gen)
        host = time.perf_counter() - t0
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        events.append((ms.phase, host, start, end))
    sync()
    for phase, host, start, end in events:
        out[phase].append((host, start.elapsed_time(end) * 1e-3 if start is not None else None))
    return out


def summarise(runs: dict[str, list[tuple[float, float | None]]]) -> dict[str, dict]:
    res = {}
    for phase, rows in sorted(runs.items()):
        gpu = [g for _, g in rows if g is not None]
        res[phase] = {
            "n": len(rows),
            "host_ms": 1e3 * statistics.median(h for h, _ in rows),
            "gpu_ms": 1e3 * statistics.median(gpu) if gpu else None,
        }
    return res


def profile_functions(gen, n: int, top: int = 30) -> tuple[list[dict], str]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        next(gen)
    prof.disable()
    sync()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    rows = []
    for (file, line, name), (_, nc, tt, ct, _) in sorted(
        stats.stats.items(), key=lambda kv: kv[1][2], reverse=True
    )[:top]:
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({name})",
                "calls_per_micro": nc / n,
                "tottime_ms_per_micro": 1e3 * tt / n,
                "cumtime_ms_per_micro": 1e3 * ct / n,
            }
        )
    return rows, text.getvalue()


def profile_launches(gen, n: int) -> dict:
    """Kernels and CUDA runtime/driver calls per micro-step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            next(gen)
        sync()
    kernels_n = 0
    api: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        kind = str(getattr(ev, "device_type", ""))
        if "CUDA" in kind and ev.device_time_total > 0 and ev.count:
            kernels_n += ev.count
        elif ev.key.startswith(("cuda", "cu")):
            api[ev.key][0] += ev.count
            api[ev.key][1] += ev.cpu_time_total
        elif ev.key.startswith("aten::") or "triton" in ev.key.lower():
            ops[ev.key][0] += ev.count
            ops[ev.key][1] += ev.self_cpu_time_total
    top_api = sorted(api.items(), key=lambda kv: -kv[1][1])[:12]
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1][1])[:15]
    return {
        "kernels_per_micro": kernels_n / n,
        "api": [{"call": k, "per_micro": c / n, "ms_per_micro": t / n / 1e3} for k, (c, t) in top_api],
        "ops": [{"op": k, "per_micro": c / n, "self_ms_per_micro": t / n / 1e3} for k, (c, t) in top_ops],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "llama-8b-lora.yaml"))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="train.cuda_graphs: each micro-step a graph replay")
    ap.add_argument(
        "--sms", type=int, default=64, help="the trainer's SMs on a green context (the nearest rung)"
    )
    args = ap.parse_args()
    results: dict = {"env": common.environment(), "args": vars(args)}
    trainer = make_trainer(args)
    per_step = 2 * (trainer.model.config.num_layers // trainer.cfg.train.layers_per_microstep) + 2
    n = per_step * (1 if args.dry_run else 3)
    gen = trainer.micro_steps()
    for _ in range(per_step * 2):  # compile and settle the allocator
        next(gen)
    sync()
    ladder = None
    if torch.cuda.is_available():
        from harli_train.colocate.sm import SMLadder

        ladder = SMLadder.create(step=16)
    rung = min(ladder.spatial, key=lambda p: abs(p.train_sms - args.sms)) if ladder is not None else None
    stream, sms = (rung.train_stream, rung.train_sms) if rung is not None else (None, None)
    where = f"green {sms} SMs" if rung is not None else "CPU"
    scenarios = [
        ("whole GPU", None, None, None),
        (where, stream, sms, None),
        (f"{where} + decode thread", stream, sms, 1e-4),
        (f"{where} + decode thread, 5 ms switch", stream, sms, 5e-3),
    ]
    for label, stream, sms, switch in scenarios:
        rival = DecodeLike(switch) if switch is not None else None
        with (
            torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
            kernels.sm_budget(sms) if sms else contextlib.nullcontext(),
            rival or contextlib.nullcontext(),
        ):
            for _ in range(per_step):  # with graphs: this stream's set is captured here, untimed
                next(gen)
            results[label] = {
                "synced": summarise(timed(gen, n, synced=True)),
                "queued": summarise(timed(gen, n, synced=False)),
            }
        if rival is not None:
            results[label]["rival_loops"] = rival.loops
    with (
        torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
        kernels.sm_budget(sms) if sms else contextlib.nullcontext(),
    ):
        results["cprofile_top"], text = profile_functions(gen, per_step)
        results["launches"] = profile_launches(gen, per_step)
    if ladder is not None:
        ladder.close()
    print(text)
    graphs = trainer.graphs
    results["graphs"] = None if graphs is None else {"sets": graphs.captures, "rebuilds": graphs.rebuilds}
    common.write_json("probe_trainer_host" + ("-graphs" if args.graphs else "") + ".json", results)
    rows = []
    for label, *_ in scenarios:
        for phase, r in results[label]["synced"].items():
            q = results[label]["queued"][phase]
            rows.append([label, phase, r["host_ms"], q["host_ms"], r["gpu_ms"], q["gpu_ms"]])
    print(f"kernels per micro-step: {results['launches']['kernels_per_micro']:.0f}")
    for a in results["launches"]["api"][:6]:
        print(f"  {a['call']}: {a['per_micro']:.0f} per micro-step, {a['ms_per_micro']:.2f} ms")
    for f in results["cprofile_top"][:12]:
        print(f"  {f['function']}: {f['calls_per_micro']:.0f} calls, {f['tottime_ms_per_micro']:.2f} ms self")
    print(
        common.table(
            rows, ["budget", "phase", "host ms idle", "host ms queued", "GPU ms idle", "GPU ms queued"]
        )
    )


if __name__ == "__main__":
    main()
