"""bench_decode's batched-LoRA sections: TPOT with adapters, one engine per EngineConfig.lora_kernel, and the
LoRA delta kernels alone beside the projections they feed.

Rows (4 random rank-16 adapters on all seven projections, batch 1-64): "lora_base" (every request on the
base: must cost what "default" does), "lora_1" (every request on one adapter) and "lora_mix4" (requests
spread over four adapters) on the "split" kernel (the delta computed before the projection); "lora_1_gemv"
and "lora_mix4_gemv" on "gemv" (inside the projection's launches; EngineConfig's default); and
"lora_1_gemv_split" and "lora_mix4_gemv_split" on "gemv" with the norms after o and down split by columns
(`decode_norm_shrink.SPLIT_NORM_ROWS` at `decode_linear.EXPAND_IN_NORM_ROWS`: the A/B that sets that
default). Targets: TPOT within 10 % (lora_1*) and 15 % (lora_mix4*) of lora_base's, compared in this run
(`lora.ratios`). `lora.kernel` times one layer's projections at batch 1, 8 and 64 inside CUDA graphs: the
GEMV alone, with an fp32 addend (what the delta costs the projection's epilogue), with the LoRA in its
launches (`gemv_lora_*`), and each delta kernel on one adapter and on four.
"""

from __future__ import annotations

import functools
import time
import traceback

import common

RANK, ADAPTERS = 16, 4
TARGETS = {
    "lora_1": 1.10,
    "lora_mix4": 1.15,
    "lora_1_gemv": 1.10,
    "lora_mix4_gemv": 1.15,
    "lora_1_gemv_split": 1.10,
    "lora_mix4_gemv_split": 1.15,
}


def random_adapters(model, n: int, rank: int, seed: int = 0) -> list[dict]:
    """`n` adapters for `model` (module path -> (A [rank, in], B [out, rank]), on the host)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [
        {
            path: (
                torch.randn(rank, m.in_features, generator=gen) / m.in_features**0.5,
                torch.randn(m.out_features, rank, generator=gen) * 0.01,
            )
            for path, m in model.lora_modules().items()
        }
        for _ in range(n)
    ]


def lora_sections(bench, device) -> dict:
    """The TPOT rows and the kernel timings (see the module docstring); engines freed when this returns."""
    import gc

    import torch

    from harli_train.engine import DecodeEngine, EngineConfig, decode_norm_shrink
    from harli_train.engine.decode_linear import EXPAND_IN_NORM_ROWS

    model = bench.load_model(device)
    batches = [b for b in bench.batches if b <= 64]
    adapters = random_adapters(model, ADAPTERS, RANK)
    mix = tuple(range(1, ADAPTERS + 1))
    # (lora_kernel, the norm's split rows while the engine is built and run): the rows each engine serves.
    plan = {
        ("split", 0): {"lora_base": (0,), "lora_1": (1,), "lora_mix4": mix},
        ("gemv", 0): {"lora_1_gemv": (1,), "lora_mix4_gemv": mix},
        ("gemv", EXPAND_IN_NORM_ROWS): {"lora_1_gemv_split": (1,), "lora_mix4_gemv_split": mix},
    }
    out: dict = {"rank": RANK, "adapters": ADAPTERS, "errors": {}}
    points = [(b, bench.ctx) for b in batches]
    default_split = decode_norm_shrink.SPLIT_NORM_ROWS
    for (kernel, split_rows), variants in plan.items():
        engine = None
        decode_norm_shrink.SPLIT_NORM_ROWS = split_rows  # read as each graph is captured
        try:
            cfg = EngineConfig(
                max_num_seqs=max(batches),
                max_model_len=bench.ctx + bench.warmup + bench.steps + 16,
                graph_batch_sizes=tuple(batches),
                gpu_memory_utilization=0.6,
                num_kv_blocks=256 if bench.dry else None,
                max_loras=ADAPTERS,
                max_lora_rank=RANK,
                lora_kernel=kernel,
            )
            engine = DecodeEngine(model, cfg)
            for slot, pairs in enumerate(adapters, start=1):
                engine.load_lora(slot, pairs, RANK, 2.0)
            out["slot_MB"] = engine.lora.nbytes / 2**20
            for label, slots in variants.items():
                out[label] = bench.sweep(engine, "default", points, label=label, slots=slots)
        except Exception as e:  # the other kernel's rows still count
            out["errors"][f"{kernel}/{split_rows}"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            decode_norm_shrink.SPLIT_NORM_ROWS = default_split
            if engine is not None:
                engine.close()
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    base = out.get("lora_base", {})
    out["ratios"] = {
        label: {k: out[label][k]["tpot_ms"] / base[k]["tpot_ms"] for k in base if k in out[label]}
        for label in TARGETS
        if label in out
    }
    out["targets"] = TARGETS
    try:
        out["kernel"] = kernel_times(model.config, device, [1, 4] if bench.dry else [1, 8, 64])
    except Exception as e:
        out["errors"]["kernel"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    return out


def _wall_us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def kernel_times(mc, device, batches) -> dict:
    """Microseconds per projection of one layer and batch: `gemv`, `gemv_addend`, `gemv_lora_{1,mix4}` and
    `{fused,split}_{1,mix4}` (the delta kernels, grid sized for the batch as in its graph). On the CPU the
    torch references are timed instead (the code path only)."""
    import numpy as np
    import torch

    from harli_train.engine.lora_ops import lora_add_reference, lora_layout

    h, q, kv, inter = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    shapes = {
        "qkv": ((q, kv, kv), h, False),
        "o": ((h,), q, False),
        "gate_up": ((inter, inter), h, True),
        "down": ((h,), inter, False),
    }
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if on_gpu:
        from harli_train.engine.decode_linear import GemvLoRA, decode_linear
        from harli_train.engine.lora_fused import lora_delta_fused, lora_fused_config
        from harli_train.engine.lora_ops import lora_delta_split

        sms = torch.cuda.get_device_properties(device).multi_processor_count
        timed = lambda fn: common.graph_ms(fn) * 1e3
    else:
        from harli_train.engine.decode_linear import decode_linear_reference

        timed = _wall_us
    slots = ADAPTERS + 1
    scales = torch.full((slots,), 2.0, device=device)
    out = {}
    for name, (ns, k, swiglu) in shapes.items():
        ws = [torch.randn(n, k, device=device, dtype=dtype) for n in ns]
        a = [torch.randn(slots, RANK, k, device=device, dtype=dtype) * k**-0.5 for _ in ns]
        b = [torch.randn(slots, n, RANK, device=device, dtype=dtype) * 0.01 for n in ns]
        cols = [sum(ns[:i]) for i in range(len(ns))]
        for bsz in batches:
            x = torch.randn(bsz, k, device=device, dtype=dtype)
            addend = torch.randn(bsz, sum(ns), device=device)
            row = {}
            if on_gpu:
                row["gemv"] = timed(functools.partial(decode_linear, x, ws, swiglu))
                row["gemv_addend"] = timed(functools.partial(decode_linear, x, ws, swiglu, addend=addend))
                cfg = lora_fused_config(bsz, RANK, k, ns, sms, x.element_size())
                row["fused_config"] = f"bm{cfg.block_m} bn{cfg.block_n}x{cfg.n_sub} bk{cfg.block_k}"
            else:
                row["gemv"] = timed(functools.partial(decode_linear_reference, x, ws, swiglu))
                row["gemv_addend"] = timed(functools.partial(decode_linear_reference, x, ws, swiglu, addend))
            for mix, token_slots in (("1", np.ones(bsz)), ("mix4", 1 + np.arange(bsz) % ADAPTERS)):
                token_slots = token_slots.astype(np.int64)
                ids, start = (torch.from_numpy(t).to(device) for t in lora_layout(token_slots, slots))
                if on_gpu:
                    for kernel, fn in (("fused", lora_delta_fused), ("split", lora_delta_split)):
                        row[f"{kernel}_{mix}"] = timed(
                            functools.partial(fn, x, a, b, ids, start, scales, bsz)
                        )
                    a_stack = torch.stack(a).reshape(-1, k)
                    bt = torch.cat([t.transpose(1, 2) for t in b], dim=2).contiguous()
                    lora = GemvLoRA(a_stack, bt, scales, ids, start, RANK, slots)
                    row[f"gemv_lora_{mix}"] = timed(
                        functools.partial(decode_linear, x, ws, swiglu, lora=lora)
                    )
                else:
                    zeros = torch.zeros(bsz, sum(ns), device=device)
                    tokens = torch.from_numpy(token_slots).to(device)
                    ref = functools.partial(lora_add_reference, zeros, x, a, b, cols, tokens, scales)
                    row[f"reference_{mix}"] = timed(ref)
            out[f"{name}_b{bsz}"] = row
            print(
                "lora kernel",
                name,
                bsz,
                {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()},
            )
    return out


def print_summary(lora: dict) -> None:
    """The ratio lines (against the targets) and the kernel timings, for bench_decode's summary."""
    for label, ratios in lora.get("ratios", {}).items():
        if not ratios:
            continue
        worst = max(ratios.values())
        verdict = "ok" if worst <= lora["targets"][label] else "MISS"
        print(
            f"{label}: TPOT / lora_base "
            + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
            + f"  (target <= {lora['targets'][label]}: {verdict})"
        )
    if lora.get("kernel"):
        print("LoRA delta kernels alone (us; gemv = the projection they feed, gemv_addend = with the delta):")
        for key, row in lora["kernel"].items():
            cells = "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"({v})" for k, v in row.items())
            print(f"  {key:12s} {cells}")
