"""Mixed steps' projections by rows: the engine's GEMV against its cuBLAS path (a bench_decode section,
``--only gemv_rows``, ~1 min).

A step's projections run on the bandwidth-shaped GEMV up to ``MAX_GEMV_ROWS`` rows and on cuBLAS past it
(``decode_forward._use_gemv``; a square projection from ``CUBLAS_SQUARE_ROWS`` rows). Mixed steps pad their
rows to the mixed graphs' token buckets (16, 32, 64, 96, 128, 192, 256, ...), so every bucket past 64 runs
cuBLAS, where a GEMM of 96-256 rows has few output tiles for the SMs it gets. This section times one layer's
projections as the engine calls them (q/k/v side by side, gate/up with the SwiGLU, o and down with the
residual add and the next norm) at ``ROWS`` rows both ways, on green contexts of ``SHARES`` SMs, each weight
set in three copies cycled inside the graph so that no call reads the weights of the one before from L2. Per
share, ``gemv_up_to`` is the most rows up to which the GEMV's layer (its non-square projections: o stays on
cuBLAS from ``CUBLAS_SQUARE_ROWS`` rows) is no slower than cuBLAS at every row count timed: where
``MAX_GEMV_ROWS`` belongs. A CPU has no green contexts: the dry run only records the configs.
"""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace
from typing import Any

import common
import gemv_by_share

ROWS = (64, 96, 128, 192, 256)
SHARES = (48, 80, 112, 132)
COPIES = 3  # weight sets cycled: one projection's weights (o: 32 MiB) would otherwise stay in L2
BOTH = ("gemv", "cublas")


@contextlib.contextmanager
def path(name: str):
    """Every projection of the engine's decode forward on the GEMV (``gemv``) or on cuBLAS (``cublas``) while
    it is entered (its graph is captured inside)."""
    from harli_train.engine import decode_forward as df

    saved = df.MAX_GEMV_ROWS, df.CUBLAS_SQUARE_ROWS
    never = 1 << 30
    df.MAX_GEMV_ROWS, df.CUBLAS_SQUARE_ROWS = (never, never) if name == "gemv" else (0, never)
    try:
        yield
    finally:
        df.MAX_GEMV_ROWS, df.CUBLAS_SQUARE_ROWS = saved


def layer_calls(mc, device, dtype, m: int) -> dict[str, Any]:
    """name -> a call of that projection of one layer over ``m`` rows, as the decode forward makes it, each
    call on the next of ``COPIES`` weight sets."""
    import torch

    from harli_train.engine import decode_forward as df

    h = mc.hidden_size
    norm = SimpleNamespace(weight=torch.ones(h, device=device, dtype=dtype), eps=1e-5)
    residual = torch.randn(m, h, device=device, dtype=dtype)
    out = {}
    for name, (ns, k, swiglu) in gemv_by_share.projections(mc).items():
        sets = [tuple(torch.randn(n, k, device=device, dtype=dtype) for n in ns) for _ in range(COPIES)]
        x = torch.randn(m, k, device=device, dtype=dtype)
        turn = itertools.cycle(sets)
        if name in ("o", "down"):
            out[name] = lambda x=x, turn=turn: df._project_add_norm(x, next(turn)[0], residual, norm)
        else:
            out[name] = lambda x=x, turn=turn, swiglu=swiglu: df._project(x, next(turn), swiglu)
    return out


def gemv_rows(mc, device, green_stream, rows=ROWS, shares=SHARES) -> dict[str, Any]:
    """Per share (``green_stream(n)``: a stream on a green context of ``n`` SMs, the SMs granted, handles to
    keep) and row count: microseconds of each projection of one layer on the GEMV path and on the cuBLAS path,
    the layer's sums (``layer_*_us``; ``layer_gemv_us`` keeps o on cuBLAS from ``CUBLAS_SQUARE_ROWS`` rows,
    as the engine does) and ``gemv_up_to``."""
    import torch

    from harli_train.engine.decode_forward import CUBLAS_SQUARE_ROWS
    from harli_train.engine.decode_linear import decode_linear_config
    from harli_train.engine.engine_config import MAX_GEMV_ROWS

    on_gpu = device.type == "cuda"
    layer = gemv_by_share.projections(mc)
    out: dict[str, Any] = {
        "rule_max_gemv_rows": MAX_GEMV_ROWS,
        "cublas_square_rows": CUBLAS_SQUARE_ROWS,
        "by_share": {},
    }
    if not on_gpu:
        out["configs"] = {
            f"{name}_m{m}": str(decode_linear_config(m, ns, k, shares[-1], swiglu, 4))
            for m in rows
            for name, (ns, k, swiglu) in layer.items()
        }
        return out
    from harli_train.kernels.launch_config import sm_budget

    keep = []
    for n in shares:
        stream, got, handles = green_stream(n)
        keep.append(handles)
        by_rows: dict[str, Any] = {}
        for m in rows:
            calls = layer_calls(mc, device, torch.bfloat16, m)
            row: dict[str, Any] = {}
            for which in BOTH:
                for name, fn in calls.items():
                    try:
                        with path(which), sm_budget(got):
                            us = common.graph_ms(fn, reps=3 * COPIES, stream=stream) * 1e3
                    except Exception as err:  # e.g. a tile past the SM's resources: the rest still runs
                        row.setdefault("errors", []).append(
                            f"{name} {which}: {str(err).splitlines()[0][:200]}"
                        )
                        us = float("inf")
                    row[f"{name}_{which}_us"] = us
            o_gemv = "o_cublas_us" if m >= CUBLAS_SQUARE_ROWS else "o_gemv_us"
            row["layer_gemv_us"] = sum(row[f"{p}_gemv_us"] for p in layer if p != "o") + row[o_gemv]
            row["layer_cublas_us"] = sum(row[f"{p}_cublas_us"] for p in layer)
            row["gemv_over_cublas"] = row["layer_gemv_us"] / row["layer_cublas_us"]
            by_rows[str(m)] = row
            print(
                "gemv rows",
                got,
                m,
                {k: v if k == "errors" else round(v, 2) for k, v in row.items()},
                flush=True,
            )
            del calls
            torch.cuda.empty_cache()
        out["by_share"][str(got)] = {"sms": got, "rows": by_rows}
    out["gemv_up_to"] = {
        s: gemv_up_to({int(m): r["gemv_over_cublas"] for m, r in v["rows"].items()})
        for s, v in out["by_share"].items()
    }
    return out


def gemv_up_to(gemv_over_cublas: dict[int, float]) -> int | None:
    """The most rows up to which the GEMV's layer is no slower than cuBLAS's at every row count timed (None:
    slower already at the fewest)."""
    most = None
    for m in sorted(gemv_over_cublas):
        if gemv_over_cublas[m] > 1.0:
            break
        most = m
    return most


def print_summary(res: dict[str, Any]) -> None:
    """The table of ``gemv_rows``'s result (nothing without measured shares)."""
    rows = [
        [v["sms"], int(m), r["layer_gemv_us"], r["layer_cublas_us"], r["gemv_over_cublas"]]
        for v in res["by_share"].values()
        for m, r in v["rows"].items()
    ]
    if rows:
        print(f"one layer's projections by rows (the rule: the GEMV up to {res['rule_max_gemv_rows']} rows):")
        print(common.table(rows, ["SMs", "rows", "GEMV us", "cuBLAS us", "GEMV / cuBLAS"]))
        print("the GEMV no slower up to (rows, by share):", res["gemv_up_to"])
