"""Probe: does cuBLAS's SM count target speed up the trainer's GEMMs on a green-context rung?

On each trainer rung of the ladder, times the LoRA trainer's base GEMMs (Llama-3-8B shapes, 4 x 1024 tokens:
forward x W^T and backward dY W) with the thread's cuBLAS handle at its default target (0: the whole GPU)
and at the rung's SM count, and checks that the results are identical. Medians of 20 after 5 warm-ups
(the decode profile's timer), one stream at a time. Writes $OUT/probe_cublas_sm.json and prints a table.
"""

from __future__ import annotations

import contextlib
import ctypes

import common
import torch

from harli_train.colocate.sm import SMLadder
from harli_train.colocate.step_timing import time_calls

TOKENS, HIDDEN, INTER = 4096, 4096, 14336
SHAPES = {  # name: (M, K, N) for x [M, K] @ W^T [K, N]
    "qkv": (TOKENS, HIDDEN, 6144),
    "o": (TOKENS, HIDDEN, HIDDEN),
    "gate_up": (TOKENS, HIDDEN, 2 * INTER),
    "down": (TOKENS, INTER, HIDDEN),
    "down_dx": (TOKENS, HIDDEN, INTER),  # backward of down: dY [M, 4096] @ W [4096, 14336]
}


def _cublas() -> ctypes.CDLL:
    """torch's own libcublas (found in the process's mappings), for the handle's SM count target."""
    torch.cuda.current_blas_handle()
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcublas.so" in line and "/" in line})
    lib = ctypes.CDLL(paths[0])
    lib.cublasSetSmCountTarget.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


@contextlib.contextmanager
def cublas_sm_target(n: int):
    """cuBLAS calls of this thread target ``n`` SMs inside the block (0: the whole device)."""
    lib = _cublas()
    lib.cublasSetSmCountTarget(torch.cuda.current_blas_handle(), n)
    try:
        yield
    finally:
        lib.cublasSetSmCountTarget(torch.cuda.current_blas_handle(), 0)


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    mats = {
        name: (
            torch.randn(m, k, device=dev, dtype=torch.bfloat16),
            torch.randn(n, k, device=dev, dtype=torch.bfloat16),
        )
        for name, (m, k, n) in SHAPES.items()
    }
    rows = []
    with SMLadder.create(step=16) as ladder:
        rungs = [(p.train_sms, p.train_stream) for p in ladder.spatial]
        rungs.append((ladder.total_sms, torch.cuda.Stream()))
        for sms, stream in rungs:
            for name, (x, w) in mats.items():
                out = {}
                res = {}
                for target in (0, sms):
                    with cublas_sm_target(target):
                        out[target] = 1e3 * common.median(
                            time_calls(lambda x=x, w=w: x @ w.t(), stream, 5, 20)
                        )
                        with torch.cuda.stream(stream):
                            res[target] = x @ w.t()
                        stream.synchronize()
                m, k = x.shape
                flops = 2 * m * k * w.shape[0]
                rows.append(
                    {
                        "train_sms": sms,
                        "gemm": name,
                        "default_ms": out[0],
                        "target_ms": out[sms],
                        "speedup": out[0] / out[sms],
                        "default_tflops": flops / out[0] / 1e9,
                        "identical": bool(torch.equal(res[0], res[sms])),
                    }
                )
    path = common.write_json(
        "probe_cublas_sm.json",
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
    )
    print(f"wrote {path}")
    header = ["SMs", "gemm", "default ms", "target ms", "speedup", "TFLOP/s", "same"]
    keys = ["train_sms", "gemm", "default_ms", "target_ms", "speedup", "default_tflops", "identical"]
    print(common.table([[r[k] for k in keys] for r in rows], header))


if __name__ == "__main__":
    main()
