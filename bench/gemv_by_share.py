"""Batch 1's decode projections by SM share: the FMA GEMV against the tensor-core tiles (a bench_decode
section).

``decode_linear_config`` streams batch 1 with FMAs from ``FMA_MIN_SMS`` SMs up and with the tensor-core tiles
below. This section times one layer's projections (q/k/v, o, gate/up with the SwiGLU, down) at batch 1 both
ways on a green context of each share, each config sized for that share, inside one CUDA graph on the
context's stream; the share from which the FMAs are no slower is where the threshold belongs. A CPU has no
green contexts: the dry run only records the two configs of each projection.
"""

from __future__ import annotations

import functools
from typing import Any

import common

SHARES = (16, 32, 48, 64, 80, 96, 112, 132)
NEVER = 1 << 30  # an fma_min_sms no share reaches: the tensor-core tiles at batch 1


def projections(mc) -> dict[str, tuple[tuple[int, ...], int, bool]]:
    """name -> (weights' rows, K, SwiGLU) of one decoder layer of model config ``mc``."""
    h, q, kv, inter = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    return {
        "qkv": ((q, kv, kv), h, False),
        "o": ((h,), q, False),
        "gate_up": ((inter, inter), h, True),
        "down": ((h,), inter, False),
    }


def gemv_by_share(mc, device, green_stream, shares=SHARES) -> dict[str, Any]:
    """Per share (``green_stream(n)``: a stream on a green context of ``n`` SMs, the SMs granted, handles to
    keep): microseconds of each projection at batch 1 with FMAs and with the tiles, the layer's sums and
    their ratio (tiles / FMAs: below 1, the tiles win); ``fma_from``: the least share from which the FMAs
    are no slower on every larger one (None: the tiles win everywhere)."""
    import torch

    from harli_train.engine.decode_linear import FMA_MIN_SMS, decode_linear, decode_linear_config

    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    layer = projections(mc)
    out: dict[str, Any] = {"rule_fma_min_sms": FMA_MIN_SMS, "by_share": {}}
    variants = (("fma", 0), ("tiles", NEVER))
    if not on_gpu:
        out["configs"] = {
            name: {
                label: str(decode_linear_config(1, ns, k, shares[0], swiglu, 4, fma_min))
                for label, fma_min in variants
            }
            for name, (ns, k, swiglu) in layer.items()
        }
        return out
    from harli_train.kernels.launch_config import sm_budget

    weights = {
        name: [torch.randn(n, k, device=device, dtype=dtype) for n in ns]
        for name, (ns, k, _) in layer.items()
    }
    x = {k: torch.randn(1, k, device=device, dtype=dtype) for _, k, _ in layer.values()}
    keep = []
    for n in shares:
        stream, got, handles = green_stream(n)
        keep.append(handles)
        row: dict[str, Any] = {"sms": got}
        for label, fma_min in variants:
            total = 0.0
            for name, (ns, k, swiglu) in layer.items():
                cfg = decode_linear_config(1, ns, k, got, swiglu, 2, fma_min)
                fn = functools.partial(decode_linear, x[k], weights[name], swiglu, num_sms=got, config=cfg)
                with sm_budget(got):
                    us = common.graph_ms(fn, stream=stream) * 1e3
                row[f"{name}_{label}_us"] = us
                total += us
            row[f"layer_{label}_us"] = total
        row["tiles_over_fma"] = row["layer_tiles_us"] / row["layer_fma_us"]
        out["by_share"][str(got)] = row
        print("gemv by share", got, {k: round(v, 2) for k, v in row.items()}, flush=True)
    out["fma_from"] = fma_from({int(s): r["tiles_over_fma"] for s, r in out["by_share"].items()})
    return out


def fma_from(tiles_over_fma: dict[int, float]) -> int | None:
    """The least share from which the FMAs are no slower than the tiles on it and on every larger share."""
    least = None
    for s in sorted(tiles_over_fma, reverse=True):
        if tiles_over_fma[s] < 1.0:
            break
        least = s
    return least


def print_summary(res: dict[str, Any]) -> None:
    """The table of ``gemv_by_share``'s result (nothing without measured shares)."""
    rows = [
        [r["sms"], r["layer_fma_us"], r["layer_tiles_us"], r["tiles_over_fma"]]
        for r in res["by_share"].values()
    ]
    if rows:
        rule = res["rule_fma_min_sms"]
        print(f"batch 1's projections of one layer by share (the rule: FMAs from {rule} SMs):")
        print(common.table(rows, ["SMs", "FMA us", "tiles us", "tiles / FMA"]))
        print(f"FMAs no slower from {res['fma_from']} SMs up")
