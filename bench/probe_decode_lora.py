"""Probe: where does a decode step with adapters spend its GPU time? (Llama-3-8B preset, lora_kernel "gemv")

bench_decode's `lora` rows put a step with every request on one rank-16 adapter (all seven targets) at 1.11-1.20x
the base step, while the projections timed alone account for about half of that gap. This probe replays the
step's CUDA graph (base rows, one adapter, four adapters) under torch.profiler and sums the GPU time of each
kernel per replay, so the gap can be read kernel by kernel: which kernels the adapters add, and which base
kernels they slow.

    python bench/probe_decode_lora.py            # H200: $OUT/probe_decode_lora.json, a table last
    python bench/probe_decode_lora.py --dry-run  # CPU: the tiny model, its eager step (the code path only)
    python bench/probe_decode_lora.py --shrink-ahead-rows 0   # the shrinks in the projections' launches
    python bench/probe_decode_lora.py --split-norm-rows 64    # o/down's norms split each row by columns
    python bench/probe_decode_lora.py --mixed 24,56,120        # mixed steps: each batch plus a chunk of N

``--mixed``: instead of decode steps, mixed steps of each batch's decode rows plus one prefill chunk of each
token count (the engine's synthetic mixed step, which replays its token bucket's graph on the GPU), every
row (the chunk one row) on the variant's adapters: a chunk on an adapter costs far more than a decode row
(2 ms at the 32-token bucket and ~5 ms at the 128-token one on the H200, 2026-12-04), and the kernel table
says where. Rows are keyed ``b{batch}_n{tokens}_{variant}``.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
import common  # noqa: E402
import decode_lora  # noqa: E402
import torch  # noqa: E402
from bench_decode import Bench, drain, prime  # noqa: E402

VARIANTS = {"base": (0,), "lora_1": (1,), "lora_mix4": (1, 2, 3, 4)}


def kernel_times(run, reps: int) -> tuple[dict[str, dict[str, float]], float]:
    """GPU microseconds and launches per call of ``run`` by kernel name, and the summed kernel time per call
    (on the CPU: the ops' self time)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            run()
        if on_gpu:
            torch.cuda.synchronize()
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        if on_gpu:
            if "CUDA" not in str(getattr(ev, "device_type", "")) or ev.device_time_total <= 0:
                continue
            us = ev.device_time_total
        else:
            if not ev.key.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        sums[ev.key][0] += ev.count
        sums[ev.key][1] += us
    rows = {k: {"us": t / reps, "launches": c / reps} for k, (c, t) in sums.items()}
    return rows, sum(r["us"] for r in rows.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--mixed", default="", help="prefill chunk sizes: time mixed steps instead of decode steps"
    )
    ap.add_argument(
        "--shrink-ahead-rows",
        type=int,
        default=None,
        help="decode_forward.SHRINK_AHEAD_ROWS for this run (0: every shrink in its projection's launch)",
    )
    ap.add_argument(
        "--split-norm-rows",
        type=int,
        default=None,
        help="decode_norm_shrink.SPLIT_NORM_ROWS for this run (the norms after o and down split by columns)",
    )
    args = ap.parse_args()
    from harli_train.engine import DecodeEngine, EngineConfig, decode_forward, decode_norm_shrink

    if args.shrink_ahead_rows is not None:
        decode_forward.SHRINK_AHEAD_ROWS = args.shrink_ahead_rows
    args.shrink_ahead_rows = decode_forward.SHRINK_AHEAD_ROWS
    if args.split_norm_rows is not None:
        decode_norm_shrink.SPLIT_NORM_ROWS = args.split_norm_rows
    args.split_norm_rows = decode_norm_shrink.SPLIT_NORM_ROWS

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    bench = Bench(args.dry_run, steps=args.reps)
    batches = [int(b) for b in args.batches.split(",")] if not args.dry_run else [1, 4]
    chunks = [int(n) for n in args.mixed.split(",") if n] if args.mixed else []
    model = bench.load_model(device)
    adapters = decode_lora.random_adapters(model, decode_lora.ADAPTERS, decode_lora.RANK)
    cfg = EngineConfig(
        max_num_seqs=max(batches) + (1 if chunks else 0),  # a mixed step's chunk is a row of its own
        max_model_len=bench.ctx + 4 * args.reps + 64,
        graph_batch_sizes=tuple(sorted({*batches, max(batches) + (1 if chunks else 0)})),
        gpu_memory_utilization=0.6,
        num_kv_blocks=256 if args.dry_run else None,
        max_loras=decode_lora.ADAPTERS,
        max_lora_rank=decode_lora.RANK,
        lora_kernel="gemv",
        mixed_prefill=bool(chunks),
        max_num_batched_tokens=max([512, *(max(batches) + n for n in chunks)]),
    )
    engine = DecodeEngine(model, cfg)
    for slot, pairs in enumerate(adapters, start=1):
        engine.load_lora(slot, pairs, decode_lora.RANK, 2.0)
    results: dict = {"env": common.environment(), "args": vars(args), "ctx": bench.ctx, "rows": {}}
    table = []
    cases = [(b, n) for b in batches for n in chunks] if chunks else [(b, None) for b in batches]
    names = [f"b{b}" if n is None else f"b{b}_n{n}" for b, n in cases]
    for (batch, chunk), case in zip(cases, names, strict=True):
        for label, slots in VARIANTS.items():
            key = f"{case}_{label}"
            if chunk is not None:
                adapters = len(slots) if any(slots) else 0

                def run(batch=batch, chunk=chunk, n=adapters):
                    engine.synthetic_mixed(batch, bench.ctx, chunk, 0, "default", n)

                for _ in range(3):  # compile, settle
                    run()
            else:
                prime(engine, batch, bench.ctx, 4 * args.reps + 16, slots)
                for _ in range(3):  # compile, settle
                    engine.step("default")
                graphs = engine.runner.graphs
                if graphs is not None:
                    graph = graphs.graphs[("default", graphs.bucket(batch), any(slots))]
                    stream = engine.runner.partitions["default"].stream

                    def run(graph=graph, stream=stream):
                        with torch.cuda.stream(stream):
                            graph.replay()
                else:

                    def run():
                        engine.step("default")

            rows, total = kernel_times(run, args.reps)
            if chunk is None:
                drain(engine)
            results["rows"][key] = {"total_us": total, "kernels": rows}
            table.append((case, label, total, sum(r["launches"] for r in rows.values())))
            print(f"{key}: {total:.1f} us of kernels a step", flush=True)
    engine.close()
    # Per case: each kernel's time with adapters minus without (what the adapters add or slow).
    diffs = {}
    for case in names:
        base = results["rows"][f"{case}_base"]["kernels"]
        for label in ("lora_1", "lora_mix4"):
            lora = results["rows"][f"{case}_{label}"]["kernels"]
            d = {
                k: lora.get(k, {"us": 0.0})["us"] - base.get(k, {"us": 0.0})["us"]
                for k in set(base) | set(lora)
            }
            diffs[f"{case}_{label}"] = dict(sorted(d.items(), key=lambda kv: -abs(kv[1]))[:12])
    results["diffs"] = diffs
    path = common.write_json("probe_decode_lora.json", results)
    print(f"wrote {path}")
    print(f"{'case':>9} {'variant':<10} {'kernel us':>10} {'launches':>9} {'x base':>7}")
    base_us = {case: t for case, label, t, _ in table if label == "base"}
    for case, label, total, launches in table:
        print(f"{case:>9} {label:<10} {total:>10.1f} {launches:>9.0f} {total / base_us[case]:>7.3f}")
    for key, d in diffs.items():
        print(key, ", ".join(f"{k[:48]} {v:+.1f}" for k, v in list(d.items())[:6]))


if __name__ == "__main__":
    main()
