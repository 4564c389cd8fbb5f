"""Triton kernels against torch on Llama-3-8B shapes: bf16 correctness, then fwd+bwd time per SM count.

    python bench/bench_kernels.py            # on the GPU; writes $OUT/bench_kernels.json, prints a table last
    python bench/bench_kernels.py --dry-run  # on the CPU: tiny shapes through Triton's interpreter, fp32

Section 1 runs each op forward and backward in bf16 under autocast (as the model does) and compares every
output and input gradient with the fp32 reference on the same (rounded) inputs; the bf16 torch path's own
error is shown beside it. Section 2 times forward+backward (median of CUDA-event timings after warm-up)
of the Triton op and of its eager torch reference, on the whole GPU and inside green contexts of 96 / 64 /
32 SMs made through cuda.bindings (as probes/probe_split.py does), with `sm_budget` set to the SMs each
context really got. Every section and case is guarded: one failure is recorded, the rest still run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import torch  # noqa: E402

from harli_train.colocate.step_timing import time_calls  # noqa: E402

LLAMA_8B = dict(
    batch=4, seq=1024, hidden=4096, q=4096, kv=1024, inter=14336, vocab=128256, rank=16, head_dim=128
)
TINY = dict(batch=1, seq=37, hidden=48, q=48, kv=24, inter=80, vocab=203, rank=8, head_dim=12)
# Pass mark for bf16: max |triton - fp32 ref| / max |fp32 ref| per output and gradient, or at most twice
# the error of torch's own bf16 path (whichever is larger).
BF16_REL_TOL = 2e-2
LORA_SCALE = 2.0  # alpha 32 / rank 16
EPS = 1e-5


@dataclass
class Case:
    name: str
    make: Callable[[], dict]  # fresh inputs: leaf tensors, the trainable ones requiring grad
    triton: Callable[[dict], list]  # forward through the Triton op
    torch: Callable[[dict], list]  # forward through the eager torch reference


def build_cases(s: dict, device: str, dtype: torch.dtype) -> list[Case]:
    from harli_train.kernels import reference as ref
    from harli_train.kernels.linear_cross_entropy import linear_cross_entropy
    from harli_train.kernels.lora_linear import lora_linear, lora_linear_group
    from harli_train.kernels.rms_norm import add_rms_norm, rms_norm
    from harli_train.kernels.rope import apply_rope
    from harli_train.kernels.swiglu import swiglu

    m, hid, inter, r = s["batch"] * s["seq"], s["hidden"], s["inter"], s["rank"]

    def t(*shape, scale=1.0, grad=True, dt=dtype):
        return (torch.randn(*shape, device=device) * scale).to(dt).requires_grad_(grad)

    def lora_inputs(n_in, outs):
        inp = dict(x=t(m, n_in))
        for i, n_out in enumerate(outs):
            inp.update(
                {
                    f"w{i}": t(n_out, n_in, scale=n_in**-0.5, grad=False),
                    f"a{i}": t(r, n_in, scale=n_in**-0.5, dt=torch.float32),
                    f"b{i}": t(n_out, r, scale=r**-0.5, dt=torch.float32),
                }
            )
        return inp

    def members(inp):
        n = sum(k.startswith("w") for k in inp)
        return [(inp[f"w{i}"], None, inp[f"a{i}"], inp[f"b{i}"], LORA_SCALE) for i in range(n)]

    def lora_case(name, n_in, outs):
        make = lambda: lora_inputs(n_in, outs)
        if len(outs) == 1:
            return Case(
                name,
                make,
                lambda i: [lora_linear(i["x"], *members(i)[0])],
                lambda i: [ref.lora_linear(i["x"], *members(i)[0])],
            )
        return Case(
            name,
            make,
            lambda i: lora_linear_group(i["x"], members(i)),
            lambda i: ref.lora_linear_group(i["x"], members(i)),
        )

    def rope_inputs():
        b, seq, d = s["batch"], s["seq"], s["head_dim"]
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
        ang = torch.arange(seq, device=device).float()[:, None] * inv
        ang = torch.cat([ang, ang], -1)[None]
        return dict(q=t(b, seq, s["q"] // d, d), k=t(b, seq, s["kv"] // d, d), cos=ang.cos(), sin=ang.sin())

    def ce_inputs():
        labels = torch.randint(0, s["vocab"], (m,), device=device)
        labels[torch.rand(m, device=device) < 0.1] = -100
        return dict(h=t(m, hid), w=t(s["vocab"], hid, scale=0.02, grad=False), labels=labels)

    return [
        Case(
            "rms_norm",
            lambda: dict(x=t(m, hid), w=t(hid, grad=False)),
            lambda i: [rms_norm(i["x"], i["w"], EPS)],
            lambda i: [ref.rms_norm(i["x"], i["w"], EPS)],
        ),
        Case(
            "add_rms_norm",
            lambda: dict(x=t(m, hid), r=t(m, hid), w=t(hid, grad=False)),
            lambda i: list(add_rms_norm(i["x"], i["r"], i["w"], EPS)),
            lambda i: list(ref.add_rms_norm(i["x"], i["r"], i["w"], EPS)),
        ),
        Case(
            "rope",
            rope_inputs,
            lambda i: list(apply_rope(i["q"], i["k"], i["cos"], i["sin"])),
            lambda i: list(ref.apply_rope(i["q"], i["k"], i["cos"], i["sin"])),
        ),
        Case(
            "swiglu",
            lambda: dict(g=t(m, inter), u=t(m, inter)),
            lambda i: [swiglu(i["g"], i["u"])],
            lambda i: [ref.swiglu(i["g"], i["u"])],
        ),
        lora_case("lora_q", hid, [s["q"]]),
        lora_case("lora_down", inter, [hid]),
        lora_case("lora_qkv_group", hid, [s["q"], s["kv"], s["kv"]]),
        lora_case("lora_gate_up_group", hid, [inter, inter]),
        Case(
            "linear_cross_entropy",
            ce_inputs,
            lambda i: [linear_cross_entropy(i["h"], i["w"], i["labels"])[0]],
            lambda i: [ref.linear_cross_entropy(i["h"], i["w"], i["labels"])[0]],
        ),
    ]


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()


def _leaves(inp: dict) -> list[str]:
    return [k for k, v in inp.items() if isinstance(v, torch.Tensor) and v.requires_grad]


def _cotangents(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator(device=outs[0].device).manual_seed(1)
    return [
        torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) if o.dim() else torch.ones_like(o)
        for o in outs
    ]


def fwd_bwd(fn: Callable, inp: dict, autocast, cots: list | None = None):
    """Forward under `autocast`, backward outside it (as the trainer does); returns (outs, grads, cots)."""
    with autocast:
        outs = fn(inp)
    cots = _cotangents(outs) if cots is None else [c.to(o.dtype) for c, o in zip(cots, outs, strict=True)]
    grads = torch.autograd.grad(outs, [inp[k] for k in _leaves(inp)], cots)
    return outs, grads, cots


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got.detach().float() - want.detach().float()).abs().max().item()
    return diff, diff / max(want.detach().abs().max().item(), 1e-30)


def check_case(case: Case, device: str) -> dict:
    inp = case.make()
    outs_t, grads_t, cots = fwd_bwd(case.triton, inp, _autocast(device))
    outs_b, grads_b, _ = fwd_bwd(case.torch, inp, _autocast(device), cots)
    ref_inp = {
        k: v.detach().float().requires_grad_(v.requires_grad) if v.is_floating_point() else v
        for k, v in inp.items()
    }
    outs_r, grads_r, _ = fwd_bwd(case.torch, ref_inp, contextlib.nullcontext(), [c.float() for c in cots])
    names = [f"out{i}" for i in range(len(outs_r))] + [f"d{k}" for k in _leaves(inp)]
    rows, ok = {}, True
    for name, got, lo, want in zip(
        names, [*outs_t, *grads_t], [*outs_b, *grads_b], [*outs_r, *grads_r], strict=True
    ):
        abs_t, rel_t = _rel_err(got, want)
        _, rel_b = _rel_err(lo, want)
        finite = bool(torch.isfinite(got).all())
        ok &= finite and rel_t <= max(BF16_REL_TOL, 2 * rel_b)
        rows[name] = dict(triton_max_abs=abs_t, triton_rel=rel_t, torch_bf16_rel=rel_b, finite=finite)
    return dict(
        ok=ok,
        tensors=rows,
        worst_triton_rel=max(r["triton_rel"] for r in rows.values()),
        worst_torch_bf16_rel=max(r["torch_bf16_rel"] for r in rows.values()),
    )


class GreenStream:
    """A green context of about `n` SMs and its stream, wrapped for torch.

    The SMs come from cuDevSmResourceSplitByCount, so the set is disjoint from the rest of the device
    (torch 2.11's GreenContext.create takes SMs from the start of the device and overlaps; docs/design.md).
    Contexts live until the process ends: the caching allocator may still hold blocks tagged with the stream.
    """

    def __init__(self, n: int):
        from cuda.bindings import driver as cu

        def check(result):
            if result[0] != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuda driver: {result[0]}")
            return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)

        check(cu.cuInit(0))
        dev = check(cu.cuDeviceGet(torch.cuda.current_device()))
        sm_all = check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        groups, _, _ = check(cu.cuDevSmResourceSplitByCount(1, sm_all, 0, n))
        group = groups[0] if isinstance(groups, (list, tuple)) else groups
        desc = check(cu.cuDevResourceGenerateDesc([group], 1))
        flags = cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        self.ctx = check(cu.cuGreenCtxCreate(desc, dev, flags))
        raw = check(cu.cuGreenCtxStreamCreate(self.ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        self.sms = int(group.sm.smCount)
        self.stream = torch.cuda.ExternalStream(int(raw))


def time_ms(fn: Callable[[], object], stream, reps: int, warmup: int) -> float:
    """Median milliseconds of fn() over `reps` runs after `warmup` runs, on `stream` (None: CPU clock);
    the decode profile's timer (CUDA events on the stream)."""
    return 1e3 * common.median(time_calls(fn, stream, warmup, reps))


def time_graph_ms(fn: Callable[[], object], stream, reps: int) -> float:
    """Median milliseconds of one replay of fn() captured as a CUDA graph: GPU time without launch cost.

    Captured on `stream` (a green context's stream keeps its SMs when replayed), or on a side stream for
    the whole GPU (the legacy default stream cannot capture). fn must have been warmed up already.
    """
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream() if stream is None or stream == torch.cuda.default_stream() else stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # one run on the capture stream first: lazy per-stream state (cuBLAS)
        fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=side):
        fn()
    run_on = stream if stream is not None else torch.cuda.current_stream()
    with torch.cuda.stream(run_on):
        graph.replay()
        events = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(run_on)
            graph.replay()
            end.record(run_on)
            events.append((start, end))
    torch.cuda.synchronize()
    del graph
    return common.median([s.elapsed_time(e) for s, e in events])


def peak_gib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def time_case(case: Case, device: str, stream, reps: int, warmup: int, memory: dict | None) -> dict:
    """Median fwd+bwd milliseconds of the Triton op and of the torch reference on the same inputs.

    `*_ms` is eager (what a training step pays, CPU launch cost included: it dominates the small ops on a
    whole H200); `*_graph_ms` replays a CUDA graph of the same work (GPU time only), when capture works.
    """
    inp = case.make()
    row = {}
    for impl in ("triton", "torch"):
        fn = getattr(case, impl)
        _, _, cots = fwd_bwd(fn, inp, _autocast(device))
        run = lambda fn=fn, cots=cots: fwd_bwd(fn, inp, _autocast(device), cots)
        row[f"{impl}_ms"] = time_ms(run, stream, reps, warmup)
        if memory is not None:
            memory[impl] = peak_gib(run)
        if device == "cuda":
            try:
                row[f"{impl}_graph_ms"] = time_graph_ms(run, stream, reps)
            except Exception as exc:  # keep the eager figure; say why the graph failed
                row[f"{impl}_graph_error"] = repr(exc)[-500:]
    row["speedup"] = row["torch_ms"] / row["triton_ms"]
    if "triton_graph_ms" in row and "torch_graph_ms" in row:
        row["graph_speedup"] = row["torch_graph_ms"] / row["triton_graph_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, Triton interpreter, fp32")
    parser.add_argument("--sms", default="96,64,32", help="green-context SM counts besides the whole GPU")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ops", default="", help="comma-separated subset of cases")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported
        args.reps, args.warmup = min(args.reps, 2), 1
    from harli_train.kernels.launch_config import device_num_sms, sm_budget

    device = "cpu" if args.dry_run else "cuda"
    shapes = TINY if args.dry_run else LLAMA_8B
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    torch.manual_seed(0)
    cases = build_cases(shapes, device, dtype)
    if args.ops:
        cases = [c for c in cases if c.name in args.ops.split(",")]
    result = dict(
        env=common.environment(),
        dry_run=args.dry_run,
        shapes=shapes,
        dtype=str(dtype),
        bf16_rel_tol=BF16_REL_TOL,
        correctness={},
        timing={},
        memory_gib={},
        errors={},
    )
    save = lambda: common.write_json("bench_kernels.json", result)

    # 1. Correctness against the fp32 reference.
    for case in cases:
        try:
            result["correctness"][case.name] = check_case(case, device)
        except Exception:
            result["errors"][f"correctness/{case.name}"] = traceback.format_exc()[-3000:]
        if device == "cuda":
            torch.cuda.empty_cache()
    save()

    # 2. Forward+backward time, Triton vs torch, per SM count.
    settings: list[tuple[str, int, object]] = [
        ("full", device_num_sms(), None if args.dry_run else torch.cuda.current_stream())
    ]
    for n in [int(v) for v in args.sms.split(",") if v]:
        try:
            if args.dry_run:  # no green contexts on the CPU: exercise the budget only
                settings.append((f"{n}sm", n, None))
            else:
                green = GreenStream(n)
                settings.append((f"{n}sm", green.sms, green.stream))
        except Exception:
            result["errors"][f"green_context/{n}"] = traceback.format_exc()[-3000:]
    for label, sms, stream in settings:
        for case in cases:
            track_memory = label == "full" and device == "cuda"
            memory = result["memory_gib"].setdefault(case.name, {}) if track_memory else None
            try:
                with sm_budget(sms):
                    row = time_case(case, device, stream, args.reps, args.warmup, memory)
                result["timing"].setdefault(case.name, {})[label] = dict(sms=sms, **row)
            except Exception:
                result["errors"][f"timing/{case.name}/{label}"] = traceback.format_exc()[-3000:]
            if device == "cuda":
                torch.cuda.empty_cache()
        save()

    path = save()
    labels = [label for label, _, _ in settings]
    rows = []
    for case in cases:
        corr = result["correctness"].get(case.name, {})
        timing = result["timing"].get(case.name, {})
        mem = result["memory_gib"].get(case.name, {})
        nan = float("nan")
        full = timing.get("full", {})
        # GPU-time ratios (CUDA graphs) where captured, else eager ones (marked e).
        ratios = [timing.get(label, {}).get("graph_speedup") for label in labels]
        ratios = [
            f"{r:.3g}" if r is not None else f"{timing.get(label, {}).get('speedup', nan):.3g}e"
            for r, label in zip(ratios, labels, strict=True)
        ]
        rows.append(
            [
                case.name,
                "ok" if corr.get("ok") else "FAIL" if corr else "error",
                corr.get("worst_triton_rel", nan),
                corr.get("worst_torch_bf16_rel", nan),
                full.get("triton_graph_ms", full.get("triton_ms", nan)),
                full.get("torch_graph_ms", full.get("torch_ms", nan)),
                *ratios,
                full.get("speedup", nan),
                f"{mem.get('triton', nan):.2f}/{mem.get('torch', nan):.2f}",
            ]
        )
    header = [
        "op",
        "check",
        "rel err",
        "torch rel err",
        "triton ms",
        "torch ms",
        *[f"x {label} ({sms} SMs)" for label, sms, _ in settings],
        "x eager full",
        "peak GiB tri/torch",
    ]
    print(f"errors: {list(result['errors'])}" if result["errors"] else "errors: none")
    print(
        "x = torch time / triton time of forward+backward: GPU time from CUDA-graph replays where captured "
        "(e: eager,\nlaunch cost included); rel err = max |err| / max |fp32 ref| over outputs and grads"
    )
    print(f"wrote {path}")
    print(common.table(rows, header))


if __name__ == "__main__":
    main()
