"""Which work on another thread stalls a decode loop's launches (a GPU diagnostic).

    python bench/probe_launch_stall.py [--phase-s 2] [--out FILE]

A launcher thread stands in for the decode loop launched ahead: it replays a CUDA graph that keeps the GPU
busy for a few milliseconds, then waits for the replay before it (so one replay is always queued), and
times each ``replay()`` call on the host. Meanwhile a second thread does one kind of work a phase, the kinds
the co-located job does off the decode thread:

- ``idle``: nothing (the baseline);
- ``vmm-map``: the page pool maps a page group (64 pages of 2 MiB, as a KV grow of Llama-3-8B does) and
  unmaps it, over and over;
- ``vmm-map-sync``: the same with a device-wide synchronise before each unmap (a KV shrink's wait);
- ``device-sync``: ``torch.cuda.synchronize()`` in a loop;
- ``spill``: 256 MiB copied from the device to pinned host memory on a side stream, waited for (a reclaim's
  spill of the trainer's activations);
- ``cuda-free``: 256 MiB allocated through torch and given back to the driver (``empty_cache``);
- ``python``: pure Python work (the GIL, handed over at the co-located job's switch interval).

Before the phases it times the first launches of a fed step's token gather (``first_gathers``). For each
phase it prints the replays' host latency (p50 / p99 / max, and how many took over 2 ms) and the
second thread's operations per second, and writes them as JSON (``--out``; default
``$OUT/probe_launch_stall.json`` when ``OUT`` is set). A phase whose launches stall where ``idle``'s do not
names work that must stay out of the decode loop's launch windows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
import torch  # noqa: E402

from harli_train.colocate.runtime_options import RuntimeOptions  # noqa: E402

GROUP_PAGES = 64  # a page group of Llama-3-8B's KV cache (one block's K and V over every layer)
SPILL_BYTES = 256 << 20
STALL_S = 2e-3


def latency_stats(latencies_s: list[float]) -> dict[str, float | int]:
    """p50 / p99 / max in milliseconds and the count over ``STALL_S`` of host latencies (seconds)."""
    if not latencies_s:
        return {"n": 0}
    ordered = sorted(latencies_s)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "n": len(ordered),
        "p50_ms": round(1e3 * statistics.median(ordered), 4),
        "p99_ms": round(1e3 * p99, 4),
        "max_ms": round(1e3 * ordered[-1], 4),
        "over_2ms": sum(x > STALL_S for x in ordered),
    }


class Launcher:
    """Replays ``graph`` on ``stream`` back to back, one replay queued ahead, timing each host call."""

    def __init__(self, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> None:
        self.graph, self.stream = graph, stream
        self.latencies: list[float] = []
        self.recording = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="launcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        prev = None
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                t = time.perf_counter()
                self.graph.replay()
                dt = time.perf_counter() - t
                if self.recording:
                    self.latencies.append(dt)
                event = torch.cuda.Event()
                event.record(self.stream)
                if prev is not None:
                    prev.synchronize()
                prev = event
        if prev is not None:
            prev.synchronize()


def busy_graph(stream: torch.cuda.Stream, gpu_ms: float) -> tuple[torch.cuda.CUDAGraph, float]:
    """A graph of bf16 matmuls that runs about ``gpu_ms`` on the GPU; the graph and its measured ms."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        torch.matmul(a, b, out=out)
        start.record(stream)
        for _ in range(10):
            torch.matmul(a, b, out=out)
        end.record(stream)
    end.synchronize()
    per = start.elapsed_time(end) / 10
    n = max(1, round(gpu_ms / per))
    graph = torch.cuda.CUDAGraph()
    stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(n):
            torch.matmul(a, b, out=out)
    graph.keep = (a, b, out)  # the buffers live as long as the graph
    with torch.cuda.stream(stream):
        start.record(stream)
        graph.replay()
        end.record(stream)
    end.synchronize()
    return graph, start.elapsed_time(end)


def first_gathers(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> list[dict[str, float]]:
    """Host ms of ``torch.index_select`` of int64 ids (a fed step's gather) with 1 and 17 indices, the first
    launch of each and a second one, each behind a replay of ``graph`` queued on ``stream``: a kernel's first
    launch in a context loads it (lazy module loading), which may wait for that queued work. Run before
    anything else in the process gathers."""
    src = torch.zeros(64, dtype=torch.int64, device="cuda")
    out = torch.empty_like(src)
    got = []
    with torch.cuda.stream(stream):
        for n in (1, 1, 17, 17):
            index = torch.zeros(n, dtype=torch.int64, device="cuda")
            stream.synchronize()
            graph.replay()
            t = time.perf_counter()
            torch.index_select(src, 0, index, out=out[:n])
            got.append({"indices": n, "host_ms": round(1e3 * (time.perf_counter() - t), 3)})
            stream.synchronize()
    return got


def phases(pool_pages: int) -> dict[str, Callable[[], Callable[[], None]]]:
    """Each phase's set-up, returning the operation the second thread repeats."""
    from harli_train.memory import PagePool

    def vmm(sync: bool) -> Callable[[], None]:
        pool = PagePool(pool_pages * (2 << 20), backend="cuda")
        region = pool.reserve(pool.add_tenant("probe"), pool_pages)
        slots = list(range(GROUP_PAGES))

        def op() -> None:
            region.map(slots)
            if sync:
                torch.cuda.synchronize()
            region.unmap(slots)

        op.close = lambda: (region.release(), pool.close())  # type: ignore[attr-defined]
        return op

    def spill() -> Callable[[], None]:
        src = torch.empty(SPILL_BYTES, dtype=torch.uint8, device="cuda")
        dst = torch.empty(SPILL_BYTES, dtype=torch.uint8, pin_memory=True)
        side = torch.cuda.Stream()

        def op() -> None:
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            event.synchronize()

        return op

    def cuda_free() -> Callable[[], None]:
        def op() -> None:
            x = torch.empty(SPILL_BYTES, dtype=torch.uint8, device="cuda")
            del x
            torch.cuda.empty_cache()

        return op

    def python() -> Callable[[], None]:
        def op() -> None:
            sum(i * i for i in range(20000))

        return op

    return {
        "idle": lambda: lambda: time.sleep(1e-3),
        "vmm-map": lambda: vmm(False),
        "vmm-map-sync": lambda: vmm(True),
        "device-sync": lambda: torch.cuda.synchronize,
        "spill": spill,
        "cuda-free": cuda_free,
        "python": python,
    }


def run_phase(launcher: Launcher, make: Callable[[], Callable[[], None]], seconds: float) -> dict:
    op = make()
    ops, stop = [0], threading.Event()

    def worker() -> None:
        while not stop.is_set():
            op()
            ops[0] += 1

    launcher.latencies = []
    thread = threading.Thread(target=worker, name="other", daemon=True)
    launcher.recording = True
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    launcher.recording = False
    if hasattr(op, "close"):
        op.close()
    return {**latency_stats(launcher.latencies), "ops_per_s": round(ops[0] / seconds, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-s", type=float, default=2.0, help="seconds a phase")
    ap.add_argument("--gpu-ms", type=float, default=8.0, help="GPU milliseconds a replay (a decode step's)")
    ap.add_argument("--pool-pages", type=int, default=256, help="pages of the probe's page pool")
    ap.add_argument("--only", default="", help="comma-separated phases (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_launch_stall: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.setswitchinterval(RuntimeOptions().switch_interval_s)
    stream = torch.cuda.Stream()
    graph, gpu_ms = busy_graph(stream, args.gpu_ms)
    gathers = first_gathers(graph, stream)
    launcher = Launcher(graph, stream)
    launcher.start()
    time.sleep(0.3)
    table = phases(args.pool_pages)
    wanted = [p for p in args.only.split(",") if p] or list(table)
    results = {
        "gpu": torch.cuda.get_device_name(),
        "replay_gpu_ms": round(gpu_ms, 3),
        "first_gathers": gathers,
    }
    results["phases"] = {}
    try:
        for name in wanted:
            results["phases"][name] = run_phase(launcher, table[name], args.phase_s)
    finally:
        launcher.stop()
    out = args.out or (
        os.path.join(os.environ["OUT"], "probe_launch_stall.json") if "OUT" in os.environ else None
    )
    if out:
        Path(out).write_text(json.dumps(results, indent=1))
    print(f"{results['gpu']}: a replay runs {gpu_ms:.2f} ms on the GPU; host ms of each replay() call")
    print(
        "index_select behind a queued replay, host ms (first launch, then again): "
        + ", ".join(f"{g['indices']} ids {g['host_ms']:.3f}" for g in gathers)
    )
    print(f"{'phase':14} {'n':>6} {'p50':>8} {'p99':>8} {'max':>8} {'>2ms':>6} {'ops/s':>8}")
    for name, r in results["phases"].items():
        print(
            f"{name:14} {r.get('n', 0):>6} {r.get('p50_ms', 0):>8.3f} {r.get('p99_ms', 0):>8.3f} "
            f"{r.get('max_ms', 0):>8.3f} {r.get('over_2ms', 0):>6} {r['ops_per_s']:>8}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
