"""How much a trainer kernel on its SMs slows decode's memory-bound GEMVs on theirs, by the kernel's grid.

    python bench/probe_ce_interference.py [--decode-sms 48] [--grids full,84,42,21,10] [--reps 30]

Decode's share and the trainer's are disjoint green contexts (`SMLadder`, the rung that gives decode
``--decode-sms``), so what the trainer costs decode there is HBM bandwidth. The decode stand-in is the
engine's GEMV (`decode_linear`) at 4 rows over Llama-3-8B's seven projections of one layer, eight times
(~1.7 GB of weights a pass, more than the L2 holds). Beside it, on the trainer's share, runs in turn:
nothing; the trainer's chunked cross-entropy kernel (the loss micro-step's memory-bound part: a 4 x 1024-row
chunk of bf16 logits over a 128,256-token vocabulary, read twice and written once a pass) with each grid of
``--grids`` (``full``: the launch config's persistent grid for the trainer's SMs); and a compute-bound GEMM
of the same shapes as the chunk's logits product. Each case times ``--reps`` decode passes with CUDA events
while the trainer kernel is kept queued (re-launched until the passes end), and the trainer kernel's own
time per launch. One JSON under ``$OUT`` (``probe_ce_interference.json``), the table last: decode's time
over its time alone, and the kernel's time per launch over its full grid's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HIDDEN, INTER, KV_ROWS = 4096, 14336, 1024  # Llama-3-8B: q/o 4096, k/v 1024 rows each, MLP 14336
ROWS, VOCAB = 4 * 1024, 128256  # the 8B recipe's micro-batch, the Llama-3 vocabulary
CE = "cross-entropy"


def decode_weights(torch, device, layers: int) -> list[list]:
    """Per layer, the weight groups one decode step streams: qkv, o, gate + up, down."""

    def w(n, k):
        return torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02

    return [
        [[w(HIDDEN, HIDDEN), w(KV_ROWS, HIDDEN), w(KV_ROWS, HIDDEN)], [w(HIDDEN, HIDDEN)],
         [w(INTER, HIDDEN), w(INTER, HIDDEN)], [w(HIDDEN, INTER)]]
        for _ in range(layers)
    ]  # fmt: skip


def with_ratios(cases: list[dict], alone_ms: float, full_grid: int) -> list[dict]:
    """Each case (``trainer``, ``grid``, ``decode_ms``, ``trainer_ms``) with ``decode_over_alone`` (its decode
    pass over ``alone_ms``) and, for the cross-entropy cases, ``trainer_over_full_grid`` (its kernel's time
    over the kernel's at ``full_grid``; None where that case did not run)."""
    ce_full = next((c["trainer_ms"] for c in cases if c["trainer"] == CE and c["grid"] == full_grid), None)
    for c in cases:
        c["decode_over_alone"] = c["decode_ms"] / alone_ms
        c["trainer_over_full_grid"] = c["trainer_ms"] / ce_full if c["trainer"] == CE and ce_full else None
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-sms", type=int, default=48)
    ap.add_argument("--grids", default="full,84,42,21,10", help="the cross-entropy kernel's grids to try")
    ap.add_argument("--reps", type=int, default=30, help="decode passes timed per case")
    ap.add_argument("--layers", type=int, default=8, help="layers of weights a decode pass streams")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("probe_ce_interference: needs a CUDA GPU with green contexts (it times two SM shares)")
    try:
        grids = [g if g == "full" else int(g) for g in args.grids.split(",") if g]
    except ValueError:
        sys.exit(
            f"probe_ce_interference: --grids takes 'full' and counts (comma-separated), not {args.grids!r}"
        )
    from harli_train.colocate.sm import make_ladder
    from harli_train.engine.decode_linear import decode_linear
    from harli_train.kernels.launch_config import get_config
    from harli_train.kernels.linear_cross_entropy import _cross_entropy_fwd_kernel

    device = torch.device("cuda")
    ladder = make_ladder(step=16, fallback=False)
    part = ladder.select(args.decode_sms)
    if part.exclusive:
        sys.exit(
            f"probe_ce_interference: no rung gives decode {args.decode_sms} SMs and the trainer the rest"
        )
    dec_stream, train_stream = part.infer_stream, part.train_stream
    layers = decode_weights(torch, device, args.layers)
    x = torch.randn(4, HIDDEN, device=device, dtype=torch.bfloat16)
    xi = torch.randn(4, INTER, device=device, dtype=torch.bfloat16)
    logits = torch.randn(ROWS, VOCAB, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, VOCAB, (ROWS,), device=device)
    loss = torch.empty(ROWS, device=device, dtype=torch.float32)
    hidden = torch.randn(ROWS, HIDDEN, device=device, dtype=torch.bfloat16)
    head = torch.randn(VOCAB // 4, HIDDEN, device=device, dtype=torch.bfloat16)  # a quarter: keeps it < 1 GiB
    cfg = get_config("cross_entropy", (ROWS, VOCAB), part.train_sms, torch.bfloat16)

    def decode_pass() -> None:
        for qkv, o, gate_up, down in layers:
            decode_linear(x, qkv, num_sms=part.infer_sms)
            decode_linear(x, o, num_sms=part.infer_sms)
            decode_linear(x, gate_up, swiglu=True, num_sms=part.infer_sms)
            decode_linear(xi, down, num_sms=part.infer_sms)

    def cross_entropy(grid: int):
        def run() -> None:
            _cross_entropy_fwd_kernel[(grid,)](
                logits, logits.stride(0), labels, loss, ROWS, VOCAB, -100,
                COMPUTE_GRAD=True, BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"],
            )  # fmt: skip

        return run

    def gemm() -> None:
        torch.mm(hidden, head.t())

    def timed(fn, stream, reps: int) -> list[float]:
        """ms of each of ``reps`` calls of ``fn`` on ``stream`` (CUDA events)."""
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
        with torch.cuda.stream(stream):
            marks[0].record()
            for i in range(reps):
                fn()
                marks[i + 1].record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)]

    def beside(fn) -> tuple[float, float]:
        """Decode's median pass (ms) with ``fn`` kept queued on the trainer's share (sized from ``alone``,
        decode's median pass without it), and ``fn``'s time per launch."""
        torch.cuda.synchronize()
        own = timed(fn, train_stream, 3)  # its own time, to size the queue that outlasts the decode passes
        queued = max(4, int(alone * 2 * args.reps / max(min(own), 1e-3)) + 2)
        with torch.cuda.stream(train_stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(queued):
                fn()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        passes = timed(decode_pass, dec_stream, args.reps)
        torch.cuda.synchronize()
        return statistics.median(passes), start.elapsed_time(end) / queued

    for _ in range(3):  # compile and warm every kernel
        decode_pass()
        cross_entropy(8)()
        gemm()
    torch.cuda.synchronize()
    alone = statistics.median(timed(decode_pass, dec_stream, args.reps))
    cases = [{"trainer": "nothing", "grid": None, "decode_ms": alone, "trainer_ms": None}]
    full = cfg["num_programs"]  # the launch config's persistent grid on the trainer's SMs
    for g in grids:
        grid = full if g == "full" else g
        dec, own = beside(cross_entropy(grid))
        cases.append({"trainer": CE, "grid": grid, "decode_ms": dec, "trainer_ms": own})
    dec, own = beside(gemm)
    cases.append({"trainer": "GEMM (compute-bound)", "grid": None, "decode_ms": dec, "trainer_ms": own})
    with_ratios(cases, alone, full)
    result = {
        "env": common.environment(),
        "decode_sms": part.infer_sms,
        "trainer_sms": part.train_sms,
        "decode_weights_gb": sum(w.numel() * 2 for layer in layers for g in layer for w in g) / 1e9,
        "logits_gb": logits.numel() * 2 / 1e9,
        "full_grid": full,
        "cases": cases,
    }
    print(f"wrote {common.write_json('probe_ce_interference.json', result)}")
    keys = ("trainer", "grid", "decode_ms", "decode_over_alone", "trainer_ms", "trainer_over_full_grid")
    rows = [[c[k] for k in keys] for c in cases]
    print(f"decode on {part.infer_sms} SMs, the trainer's kernel on {part.train_sms}")
    print(
        common.table(
            rows, ["beside decode", "grid", "decode ms", "over alone", "kernel ms", "over full grid"]
        )
    )
    ladder.close()


if __name__ == "__main__":
    main()
