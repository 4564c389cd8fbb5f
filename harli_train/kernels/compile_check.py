"""Compile every Triton kernel for a GPU architecture on a machine without a GPU.

The launchers run forward and backward on meta tensors (no data, no device) while `JITFunction.run` is
swapped for a recorder; each distinct launch is then compiled ahead of time (`triton.compile` with the
wheel's own ptxas) for the target. This catches what the CPU interpreter cannot: lowering errors, tl.dot
shape rules, shared-memory overflow, register spills. TRITON_INTERPRET must be unset (the kernels must
be JIT functions), so tests run it in a subprocess:

    python -m harli_train.kernels.compile_check [--arch 90] [--json out.json] [--sass DIR] [--decode]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from harli_train.kernels.launch_config import sm_budget


def record_launches(fn: Callable[[], None], target: GPUTarget) -> list[tuple]:
    """Runs fn with every Triton launch recorded instead of executed: [(jit_fn, src, options)].

    Arguments are bound by the JIT's own binder for `target`, so signatures, constexprs and the alignment /
    divisibility specialisation match what a real launch would compile (meta tensors count as aligned).
    """
    backend = make_backend(target)
    launches: list[tuple] = []

    def record(self, *args, grid, warmup, **kwargs):
        kwargs.setdefault("debug", False)
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        launches.append((self, ASTSource(self, signature, constexprs, attrs), options))

    original = JITFunction.run
    JITFunction.run = record
    try:
        fn()
    finally:
        JITFunction.run = original
    return launches


def _fwd_bwd(fn: Callable, *inputs: torch.Tensor) -> None:
    outs = fn(*inputs)
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if o.is_floating_point()]
    grads = [torch.empty_like(o) for o in outs]
    torch.autograd.backward(outs, grads)


def llama_workload(
    tokens: int = 4096,
    hidden: int = 4096,
    q_size: int = 4096,
    kv_size: int = 1024,
    inter: int = 14336,
    vocab: int = 128256,
    rank: int = 16,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Forward and backward of every op at one model's shapes, on meta tensors."""
    from harli_train.kernels.linear_cross_entropy import linear_cross_entropy
    from harli_train.kernels.lora_linear import lora_linear, lora_linear_group
    from harli_train.kernels.rms_norm import add_rms_norm, rms_norm
    from harli_train.kernels.rope import apply_rope
    from harli_train.kernels.swiglu import swiglu

    def t(*shape, dt=dtype, grad=True):
        return torch.empty(shape, dtype=dt, device="meta", requires_grad=grad)

    w_norm = t(hidden, grad=False)
    _fwd_bwd(lambda x: rms_norm(x, w_norm, 1e-5), t(tokens, hidden))
    _fwd_bwd(lambda x, r: add_rms_norm(x, r, w_norm, 1e-5), t(tokens, hidden), t(tokens, hidden))
    _fwd_bwd(lambda x: rms_norm(x, t(hidden), 1e-5), t(tokens, hidden))  # with a weight gradient
    seq = max(tokens // 4, 1)
    cos = t(1, seq, head_dim, dt=torch.float32, grad=False)
    _fwd_bwd(
        lambda q, k: apply_rope(q, k, cos, cos),
        t(tokens // seq, seq, q_size // head_dim, head_dim),
        t(tokens // seq, seq, kv_size // head_dim, head_dim),
    )
    _fwd_bwd(swiglu, t(tokens, inter), t(tokens, inter))

    def member(n_in, n_out):
        return (
            t(n_out, n_in, grad=False),
            None,
            t(rank, n_in, dt=torch.float32),
            t(n_out, rank, dt=torch.float32),
            2.0,
        )

    _fwd_bwd(lambda x: lora_linear(x, *member(inter, hidden)), t(tokens, inter))
    _fwd_bwd(
        lambda x: lora_linear_group(
            x, [member(hidden, q_size), member(hidden, kv_size), member(hidden, kv_size)]
        ),
        t(tokens, hidden),
    )
    _fwd_bwd(lambda x: lora_linear_group(x, [member(hidden, inter)] * 2), t(tokens, hidden))
    labels = torch.empty(tokens, dtype=torch.int64, device="meta")
    _fwd_bwd(lambda h: linear_cross_entropy(h, t(vocab, hidden, grad=False), labels)[0], t(tokens, hidden))


def default_workloads() -> list[Callable[[], None]]:
    """Llama-3-8B in bf16 on the whole GPU and on 32 SMs, and a tiny fp32 / fp16 model (test shapes)."""
    tiny = dict(tokens=37, hidden=48, q_size=48, kv_size=24, inter=80, vocab=203, rank=8, head_dim=12)

    def on_sms(n, **kw):
        def run():
            with sm_budget(n):
                llama_workload(**kw)

        return run

    return [
        on_sms(132),
        on_sms(32),
        on_sms(132, dtype=torch.float32, **tiny),
        on_sms(132, dtype=torch.float16, **tiny),
    ]


def _nvidia_tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _run_on_cubin(cubin: bytes, *cmd: str) -> str | None:
    """stdout of the wheel's ``cmd`` (cuobjdump, nvdisasm) on ``cubin``; None when the tool is absent."""
    tool = _nvidia_tool(cmd[0])
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *cmd[1:], f.name], capture_output=True, text=True).stdout


def decode_workload(sms: int, dtype: torch.dtype = torch.bfloat16) -> Callable[[], None]:
    """Every decode projection launch of Llama-3-8B on ``sms`` SMs, on meta tensors: batch buckets 1-64,
    without LoRA, with an addend, with the LoRA in its launches (4 adapters of rank 16 and the base: 5
    slots) and, up to SHRINK_AHEAD_ROWS rows, with its shrink made by the norm (and that norm); o and down
    also with the residual add and norm, and with LoRA up to SHRINK_AHEAD_ROWS rows with the next
    projection's shrink in that norm; with LoRA that norm also in its split form (`SPLIT_NORM_ROWS`)."""
    from dataclasses import replace

    from harli_train.engine import decode_norm_shrink
    from harli_train.engine.decode_forward import SHRINK_AHEAD_ROWS
    from harli_train.engine.decode_linear import (
        EXPAND_IN_NORM_ROWS,
        GemvLoRA,
        decode_linear,
        decode_linear_add_rms_norm,
        decode_linear_add_rms_norm_shrink,
    )
    from harli_train.engine.decode_norm_shrink import rms_norm_shrink

    def meta(*shape, dt=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dt)

    shapes = [
        ((4096, 1024, 1024), 4096, False),
        ((4096,), 4096, False),
        ((14336, 14336), 4096, True),
        ((4096,), 14336, False),
        ((128256,), 4096, False),
    ]

    def add_norm(x: torch.Tensor, add: torch.Tensor | None, lo: GemvLoRA | None) -> None:
        """o / down with the residual add and norm, and with LoRA up to SHRINK_AHEAD_ROWS rows with the next
        projection's shrink in that norm."""
        m, k = x.shape
        args = (x, meta(4096, k, dt=dtype), meta(m, 4096, dt=dtype), meta(4096, dt=dtype), 1e-5)
        decode_linear_add_rms_norm(*args, num_sms=sms, addend=add, lora=lo)
        if lo is not None and lo.shrunk is None and m <= SHRINK_AHEAD_ROWS:
            ahead = replace(lo, a=meta(3 * 80, 4096, dt=dtype))
            decode_linear_add_rms_norm_shrink(*args, lo, ahead, num_sms=sms)

    def run() -> None:
        for m in (1, 2, 4, 8, 16, 32, 64):
            for ns, k, swiglu in shapes:
                x = meta(m, k, dt=dtype)
                width = 2 * ns[0] if swiglu else sum(ns)
                lora = GemvLoRA(
                    meta(len(ns) * 80, k, dt=dtype),
                    meta(5, 16, width, dt=dtype),
                    meta(5),
                    meta(m, dt=torch.int32),
                    meta(6, dt=torch.int32),
                    16,
                    5,
                )
                variants = [(None, None), (meta(m, sum(ns)), None), (None, lora)]
                if len(ns) > 1 and m <= SHRINK_AHEAD_ROWS:
                    variants.append((None, replace(lora, shrunk=meta(m, len(ns) * 80, dt=dtype))))
                    for res in (None, meta(m, k, dt=dtype)):
                        rms_norm_shrink(x, res, meta(k, dt=dtype), 1e-5, lora, num_sms=sms)
                for add, lo in variants:
                    if lo is not None and ns[0] == 128256:
                        continue  # the LM head carries no adapter
                    weights = [meta(n, k, dt=dtype) for n in ns]
                    decode_linear(x, weights, swiglu=swiglu, num_sms=sms, addend=add, lora=lo)
                    if len(ns) == 1 and ns[0] == 4096:  # o and down
                        add_norm(x, add, lo)
                        if lo is not None and lo.shrunk is None:  # again, the norm's rows split
                            saved = decode_norm_shrink.SPLIT_NORM_ROWS
                            decode_norm_shrink.SPLIT_NORM_ROWS = EXPAND_IN_NORM_ROWS
                            try:
                                add_norm(x, add, lo)
                            finally:
                                decode_norm_shrink.SPLIT_NORM_ROWS = saved

    return run


def _resource_usage(cubin: bytes) -> dict:
    text = _run_on_cubin(cubin, "cuobjdump", "--dump-resource-usage")
    if text is None:
        return {}
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def sass(cubin: bytes) -> str | None:
    """The SASS of a compiled kernel (the wheel's nvdisasm), or None without the tool: where its global
    loads sit against its loops and barriers is what a kernel's latency on the GPU follows, readable here."""
    return _run_on_cubin(cubin, "nvdisasm", "-c")


def spills(row: dict) -> bool:
    """Whether a compiled variant spills: any local memory, or a stack frame past a call's few bytes (ptxas
    versions differ in the small frames they keep without spilling)."""
    return bool(row.get("local", 0)) or row.get("stack", 0) > 64


def compile_all(
    arch: int = 90, workloads: list[Callable[[], None]] | None = None, sass_dir: str | None = None
) -> list[dict]:
    """Compiles every distinct recorded launch for sm_<arch>; returns one row per compiled variant. With
    ``sass_dir`` each variant's SASS goes there too, as ``<kernel>-<n>.sass`` headed by its constexprs."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check needs JIT kernels: unset TRITON_INTERPRET")
    target = GPUTarget("cuda", arch, 32)
    seen, rows = set(), []
    for workload in workloads or default_workloads():
        for jit_fn, src, options in record_launches(workload, target):
            key = (jit_fn.__name__, repr(src.signature), repr(src.constants), repr(src.attrs), repr(options))
            if key in seen:
                continue
            seen.add(key)
            kernel = triton.compile(src, target=target, options=options.__dict__)
            usage = _resource_usage(kernel.asm["cubin"])
            constexprs = {jit_fn.arg_names[k[0]]: str(v) for k, v in src.constants.items() if len(k) == 1}
            if sass_dir is not None:
                os.makedirs(sass_dir, exist_ok=True)
                name = f"{jit_fn.__name__}-{len(rows)}.sass"
                with open(os.path.join(sass_dir, name), "w") as f:
                    f.write(f"// {jit_fn.__name__} {constexprs} warps={options.num_warps}\n")
                    f.write(sass(kernel.asm["cubin"]) or "// nvdisasm is not in this triton wheel\n")
            rows.append(
                dict(
                    kernel=jit_fn.__name__,
                    constexprs=constexprs,
                    num_warps=options.num_warps,
                    num_stages=options.num_stages,
                    shared_bytes=kernel.metadata.shared,
                    **usage,
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--sass", default=None, help="write each variant's SASS into this folder")
    parser.add_argument(
        "--decode",
        action="store_true",
        help="the decode projections (Llama-3-8B, 132 SMs), not the trainer's",
    )
    args = parser.parse_args()
    rows = compile_all(args.arch, [decode_workload(132)] if args.decode else None, sass_dir=args.sass)
    for r in rows:
        print(
            f"{r['kernel']:28s} regs={r.get('reg', '?'):>4} local={r.get('local', '?'):>3} "
            f"smem={r['shared_bytes']:>6} warps={r['num_warps']} stages={r['num_stages']} "
            f"{r['constexprs']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if spills(r)]
    print(f"compiled {len(rows)} kernel variants for sm_{args.arch}; {len(bad)} with spills (stack > 64 B)")


if __name__ == "__main__":
    main()
