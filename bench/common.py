"""Shared by the GPU benchmarks: where results go, environment facts, CUDA-graph timing, a table printer."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def out_dir() -> Path:
    path = Path(os.environ.get("OUT", "bench_out"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def environment() -> dict[str, Any]:
    import torch

    env = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(
            gpu=p.name,
            sms=p.multi_processor_count,
            gpu_mem_gib=round(p.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    return env


def hf_llama_config(mc: Any, **overrides: Any) -> Any:
    """transformers' LlamaConfig with the shapes of our ModelConfig `mc`: the baselines' model."""
    from transformers import LlamaConfig

    settings = dict(
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.num_kv_heads,
        vocab_size=mc.vocab_size,
        max_position_embeddings=8192,
        rope_theta=mc.rope_theta,
        attn_implementation="sdpa",
    )
    return LlamaConfig(**{**settings, **overrides})


def graph_ms(fn, reps: int = 20, stream=None) -> float:
    """Mean time of `fn` replayed `reps` times inside one CUDA graph (no launch gaps); captured and replayed
    on `stream` (e.g. a green context's) when given, else on a side stream and replayed on the current one."""
    import contextlib

    import torch

    side = stream or torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()  # compiles, sets up cuBLAS outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(reps):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        graph.replay()
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
    return median(times)


def sync_device(device) -> None:
    """Wait for ``device``'s queued work (a torch.device; nothing to wait for on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write_json(name: str, data: dict[str, Any]) -> Path:
    path = out_dir() / name
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def run_child(args: list[str], timeout: float) -> dict[str, Any]:
    """Run `python <args>` in a fresh process (clean peak-memory counters); it prints one JSON line last."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(proc.stderr[-4000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(lines[-1])


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) for r in cells)
