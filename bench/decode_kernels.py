"""bench_decode's kernel sections: each decode projection alone (the engine's GEMV against cuBLAS, with a
sweep of its tile sizes), one step's weight GEMMs alone, and the paged attention kernel alone, each with the
bandwidth it achieves."""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gemv_by_share  # noqa: E402


def linears_only_ms(model, batch: int, device, reps: int = 20) -> float:
    """One decode step's weight GEMMs alone (cuBLAS through F.linear, in one CUDA graph): the floor that the
    model's unfused projections can reach."""
    import torch
    import torch.nn.functional as F

    from harli_train.model import LoRALinear

    weights = [m.weight for m in model.modules() if isinstance(m, LoRALinear)] + [model.lm_head.weight]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], device=device, dtype=w.dtype) for w in weights}
    run = lambda: [F.linear(xs[w.shape[1]], w) for w in weights]
    if device.type != "cuda":
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e3
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _unfused_projection(x, weights, swiglu: bool):
    import torch.nn.functional as F

    ys = [F.linear(x, w) for w in weights]
    return F.silu(ys[0]) * ys[1] if swiglu else ys


def _gemv_sweep(x, ws, cfg) -> dict:
    """Microseconds of the projection over a small grid of row-tile sizes and K splits around `cfg` (data
    for the config rule; the engine uses `cfg`)."""
    from harli_train.engine.decode_linear import SMEM_PER_SM, decode_linear, with_config

    out = {}
    for block_n in (32, 64, 128):
        stage_bytes = (block_n + cfg.block_m) * cfg.block_k * x.element_size()
        stages = max(2, min(4, (SMEM_PER_SM // 2 - 8192) // stage_bytes))
        for split in (1, 2, 4):
            c = with_config(cfg, block_n=block_n, split_k=split, num_stages=stages)
            fn = functools.partial(decode_linear, x, ws, False, config=c)
            out[f"bn{block_n}_split{split}_st{stages}"] = common.graph_ms(fn) * 1e3
    return out


def gemv_kernel(mc, device, batches) -> dict:
    """Each decode projection of one layer (and the LM head) alone: the engine's GEMV kernel (its config,
    and at batch 1 also the tensor-core variant) against cuBLAS on the same unfused weights (q, k, v and
    gate, up as separate F.linear calls, SwiGLU after), with achieved GB/s over the weight bytes."""
    import torch

    shapes = {**gemv_by_share.projections(mc), "lm_head": ((mc.vocab_size,), mc.hidden_size, False)}
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if on_gpu:
        from harli_train.engine.decode_linear import decode_linear, decode_linear_config, with_config
    else:  # the interpreter would be slow: time the reference, for the code path only
        from harli_train.engine.decode_linear import decode_linear_reference
    out = {}
    for name, (ns, k, swiglu) in shapes.items():
        ws = [torch.randn(n, k, device=device, dtype=dtype) for n in ns]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for b in batches:
            x = torch.randn(b, k, device=device, dtype=dtype)

            cublas = functools.partial(_unfused_projection, x, ws, swiglu)
            row = {"MB": nbytes / 1e6}
            if on_gpu:
                cfg = decode_linear_config(
                    1 if b == 1 else 1 << (b - 1).bit_length(),
                    ns,
                    k,
                    torch.cuda.get_device_properties(device).multi_processor_count,
                    swiglu,
                    x.element_size(),
                )
                row["config"] = (
                    f"bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} split{cfg.split_k} "
                    f"st{cfg.num_stages} {'dot' if cfg.use_dot else 'fma'}"
                )
                row["gemv_us"] = common.graph_ms(functools.partial(decode_linear, x, ws, swiglu)) * 1e3
                if b == 1:
                    dot = with_config(cfg, block_m=16, block_n=64, block_k=128, use_dot=True, num_stages=4)
                    row["gemv_dot_us"] = (
                        common.graph_ms(functools.partial(decode_linear, x, ws, swiglu, config=dot)) * 1e3
                    )
                row["cublas_us"] = common.graph_ms(cublas) * 1e3
                if b >= 16 and name in ("qkv", "o", "down"):
                    row["sweep"] = _gemv_sweep(x, ws, cfg)
                    row["sweep_best"] = min(row["sweep"].items(), key=lambda kv: kv[1])
            else:
                t0 = time.perf_counter()
                decode_linear_reference(x, ws, swiglu=swiglu)
                row["gemv_us"] = (time.perf_counter() - t0) * 1e6
                t0 = time.perf_counter()
                cublas()
                row["cublas_us"] = (time.perf_counter() - t0) * 1e6
            for key in ("gemv_us", "gemv_dot_us", "cublas_us"):
                if key in row:
                    row[key.replace("_us", "_GBps")] = nbytes / row[key] / 1e3
            out[f"{name}_b{b}"] = row
            print(
                "gemv",
                name,
                b,
                {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()},
                flush=True,
            )
    return out


def attention_kernel(mc, device, points, reps: int = 30) -> dict:
    """The paged decode kernel alone (one layer, the new token's K/V stored by it): achieved bandwidth over
    the K/V it reads, to set against the copy bandwidth."""
    import torch

    if device.type == "cuda":
        from harli_train.engine.paged_decode import paged_decode as decode
    else:
        from harli_train.engine.reference import paged_decode_reference as decode
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv, d, bs = mc.num_heads, mc.num_kv_heads, mc.head_dim, 16
    out = {}
    for b, ctx in points:
        width = -(-ctx // bs)
        kc = torch.randn(b * width, bs, hkv, d, device=device, dtype=dtype)
        vc = torch.randn_like(kc)
        tables = torch.randperm(b * width, device=device).view(b, width).int()
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(b, hq, d, device=device, dtype=dtype)
        k_new, v_new = torch.randn_like(q[:, :hkv]), torch.randn_like(q[:, :hkv])
        new = (k_new, v_new, tables[:, width - 1].long() * bs + (ctx - 1) % bs)
        decode(q, kc, vc, tables, lens, d**-0.5, 132, new_kv=new)  # compiles
        common.sync_device(device)
        t0 = time.perf_counter()
        for _ in range(reps):  # queued back to back: small launches overlap the previous kernel
            decode(q, kc, vc, tables, lens, d**-0.5, 132, new_kv=new)
        common.sync_device(device)
        us = (time.perf_counter() - t0) / reps * 1e6
        gbytes = b * ctx * hkv * d * 2 * kc.element_size() / 1e9
        out[f"b{b}_ctx{ctx}"] = {"us": us, "GBps": gbytes / us * 1e6}
    return out
