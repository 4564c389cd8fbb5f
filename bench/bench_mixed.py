"""What a stall-free mixed step costs: decode rows plus a prefill chunk in one varlen step, against the decode
step alone (its CUDA graph) plus the chunk alone, on SM shares of the ladder; for both ways an engine runs
varlen steps (their graphs, as served steps run): `decode_kernels` (the default: the decode step's GEMV
projections over every packed token, one-token rows attended by the split decode kernel) and `model` (the
model's own forward, the prefill kernel for every row; `EngineConfig.varlen_decode_kernels=False`).

    python bench/bench_mixed.py            # on the GPU: llama-8b bf16; $OUT/bench_mixed.json, a table last
    python bench/bench_mixed.py --dry-run  # on the CPU: the tiny model on the stand-in ladder

For each share, decode batch B (each row over --kv-len cached tokens) and chunk of N tokens (after --context
cached ones): `decode_ms` is the decode step's graph replay, `chunk_ms` the chunk as a varlen step alone,
`mixed_ms` both in one mixed step, `extra_ms` = mixed - decode (what the chunk adds to the decode rows'
step: the figure the objective feels), `ratio` = mixed / (decode + chunk) (< 1: the mixed step saves the
decode's weight read; > 1: riding along costs more than running apart), and `varlen_decode_ms` the decode rows
alone through the varlen path (what a mixed step pays for them before any chunk). Medians of --reps timed
steps after --warmup, CUDA events on the partition's stream. About 2 minutes on the H200.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import torch  # noqa: E402

from harli_train.colocate.assembly import build_engine, build_ladder  # noqa: E402
from harli_train.colocate.step_timing import median_step_s  # noqa: E402
from harli_train.data.tokenizer import load_tokenizer  # noqa: E402
from harli_train.engine.load import TraceRequest  # noqa: E402
from harli_train.model import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--model", default=None, help="default llama-8b (tiny with --dry-run)")
    ap.add_argument("--shares", default="48,132", help="decode SM shares (the nearest rungs)")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--chunks", default="32,256,512")
    ap.add_argument("--paths", default="decode_kernels,model", help="varlen paths to time (see above)")
    ap.add_argument("--kv-len", type=int, default=1024)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    model_name = args.model or ("tiny" if dry else "llama-8b")
    if dry:
        args.batches, args.chunks, args.kv_len, args.reps, args.warmup = "2,4", "8,32", 64, 2, 1
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    model = load_model(model_name, dtype, device)
    ladder = build_ladder("harli", device, 16)
    batches = [int(b) for b in args.batches.split(",")]
    chunks = [int(n) for n in args.chunks.split(",")]
    longest = args.kv_len + max(chunks) + args.context
    load = [TraceRequest(0.0, 1, prompt_len=longest)]
    rows, results = [], {"env": common.environment(), "args": vars(args), "cells": []}
    keys = ("decode_ms", "varlen_decode_ms", "chunk_ms", "mixed_ms", "extra_ms", "ratio")
    try:
        for path in args.paths.split(","):
            if path not in ("decode_kernels", "model"):
                raise SystemExit(f"--paths: decode_kernels or model, got {path!r}")
            engine = build_engine(model, load_tokenizer(model_name, True), ladder, load, max(batches) + 1,
                                  mixed_prefill=True, varlen_decode_kernels=path == "decode_kernels")  # fmt: skip
            try:
                for cell in _cells(engine, ladder, args, batches, chunks):
                    cell["path"] = path
                    results["cells"].append(cell)
                    rows.append([path, cell["infer_sms"], cell["batch"], cell["chunk_tokens"]]
                                + [f"{cell[k]:.2f}" for k in keys])  # fmt: skip
            finally:
                engine.close()
    finally:
        ladder.close()
    out = common.write_json("bench_mixed.json", results)
    print(f"wrote {out}")
    head = ["path", "SMs", "batch", "chunk", "decode ms", "varlen dec ms", "chunk ms", "mixed ms", "extra ms"]
    print(common.table(rows, [*head, "mixed/(dec+chunk)"]))


def _cells(engine, ladder, args, batches: list[int], chunks: list[int]) -> list[dict]:
    parts = sorted({ladder.select(int(s)) for s in args.shares.split(",")}, key=lambda p: p.infer_sms)
    engine.register(parts)
    cells = []
    for part in parts:
        time_ms = partial(_time_ms, part=part, args=args)
        for b in batches:
            decode = time_ms(engine.synthetic_decode, b, args.kv_len)
            varlen = time_ms(engine.synthetic_mixed, b - 1, args.kv_len, 1, args.kv_len - 1)
            for n in chunks:
                chunk = time_ms(engine.synthetic_mixed, 0, 1, n, args.context)
                mixed = time_ms(engine.synthetic_mixed, b, args.kv_len, n, args.context)
                cells.append(
                    {
                        "infer_sms": part.infer_sms,
                        "batch": b,
                        "chunk_tokens": n,
                        "decode_ms": decode,
                        "varlen_decode_ms": varlen,
                        "chunk_ms": chunk,
                        "mixed_ms": mixed,
                        "extra_ms": mixed - decode,
                        "ratio": mixed / (decode + chunk),
                    }
                )
    return cells


def _time_ms(fn, *fn_args, part, args) -> float:
    """Median milliseconds of ``fn(*fn_args, part)``, one step launched on the partition's stream."""
    return 1e3 * median_step_s(partial(fn, *fn_args, part), part.infer_stream, args.warmup, args.reps)


if __name__ == "__main__":
    main()
