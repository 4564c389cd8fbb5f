"""Decode projections (GEMV / skinny GEMM, grouped q/k/v, gate/up + SwiGLU, split-K) against the torch
reference, their launch configs, the engine's decode forward against the model's own, and sm_90 compilation."""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402

from harli_train.engine.decode_linear import (  # noqa: E402
    FMA_MIN_SMS,
    decode_linear,
    decode_linear_add_rms_norm,
    decode_linear_config,
    decode_linear_reference,
    with_config,
)
from harli_train.kernels import reference as kernel_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # natively on the GPU machine (bench/smoke_gpu.sh), interpreted here
# Per output dtype; the interpreter's bf16 tl.dot is wrong, so bf16 runs on a GPU only.
TOL = {
    torch.float32: dict(atol=1e-3, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _check(x, weights, swiglu=False, config=None, out=None):
    got = decode_linear(x, weights, swiglu=swiglu, config=config, out=out)
    want = decode_linear_reference(x, weights, swiglu=swiglu)
    torch.testing.assert_close(got.float(), want.float(), **TOL[x.dtype])
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize("n", [40, 96])
@pytest.mark.parametrize("k", [64, 200])
def test_single_grouped_and_swiglu_match_reference(dtype, m, n, k):
    x = _randn(m, k, dtype=dtype, seed=m * 1000 + n + k)
    w = [_randn(rows, k, dtype=dtype, seed=i) for i, rows in enumerate((n, n // 4 + 3, n // 4 + 3))]
    _check(x, w[:1])
    _check(x, w)  # q/k/v: uneven row counts, one launch
    _check(x, [w[0], _randn(n, k, dtype=dtype, seed=7)], swiglu=True)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("m,use_dot", [(1, False), (1, True), (5, True), (40, True)])
def test_split_k_and_both_formulations(swiglu, m, use_dot):
    """Forced configs: split-K with the reduce kernel (uneven splits), FMA and dot at M == 1; output into a
    strided view whose padding must stay untouched."""
    k, n = 328, 72
    x = _randn(m, k, dtype=torch.float32, seed=m)
    ws = [_randn(n, k, dtype=torch.float32, seed=10 + i) for i in range(3 if not swiglu else 2)]
    base = decode_linear_config(1 if m == 1 else max(16, 1 << (m - 1).bit_length()), (n,), k, 132, swiglu, 4)
    n_out = n if swiglu else 3 * n
    for split in (1, 2, 3):
        cfg = with_config(
            base,
            split_k=split,
            use_dot=use_dot,
            block_m=max(16, base.block_m) if use_dot else 1,
            block_n=32 if use_dot else 8,
            block_k=64,
        )
        buf = torch.full((m, n_out + 5), float("nan"), device=DEVICE)
        out = _check(x, ws, swiglu=swiglu, config=cfg, out=buf[:, :n_out])
        assert out.data_ptr() == buf.data_ptr() and torch.isnan(buf[:, n_out:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,split", [(1, 1), (3, 1), (3, 2), (33, 3)])
def test_projection_with_residual_add_and_norm(dtype, m, split):
    """decode_linear_add_rms_norm equals the projection followed by add_rms_norm (the reference of both):
    with split-K the sum, the add and the norm share one kernel."""
    k, n = 200, 72
    x, w = _randn(m, k, dtype=dtype, seed=m), _randn(n, k, dtype=dtype, seed=5)
    residual, norm_w = _randn(m, n, dtype=dtype, seed=6), _randn(n, dtype=dtype, seed=7)
    base = decode_linear_config(1 if m == 1 else max(16, 1 << (m - 1).bit_length()), (n,), k, 132)
    cfg = with_config(base, split_k=split, block_n=32 if base.use_dot else 8, block_k=32)
    y, h = decode_linear_add_rms_norm(x, w, residual, norm_w, 1e-5, config=cfg)
    want_y, want_h = kernel_reference.add_rms_norm(decode_linear_reference(x, [w]), residual, norm_w, 1e-5)
    torch.testing.assert_close(h.float(), want_h.float(), **TOL[dtype])
    torch.testing.assert_close(y.float(), want_y.float(), **TOL[dtype])
    assert y.dtype == h.dtype == dtype


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("m,use_dot", [(1, False), (1, True), (6, True)])
def test_addend_joins_the_fp32_sums_before_the_epilogue(swiglu, m, use_dot):
    """An fp32 addend (a LoRA delta; gate columns then up columns with SwiGLU) is added before the cast and
    the SwiGLU: in the GEMV's epilogue without split-K, in the reduce kernel with it (FMA and dot)."""
    k, n = 200, 40
    x = _randn(m, k, dtype=torch.float32, seed=m + 20)
    ns = (n, n) if swiglu else (n, 24, 24)
    ws = [_randn(rows, k, dtype=torch.float32, seed=30 + i) for i, rows in enumerate(ns)]
    addend = _randn(m, sum(ns), dtype=torch.float32, seed=40)
    base = decode_linear_config(1 if m == 1 else 16, ns, k, 132, swiglu, 4)
    want = decode_linear_reference(x, ws, swiglu=swiglu, addend=addend)
    assert not torch.allclose(want, decode_linear_reference(x, ws, swiglu=swiglu), atol=1e-2)
    for split in (1, 2):
        cfg = with_config(
            base,
            split_k=split,
            use_dot=use_dot,
            block_m=16 if use_dot else 1,
            block_n=32 if use_dot else 8,
            block_k=32,
        )
        got = decode_linear(x, ws, swiglu=swiglu, config=cfg, addend=addend)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,split", [(1, 1), (1, 2), (5, 1), (5, 3)])
def test_projection_with_an_addend_then_residual_add_and_norm(dtype, m, split):
    k, n = 136, 48
    x, w = _randn(m, k, dtype=dtype, seed=m + 50), _randn(n, k, dtype=dtype, seed=51)
    residual, norm_w = _randn(m, n, dtype=dtype, seed=52), _randn(n, dtype=dtype, seed=53)
    addend = _randn(m, n, dtype=torch.float32, seed=54)
    base = decode_linear_config(1 if m == 1 else 16, (n,), k, 132, False, x.element_size())
    cfg = with_config(base, split_k=split, block_n=16 if base.use_dot else 8, block_k=32)
    _check_add_norm(x, w, residual, norm_w, cfg, addend, addend=addend)


def _check_add_norm(x, w, residual, norm_w, cfg, delta, **kw):
    """decode_linear_add_rms_norm(**kw) against add_rms_norm of the reference projection plus `delta`."""
    y, h = decode_linear_add_rms_norm(x, w, residual, norm_w, 1e-5, config=cfg, **kw)
    want_y, want_h = kernel_reference.add_rms_norm(
        decode_linear_reference(x, [w], addend=delta), residual, norm_w, 1e-5
    )
    torch.testing.assert_close(h.float(), want_h.float(), **TOL[x.dtype])
    torch.testing.assert_close(y.float(), want_y.float(), **TOL[x.dtype])


def test_configs_for_llama_8b_shapes():
    shapes = {
        "qkv": ((4096, 1024, 1024), 4096, False),
        "o": ((4096,), 4096, False),
        "gate_up": ((14336, 14336), 4096, True),
        "down": ((4096,), 14336, False),
        "lm_head": ((128256,), 4096, False),
    }
    for m in (1, 2, 4, 8, 16, 32, 64):
        for sms in (132, 48, 16):
            for ns, k, swiglu in shapes.values():
                cfg = decode_linear_config(m, ns, k, sms, swiglu, 2)
                assert cfg.block_m >= m and cfg.use_dot == (m > 1 or sms < FMA_MIN_SMS)
                # The threshold is a parameter (bench_decode's gemv_by_share times both at batch 1).
                assert not decode_linear_config(1, ns, k, sms, swiglu, 2, fma_min_sms=0).use_dot
                assert decode_linear_config(1, ns, k, sms, swiglu, 2, fma_min_sms=1 << 30).use_dot
                assert k % cfg.block_k == 0 and all(n % cfg.block_n == 0 for n in ns)
                tiles = -(-ns[0] // cfg.block_n) if swiglu else sum(-(-n // cfg.block_n) for n in ns)
                assert cfg.split_k == 1 or tiles < 4 * sms, "split only when the tiles cannot fill the SMs"
                assert 1 <= cfg.split_k <= 4 and k // cfg.block_k // cfg.split_k >= 4


def test_engine_decode_forward_matches_model_path(tmp_path):
    """Greedy tokens of the engine with decode_gemv (Triton GEMV projections) equal those of the model's own
    forward, and transformers'; the decode forward is really in use."""
    from harli_train.engine import DecodeEngine, EngineConfig, SamplingParams
    from harli_train.model import load_model

    from .hf_models import save_tiny_llama

    hf = save_tiny_llama(
        tmp_path,
        std=0.15,
        vocab_size=80,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=128,
        eos_token_id=2,
    )
    model = load_model(str(tmp_path), torch.float32, DEVICE)
    prompts = [[1, 5, 9, 33, 17], [1, 70, 3], [1, 44, 12, 8, 8, 61, 29, 30, 4]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = {}
    for gemv in (True, False):
        engine = DecodeEngine(
            model,
            EngineConfig(
                block_size=4,
                num_kv_blocks=24,
                max_num_seqs=4,
                max_model_len=32,
                kernels="triton",
                decode_gemv=gemv,
            ),
            num_sms=2,
        )
        assert (engine.runner.decode_forward is not None) == gemv
        outs[gemv] = [s.completion_token_ids for s in engine.generate(prompts, params)]
    assert outs[True] == outs[False]
    with torch.no_grad():
        for p, got in zip(prompts, outs[True], strict=True):
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            assert got == ref


_COMPILE_CHECK = """
import torch
from harli_train.kernels import compile_check as c
rows = c.compile_all(90, [c.decode_workload(132), c.decode_workload(48), c.decode_workload(132, torch.float32)])
bad = [r for r in rows if c.spills(r)]
assert len(rows) >= 10 and not bad, bad
print(len(rows))
"""


@pytest.mark.slow
def test_decode_linear_compiles_for_sm90():
    """Every decode projection launch of Llama-3-8B (batch buckets 1-64, 132 and 48 SMs, without LoRA, with
    an addend, with the LoRA in its launches and, up to SHRINK_AHEAD_ROWS, with its shrink made by the norm,
    and that norm) compiles for sm_90 without spills."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHECK], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_projection_past_gemv_rows_falls_back_to_torch():
    """Batches over MAX_GEMV_ROWS (graph buckets 128, 256) take F.linear, with the same grouping semantics."""
    from harli_train.engine.decode_forward import CUBLAS_SQUARE_ROWS, _project, _project_add_norm, _use_gemv
    from harli_train.engine.engine_config import MAX_GEMV_ROWS

    # A single small square projection at CUBLAS_SQUARE_ROWS rows (o_proj at batch 64) also goes to cuBLAS,
    # with the residual add and the norm after it.
    x64, w64 = (
        _randn(CUBLAS_SQUARE_ROWS, 48, dtype=torch.float32, seed=1),
        _randn(48, 48, dtype=torch.float32, seed=2),
    )
    assert not _use_gemv(x64, (w64,)) and _use_gemv(x64[:-1], (w64,)) and _use_gemv(x64, (w64, w64))
    res, norm = (
        _randn(CUBLAS_SQUARE_ROWS, 48, dtype=torch.float32, seed=3),
        torch.nn.RMSNorm(48, eps=1e-5).to(DEVICE),
    )
    y, h = _project_add_norm(x64, w64, res, norm)
    want_y, want_h = kernel_reference.add_rms_norm(
        decode_linear_reference(x64, [w64]), res, norm.weight, 1e-5
    )
    torch.testing.assert_close(h, want_h, **TOL[torch.float32])
    torch.testing.assert_close(y, want_y, **TOL[torch.float32])

    x = _randn(MAX_GEMV_ROWS + 3, 48, dtype=torch.float32, seed=3)
    ws = [_randn(n, 48, dtype=torch.float32, seed=n) for n in (32, 16, 16)]
    torch.testing.assert_close(_project(x, tuple(ws)), decode_linear_reference(x, ws), **TOL[torch.float32])
    out = torch.full((x.shape[0], 32), float("nan"), device=DEVICE)
    got = _project(x, tuple(ws[:2] + [ws[0][:16].contiguous()])[1:], swiglu=False)
    assert got.shape == (x.shape[0], 32)
    _project(x, (ws[0], ws[0].flip(0).contiguous()), swiglu=True, out=out)
    torch.testing.assert_close(
        out, decode_linear_reference(x, [ws[0], ws[0].flip(0)], swiglu=True), **TOL[torch.float32]
    )


def test_the_cublas_path_takes_no_addend():
    """Past MAX_GEMV_ROWS (and o_proj at CUBLAS_SQUARE_ROWS) F.linear computes the projection: an adapter's
    deltas come as `adds` (tested with the engine's slots in test_lora_serving), an fp32 addend is refused."""
    from harli_train.engine.decode_forward import CUBLAS_SQUARE_ROWS, _project, _project_add_norm, _use_gemv

    f32 = dict(dtype=torch.float32)
    x64, w64 = _randn(CUBLAS_SQUARE_ROWS, 48, seed=61, **f32), _randn(48, 48, seed=62, **f32)
    res, norm = _randn(CUBLAS_SQUARE_ROWS, 48, seed=63, **f32), torch.nn.RMSNorm(48, eps=1e-5).to(DEVICE)
    assert not _use_gemv(x64, (w64,))
    y, h = _project_add_norm(x64, w64, res, norm)
    want_y, want_h = kernel_reference.add_rms_norm(
        decode_linear_reference(x64, [w64]), res, norm.weight, 1e-5
    )
    torch.testing.assert_close(h, want_h, **TOL[torch.float32])
    torch.testing.assert_close(y, want_y, **TOL[torch.float32])
    with pytest.raises(AssertionError, match="cuBLAS path"):
        _project(x64, (w64,), addend=torch.zeros(CUBLAS_SQUARE_ROWS, 48, device=DEVICE))


# (the rows' adapter slots, tensor-core dot, split-K) of the LoRA projection tests: FMA and dot, one row and
# a mix of slots with base rows, with and without split-K.
LORA_CASES = [([2], False, 1), ([3], False, 2), ([0], False, 1), ([1], True, 1),
              ([1, 0, 3, 1, 3, 0, 1], True, 1), ([1, 0, 3, 1, 3, 0, 1], True, 3)]  # fmt: skip


def _gemv_lora(token_slots, k, ns, dtype, seed, num_slots=4, rank=8, used_rank=5, laid_out=None):
    """(GemvLoRA, the reference delta [M, sum N] fp32) for rows on `token_slots`: adapters of rank
    `used_rank` in stacks of `rank` (the rest zero), the base's slot 0 poisoned (NaN): nothing may read it.
    `laid_out`: only the first rows are in the layout (as a mixed graph lays out the step's tokens, not its
    bucket's padding); the rest must come out as base rows."""
    import numpy as np

    from harli_train.engine.decode_linear import GemvLoRA
    from harli_train.engine.lora_ops import lora_add_reference, lora_layout

    a = [_randn(num_slots, rank, k, dtype=dtype, seed=seed + i) * k**-0.5 for i in range(len(ns))]
    b = [_randn(num_slots, n, rank, dtype=dtype, seed=seed + 10 + i) for i, n in enumerate(ns)]
    for t in a:
        t[:, used_rank:] = 0
    for t in (*a, *b):
        t[0] = float("nan")
    scales = torch.rand(num_slots, generator=torch.Generator().manual_seed(seed)).to(DEVICE) + 0.5
    n = len(token_slots) if laid_out is None else laid_out
    sorted_ids, slot_start = lora_layout(np.array(token_slots[:n]), num_slots)
    sorted_ids = np.concatenate([sorted_ids, np.zeros(len(token_slots) - n, dtype=np.int32)])
    token_slots = list(token_slots[:n]) + [0] * (len(token_slots) - n)
    lora = GemvLoRA(
        torch.stack(a).reshape(-1, k).contiguous(),
        torch.cat([t.transpose(1, 2) for t in b], dim=2).contiguous(),
        scales,
        torch.from_numpy(sorted_ids).to(DEVICE),
        torch.from_numpy(slot_start).to(DEVICE),
        rank,
        num_slots,
    )
    m, cols = len(token_slots), [sum(ns[:i]) for i in range(len(ns))]
    zeros = torch.zeros(m, sum(ns), device=DEVICE)
    slots = torch.tensor(token_slots, device=DEVICE)
    return lora, lora_add_reference(
        zeros, _randn(m, k, dtype=dtype, seed=seed + 99), a, b, cols, slots, scales
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("slots,use_dot,split", LORA_CASES)
def test_lora_shrink_rides_the_gemv_and_its_expand_the_split_sum(dtype, swiglu, slots, use_dot, split):
    """`lora`: the shrink as extra row tiles of the projection's launch, the expand in the split-sum
    kernel (run even without split-K), each row on its own slot's adapter (slot 0: the base): equal to
    the projection plus the reference delta, FMA and dot, with and without split-K."""
    k, n, m, seed = 200, 40, len(slots), 5 * len(slots) + split
    ns = (n, n) if swiglu else (n, 24, 16)
    lora, delta = _gemv_lora(slots, k, ns, dtype, seed)
    x = _randn(m, k, dtype=dtype, seed=seed + 99)
    ws = [_randn(rows, k, dtype=dtype, seed=70 + i) for i, rows in enumerate(ns)]
    want = decode_linear_reference(x, ws, swiglu=swiglu, addend=delta)
    got = decode_linear(
        x, ws, swiglu=swiglu, config=_lora_config(m, ns, k, swiglu, x, use_dot, split), lora=lora
    )
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    plain = decode_linear_reference(x, ws, swiglu=swiglu).float()
    assert any(slots) == (not torch.allclose(want.float(), plain, atol=0.1))


def _lora_config(m, ns, k, swiglu, x, use_dot, split):
    base = decode_linear_config(1 if m == 1 else 16, ns, k, 132, swiglu, x.element_size())
    return with_config(
        base, split_k=split, use_dot=use_dot, block_m=16 if use_dot else 1, block_n=16 if use_dot else 8,
        block_k=32,
    )  # fmt: skip


@pytest.mark.parametrize("swiglu", [False, True])
def test_lora_rows_past_the_layout_are_base_rows(swiglu):
    """A mixed graph lays out its step's tokens only; the bucket's padding rows past them (sorted ids 0
    there) are computed as base rows and leave the laid-out rows alone."""
    k, n, slots = 72, 24, [2, 1, 2, 3, 1, 1]
    ns = (n, n) if swiglu else (n, 16, 8)
    lora, delta = _gemv_lora(slots, k, ns, torch.float32, seed=21, laid_out=4)
    x = _randn(len(slots), k, dtype=torch.float32, seed=21 + 99)
    ws = [_randn(rows, k, dtype=torch.float32, seed=80 + i) for i, rows in enumerate(ns)]
    want = decode_linear_reference(x, ws, swiglu=swiglu, addend=delta)
    got = decode_linear(x, ws, swiglu=swiglu, config=_lora_config(6, ns, k, swiglu, x, True, 1), lora=lora)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


# Where the expand of a projection followed by the add and norm runs: the split-sum kernel's column tiles,
# the norm's launch with a program a row's shrink tile, or the norm's launch with each row split by columns.
EXPAND_PATHS = ["tiles", "norm", "split"]


def _expand_path(path: str, monkeypatch) -> None:
    from harli_train.engine import decode_linear as dl
    from harli_train.engine import decode_norm_shrink as dns

    monkeypatch.setattr(dl, "EXPAND_IN_NORM_ROWS", 0 if path == "tiles" else 64)
    monkeypatch.setattr(dns, "SPLIT_NORM_ROWS", 64 if path == "split" else 0)
    monkeypatch.setattr(dns, "SPLIT_NORM_COLUMNS", 32)  # 48 columns: two programs a row, the last masked


def _assert_counters_reset(device) -> None:
    from harli_train.engine.decode_norm_shrink import reserve_row_counters

    assert not reserve_row_counters(torch.device(device)).any(), "each row's last program resets its count"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", EXPAND_PATHS)
@pytest.mark.parametrize("slots,split", [([2], 1), ([1, 2, 0, 2, 1], 1), ([1, 2, 0, 2, 1], 2)])
def test_lora_expand_before_the_residual_add_and_norm(dtype, path, slots, split, monkeypatch):
    """The expand in the norm's launch (a program a row, or each row split by columns) or in the split-sum
    kernel's column tiles."""
    _expand_path(path, monkeypatch)
    k, n, m = 136, 48, len(slots)
    lora, delta = _gemv_lora(slots, k, (n,), dtype, seed=split + 3 * m)
    x, w = _randn(m, k, dtype=dtype, seed=split + 3 * m + 99), _randn(n, k, dtype=dtype, seed=51)
    residual, norm_w = _randn(m, n, dtype=dtype, seed=52), _randn(n, dtype=dtype, seed=53)
    base = decode_linear_config(1 if m == 1 else 16, (n,), k, 132, False, x.element_size())
    cfg = with_config(base, split_k=split, block_n=16 if base.use_dot else 8, block_k=32)
    _check_add_norm(x, w, residual, norm_w, cfg, delta, lora=lora)
    _assert_counters_reset(DEVICE)


def _normed_with_shrink(slots, k, ns, dtype, seed, residual, laid_out=None):
    """(y, h, the GemvLoRA with its `shrunk`, the reference delta of y) from `rms_norm_shrink`, and the
    norm's reference outputs it must equal exactly."""
    from harli_train.engine.decode_norm_shrink import rms_norm_shrink
    from harli_train.kernels.rms_norm import rms_norm_fwd

    m = len(slots)
    lora, _ = _gemv_lora(slots, k, ns, dtype, seed, laid_out=laid_out)
    x = _randn(m, k, dtype=dtype, seed=seed + 7)
    res = _randn(m, k, dtype=dtype, seed=seed + 8) if residual else None
    norm_w = _randn(k, dtype=dtype, seed=seed + 9) * 0.5 + 1
    y, h, pre = rms_norm_shrink(x, res, norm_w, 1e-5, lora, num_sms=8)
    want_y, want_h, _ = rms_norm_fwd(x, res, norm_w, 1e-5)  # the Triton norm of the base path
    return y, h, pre, want_y, want_h


def _reference_delta(y, lora, slots, ns, laid_out=None):
    """The reference delta [M, sum N] fp32 of rows y on `slots` for `lora`'s stacks (rows past `laid_out`
    are base rows)."""
    from harli_train.engine.lora_ops import lora_add_reference

    n = len(slots) if laid_out is None else laid_out
    token_slots = torch.tensor(list(slots[:n]) + [0] * (len(slots) - n), device=DEVICE)
    s, r = lora.num_slots, lora.rank
    a = list(lora.a.view(len(ns), s, r, -1).unbind(0))
    widths = torch.tensor(ns).cumsum(0).tolist()
    b = [lora.bt[:, :, w - n_i : w].transpose(1, 2) for w, n_i in zip(widths, ns, strict=True)]
    zeros = torch.zeros(y.shape[0], sum(ns), device=DEVICE)
    return lora_add_reference(zeros, y, a, b, [w - n_i for w, n_i in zip(widths, ns, strict=True)],
                              token_slots, lora.scales)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("slots", [[2], [0], [1, 0, 3, 1, 3, 0, 1]])
def test_rms_norm_shrink_is_the_norm_and_each_rows_scaled_shrink(dtype, residual, slots):
    """`rms_norm_shrink`: y and h exactly the norm's (kernels.rms_norm / add_rms_norm rounding), and each
    row's shrink of y for its slot (scaled, rounded to the adapters' dtype) in that slot's columns, zeros in
    the other adapter slots' columns (slot 0's, which nothing reads, are left alone)."""
    k, ns = 72, (24, 16, 8)
    y, h, pre, want_y, want_h = _normed_with_shrink(slots, k, ns, dtype, 3 + len(slots), residual)
    assert torch.equal(y, want_y) and torch.equal(h, want_h)
    _assert_shrunk(pre, y, slots, len(ns))


def _assert_shrunk(pre, y, slots, n_slices):
    """`pre.shrunk` holds each row's shrink of y for its slot (scaled, rounded to the adapters' dtype) in
    that slot's columns and zeros in the other adapter slots' columns."""
    s, r, k = pre.num_slots, pre.rank, y.shape[1]
    got = pre.shrunk.view(len(slots), n_slices, s, r).float()
    a = pre.a.view(n_slices, s, r, k).float()
    for row, slot in enumerate(slots):
        for j in range(1, s):
            if j != slot:
                assert not got[row, :, j].any(), (row, j)
        if slot:
            want = ((y[row].float() @ a[:, slot].transpose(1, 2)) * pre.scales[slot]).to(y.dtype).float()
            torch.testing.assert_close(got[row, :, slot], want, **TOL[y.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", EXPAND_PATHS)
@pytest.mark.parametrize("slots,split", [([2], 1), ([1, 2, 0, 2, 1], 1), ([1, 2, 0, 2, 1], 2), ([0, 0], 2)])
def test_the_norm_after_a_lora_projection_shrinks_for_the_next(dtype, path, slots, split, monkeypatch):
    """`decode_linear_add_rms_norm_shrink`: y and h are the projection plus its reference delta, the
    residual added and normed, and the next projection's LoRA comes back with each row's shrink of y, with
    the expand in the norm's launch (a program a row, or each row split by columns) and in the split-sum
    kernel's column tiles."""
    from harli_train.engine import decode_linear as dl

    _expand_path(path, monkeypatch)
    k, n, m, seed = 136, 48, len(slots), 7 * split + len(slots)
    lora, delta = _gemv_lora(slots, k, (n,), dtype, seed=seed)
    ahead, _ = _gemv_lora(slots, n, (24, 16), dtype, seed=seed + 40)
    x, w = _randn(m, k, dtype=dtype, seed=seed + 99), _randn(n, k, dtype=dtype, seed=61)
    residual, norm_w = _randn(m, n, dtype=dtype, seed=62), _randn(n, dtype=dtype, seed=63)
    base = decode_linear_config(1 if m == 1 else 16, (n,), k, 132, False, x.element_size())
    cfg = with_config(base, split_k=split, block_n=16 if base.use_dot else 8, block_k=32)
    y, h, pre = dl.decode_linear_add_rms_norm_shrink(x, w, residual, norm_w, 1e-5, lora, ahead, config=cfg)
    want_y, want_h = kernel_reference.add_rms_norm(
        decode_linear_reference(x, [w], addend=delta), residual, norm_w, 1e-5
    )
    torch.testing.assert_close(h.float(), want_h.float(), **TOL[dtype])
    torch.testing.assert_close(y.float(), want_y.float(), **TOL[dtype])
    _assert_shrunk(pre, y, slots, 2)
    _assert_counters_reset(DEVICE)


@pytest.mark.parametrize("path", EXPAND_PATHS)
def test_the_norm_after_a_lora_projection_takes_rows_past_the_layout_as_base_rows(path, monkeypatch):
    """A mixed graph's padding rows past its layout (sorted ids 0 there) come out of the projection, its
    add and norm and the next shrink as base rows, whichever path the expand takes."""
    from harli_train.engine import decode_linear as dl

    _expand_path(path, monkeypatch)
    k, n, slots, laid_out = 72, 48, [2, 1, 2, 3, 1, 1], 4
    lora, delta = _gemv_lora(slots, k, (n,), torch.float32, seed=23, laid_out=laid_out)
    ahead, _ = _gemv_lora(slots, n, (24, 16), torch.float32, seed=63, laid_out=laid_out)
    x, w = (
        _randn(len(slots), k, dtype=torch.float32, seed=23 + 99),
        _randn(n, k, dtype=torch.float32, seed=25),
    )
    residual = _randn(len(slots), n, dtype=torch.float32, seed=26)
    norm_w = _randn(n, dtype=torch.float32, seed=27)
    cfg = with_config(decode_linear_config(16, (n,), k, 132, False, 4), split_k=2, block_n=16, block_k=32)
    y, h, pre = dl.decode_linear_add_rms_norm_shrink(x, w, residual, norm_w, 1e-5, lora, ahead, config=cfg)
    want_y, want_h = kernel_reference.add_rms_norm(
        decode_linear_reference(x, [w], addend=delta), residual, norm_w, 1e-5
    )
    torch.testing.assert_close(h, want_h, **TOL[torch.float32])
    torch.testing.assert_close(y, want_y, **TOL[torch.float32])
    _assert_shrunk(pre, y, slots[:laid_out] + [0] * (len(slots) - laid_out), 2)
    _assert_counters_reset(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("slots,use_dot,split", LORA_CASES)
def test_a_shrink_made_by_the_norm_is_expanded_by_the_gemv(dtype, swiglu, slots, use_dot, split):
    """With the shrink from `rms_norm_shrink`, the projection computes none: without split-K the GEMV adds
    each row's expand in its epilogue (no other launch), with it the split-sum kernel does; both equal the
    projection of the normed rows plus the reference delta, FMA and dot."""
    k, n, m, seed = 200, 40, len(slots), 5 * len(slots) + split
    ns = (n, n) if swiglu else (n, 24, 16)
    y, _, pre, _, _ = _normed_with_shrink(slots, k, ns, dtype, seed, residual=True)
    ws = [_randn(rows, k, dtype=dtype, seed=70 + i) for i, rows in enumerate(ns)]
    want = decode_linear_reference(y, ws, swiglu=swiglu, addend=_reference_delta(y, pre, slots, ns))
    cfg = _lora_config(m, ns, k, swiglu, y, use_dot, split)
    got = decode_linear(y, ws, swiglu=swiglu, config=cfg, lora=pre)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    plain = decode_linear_reference(y, ws, swiglu=swiglu).float()
    assert any(slots) == (not torch.allclose(want.float(), plain, atol=0.1))


@pytest.mark.parametrize("swiglu", [False, True])
def test_pre_shrunk_rows_past_the_layout_are_base_rows(swiglu):
    """Padding rows past a mixed graph's layout get a zero shrink and come out as base rows."""
    k, n, slots = 72, 24, [2, 1, 2, 3, 1, 1]
    ns = (n, n) if swiglu else (n, 16, 8)
    y, _, pre, _, _ = _normed_with_shrink(slots, k, ns, torch.float32, 21, residual=False, laid_out=4)
    ws = [_randn(rows, k, dtype=torch.float32, seed=80 + i) for i, rows in enumerate(ns)]
    want = decode_linear_reference(y, ws, swiglu=swiglu, addend=_reference_delta(y, pre, slots, ns, 4))
    got = decode_linear(y, ws, swiglu=swiglu, config=_lora_config(6, ns, k, swiglu, y, True, 1), lora=pre)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_a_square_projection_with_lora_stays_on_the_gemv_at_cublas_rows():
    """At CUBLAS_SQUARE_ROWS rows a square projection (o_proj) goes to cuBLAS in a base step, but with the
    step's LoRA it runs the GEMV with the LoRA in its launches: the projection plus the reference delta,
    the residual add and norm after it."""
    from harli_train.engine.decode_forward import CUBLAS_SQUARE_ROWS, _project_add_norm, _use_gemv

    k = n = 48
    slots = [1, 0, 2, 3] * (CUBLAS_SQUARE_ROWS // 4)
    x, w = _randn(len(slots), k, dtype=torch.float32, seed=91), _randn(n, k, dtype=torch.float32, seed=92)
    assert not _use_gemv(x, (w,)) and _use_gemv(x, (w,), lora=True)
    lora, _ = _gemv_lora(slots, k, (n,), torch.float32, seed=93)
    residual, norm_w = (
        _randn(len(slots), n, dtype=torch.float32, seed=94),
        _randn(n, dtype=torch.float32, seed=95),
    )
    norm = torch.nn.Module()
    norm.weight, norm.eps = norm_w, 1e-5
    got_y, got_h = _project_add_norm(x, w, residual, norm, lora=lora)
    p = decode_linear_reference(x, [w], addend=_reference_delta(x, lora, slots, (n,)))
    want_y, want_h = kernel_reference.add_rms_norm(p, residual, norm_w, 1e-5)
    torch.testing.assert_close(got_h, want_h, **TOL[torch.float32])
    torch.testing.assert_close(got_y, want_y, **TOL[torch.float32])
