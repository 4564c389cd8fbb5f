"""The batched LoRA kernels against the plain-torch reference: the shrink/expand add (odd shapes, ranks
8/16/64, one to three slices, mixed slots with base rows left untouched, split-K, a graph-sized grid) and the
fp32 deltas of the fused kernel and of the split pair (zeros on base rows, every row written)."""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from harli_train.engine.lora_fused import LoRAFusedConfig, lora_delta_fused, lora_fused_config  # noqa: E402
from harli_train.engine.lora_ops import (  # noqa: E402
    lora_add,
    lora_add_reference,
    lora_config,
    lora_delta_split,
    lora_layout,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # natively on the GPU machine, interpreted here
# Per dtype; the interpreter's bf16 tl.dot is wrong, so bf16 runs on a GPU only.
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=2e-2),
}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _randn(*shape, dtype, seed, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).to(DEVICE, dtype)


def _stacks(num_slots, rank, k, ns, dtype, seed):
    """A and B stacks per slice; slot 0 (the base) poisoned: the kernels must never read it."""
    a = [_randn(num_slots, rank, k, dtype=dtype, seed=seed + i, std=k**-0.5) for i in range(len(ns))]
    b = [_randn(num_slots, n, rank, dtype=dtype, seed=seed + 10 + i) for i, n in enumerate(ns)]
    for t in (*a, *b):
        t[0] = float("nan")
    return a, b


def _run(token_slots, k, ns, rank, dtype, num_slots=5, max_rows=None, config=None, seed=0):
    t = len(token_slots)
    x = _randn(t, k, dtype=dtype, seed=seed + 100)
    a, b = _stacks(num_slots, rank, k, ns, dtype, seed)
    cols = list(np.cumsum([0, *ns[:-1]]))
    width = sum(ns) + 3
    y = _randn(t, width, dtype=dtype, seed=seed + 200)
    scales = torch.rand(num_slots, generator=torch.Generator().manual_seed(seed)).to(DEVICE) + 0.5
    sorted_ids, slot_start = lora_layout(np.array(token_slots), num_slots)
    slots_t = torch.tensor(token_slots, device=DEVICE)
    want = lora_add_reference(y, x, a, b, cols, slots_t, scales)
    got = y.clone()
    out = lora_add(
        got, x, a, b, cols,
        torch.from_numpy(sorted_ids).to(DEVICE), torch.from_numpy(slot_start).to(DEVICE), scales,
        max_rows if max_rows is not None else int(np.bincount(token_slots).max()), config,
    )  # fmt: skip
    assert out.data_ptr() == got.data_ptr()  # in place
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    base = slots_t == 0
    assert torch.equal(got[base], y[base])  # base rows bit-for-bit untouched
    assert torch.equal(got[:, sum(ns) :], y[:, sum(ns) :])  # columns past the slices untouched
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_one_slice_mixed_slots_match_reference(dtype, rank):
    _run([0, 2, 1, 2, 0, 4, 2, 1, 0], k=72, ns=[40], rank=rank, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_three_slices_of_uneven_widths(dtype):
    """q/k/v: three A/B stacks sharing x, each into its own columns of one output."""
    _run([1, 0, 3, 3, 1, 2, 0], k=96, ns=[64, 24, 24], rank=16, dtype=dtype, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_slice_into_its_own_output(dtype):
    """gate/up: two slices sharing x, each adding into a tensor of its own (one of them a column slice of a
    wider one, so the row strides differ) in one shrink + expand pair; base rows and other columns untouched."""
    token_slots = [2, 0, 1, 2, 2, 0, 4, 1, 3]
    t, k, ns, num_slots = len(token_slots), 56, [48, 48], 5
    x = _randn(t, k, dtype=dtype, seed=20)
    a, b = _stacks(num_slots, 16, k, ns, dtype, seed=21)
    scales = torch.rand(num_slots, generator=torch.Generator().manual_seed(2)).to(DEVICE) + 0.5
    sorted_ids, slot_start = lora_layout(np.array(token_slots), num_slots)
    slots_t = torch.tensor(token_slots, device=DEVICE)
    gate = _randn(t, ns[0], dtype=dtype, seed=22)
    wide = _randn(t, ns[1] + 7, dtype=dtype, seed=23)
    up = wide[:, 5 : 5 + ns[1]]
    want = [
        lora_add_reference(y, x, [ai], [bi], [0], slots_t, scales)
        for y, ai, bi in zip((gate, up), a, b, strict=True)
    ]
    got = [gate.clone(), wide.clone()]
    outs = lora_add(
        [got[0], got[1][:, 5 : 5 + ns[1]]], x, a, b, [0, 0],
        torch.from_numpy(sorted_ids).to(DEVICE), torch.from_numpy(slot_start).to(DEVICE), scales,
        int(np.bincount(token_slots).max()),
    )  # fmt: skip
    assert [o.data_ptr() for o in outs] == [got[0].data_ptr(), got[1][:, 5:].data_ptr()]  # in place
    torch.testing.assert_close(got[0].float(), want[0].float(), **TOL[dtype])
    torch.testing.assert_close(got[1][:, 5 : 5 + ns[1]].float(), want[1].float(), **TOL[dtype])
    base = slots_t == 0
    assert torch.equal(got[0][base], gate[base]) and torch.equal(got[1][base], wide[base])
    assert torch.equal(got[1][:, :5], wide[:, :5]) and torch.equal(
        got[1][:, 5 + ns[1] :], wide[:, 5 + ns[1] :]
    )


def test_many_rows_per_slot_span_several_row_tiles():
    slots = [int(s) for s in np.random.default_rng(0).integers(0, 4, 77)]
    _run(slots, k=40, ns=[33, 33], rank=16, dtype=torch.float32, num_slots=4, seed=5)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_k_sums_its_ranges_in_the_expand(split):
    cfg = lora_config(4, 16, 328, 132, 4)
    cfg = type(cfg)(cfg.block_m, cfg.block_r, 64, split, 32, cfg.num_warps)
    _run([1, 2, 0, 1], k=328, ns=[50], rank=16, dtype=torch.float32, config=cfg, seed=7)


def test_a_graph_sized_grid_and_an_all_base_step():
    """A grid sized for a bucket larger than the step (programs past a slot's rows return), and a step of
    base tokens only, which changes nothing."""
    _run([3, 0, 3], k=48, ns=[20], rank=8, dtype=torch.float32, max_rows=32, seed=9)
    _run([0, 0, 0, 0], k=48, ns=[20], rank=8, dtype=torch.float32, max_rows=16, seed=11)


def test_layout_groups_rows_by_slot_stably():
    sorted_ids, start = lora_layout(np.array([2, 0, 2, 1, 0]), 4)
    assert sorted_ids.tolist() == [1, 4, 3, 0, 2] and start.tolist() == [0, 2, 3, 5, 5]
    assert sorted_ids.dtype == np.int32 and start.dtype == np.int32


def test_config_pads_rows_and_rank_to_the_dot_minimum_and_splits_long_k():
    cfg = lora_config(1, 8, 4096, 132, 2)
    assert (cfg.block_m, cfg.block_r, cfg.block_k) == (16, 16, 128) and cfg.split_k == 8
    assert lora_config(64, 64, 14336, 132, 2).split_k == 16
    assert lora_config(1, 16, 4096, 8, 2).split_k == 2  # a small partition: fewer ranges


DELTAS = {"fused": lora_delta_fused, "split": lora_delta_split}


def _run_delta(kernel, token_slots, k, ns, rank, dtype, num_slots=5, max_rows=None, config=None, seed=0):
    """The delta into a NaN-poisoned buffer against the reference added to zeros; base rows exactly 0."""
    t = len(token_slots)
    x = _randn(t, k, dtype=dtype, seed=seed + 100)
    a, b = _stacks(num_slots, rank, k, ns, dtype, seed)
    cols = [sum(ns[:i]) for i in range(len(ns))]
    scales = torch.rand(num_slots, generator=torch.Generator().manual_seed(seed)).to(DEVICE) + 0.5
    sorted_ids, slot_start = lora_layout(np.array(token_slots), num_slots)
    slots_t = torch.tensor(token_slots, device=DEVICE)
    zeros = torch.zeros(t, sum(ns), device=DEVICE)
    want = lora_add_reference(zeros, x, a, b, cols, slots_t, scales)
    out = torch.full((t, sum(ns)), float("nan"), device=DEVICE)
    got = DELTAS[kernel](
        x, a, b, torch.from_numpy(sorted_ids).to(DEVICE), torch.from_numpy(slot_start).to(DEVICE), scales,
        max_rows if max_rows is not None else int(np.bincount(token_slots, minlength=2)[1:].max()),
        out=out, config=config,
    )  # fmt: skip
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[slots_t == 0], zeros[slots_t == 0])  # written, and exactly zero


@pytest.mark.parametrize("kernel", DELTAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [5, 16, 64])
def test_delta_of_one_slice_matches_reference(kernel, dtype, rank):
    """Rank 5 is padded to the dot's 16; the base rows get zeros."""
    _run_delta(kernel, [0, 2, 1, 2, 0, 4, 2, 1, 0], k=72, ns=[40], rank=rank, dtype=dtype)


@pytest.mark.parametrize("kernel", DELTAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_of_three_uneven_slices_side_by_side(kernel, dtype):
    _run_delta(kernel, [1, 0, 3, 3, 1, 2, 0], k=96, ns=[64, 24, 40], rank=16, dtype=dtype, seed=3)


@pytest.mark.parametrize("kernel", DELTAS)
def test_delta_rows_of_a_slot_spanning_several_row_tiles(kernel):
    slots = [int(s) for s in np.random.default_rng(1).integers(0, 4, 90)]
    _run_delta(kernel, slots, k=40, ns=[33, 20], rank=8, dtype=torch.float32, num_slots=4, seed=5)


@pytest.mark.parametrize("kernel", DELTAS)
def test_delta_of_more_base_rows_than_max_rows(kernel):
    """max_rows bounds an adapter slot's rows only: the base's programs stride over its row tiles, and a
    step of base rows alone (max_rows 0) is all zeros."""
    slots = [0] * 37 + [2, 1, 2]
    np.random.default_rng(2).shuffle(slots)
    _run_delta(kernel, slots, k=40, ns=[24, 8], rank=8, dtype=torch.float32, seed=13)  # max_rows 2
    _run_delta(kernel, [0] * 21, k=40, ns=[24], rank=8, dtype=torch.float32, seed=14)  # max_rows 0


@pytest.mark.parametrize("n_sub", [1, 2, 3])
def test_fused_spans_of_several_column_tiles_and_a_k_tail(n_sub):
    """A program covering n_sub tiles of 16 columns (the last span partly past the slice) over a K that
    is not a multiple of the K block."""
    cfg = LoRAFusedConfig(16, 16, 32, 16, n_sub, 4, 3)
    _run_delta("fused", [2, 1, 0, 2, 2], k=100, ns=[70, 18], rank=16, dtype=torch.float32, config=cfg, seed=7)


@pytest.mark.parametrize("kernel", DELTAS)
def test_delta_with_a_graph_sized_grid_and_an_all_base_step(kernel):
    """A grid sized for a bucket larger than the step, and a step of base rows only (all zeros)."""
    _run_delta(kernel, [3, 0, 3, 0, 0], k=48, ns=[20], rank=8, dtype=torch.float32, max_rows=32, seed=9)
    _run_delta(kernel, [0, 0, 0, 0], k=48, ns=[20, 12], rank=8, dtype=torch.float32, max_rows=16, seed=11)


def test_fused_config_pads_to_the_dot_minimum_and_keeps_the_programs_within_half_the_sms():
    shapes = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336))}
    shapes["down"] = (14336, (4096,))
    for max_rows in (1, 4, 16, 64):
        for sms in (132, 48):
            for k, ns in shapes.values():
                cfg = lora_fused_config(max_rows, 16, k, ns, sms, 2)
                assert min(cfg.block_m, cfg.block_r, cfg.block_k, cfg.block_n) >= 16
                assert k % cfg.block_k == 0 and all(n % cfg.block_n == 0 for n in ns)
                span = cfg.block_n * cfg.n_sub
                programs = -(-max_rows // cfg.block_m) * sum(-(-n // span) for n in ns)
                assert programs <= sms // 2 or span >= max(ns)
                assert cfg.n_sub == 1 or programs > sms // 4  # the smallest span that fits
    cfg = lora_fused_config(1, 8, 40, (20,), 132, 4)
    assert (cfg.block_m, cfg.block_r, cfg.block_k, cfg.block_n) == (16, 16, 64, 32)


_COMPILE_CHECK = """
import torch
from harli_train.kernels import compile_check as c
from harli_train.kernels.launch_config import sm_budget
from harli_train.engine.lora_fused import lora_delta_fused
from harli_train.engine.lora_ops import lora_add, lora_delta_split

SHAPES = [(4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,))]

def llama8b(sms, dtype=torch.bfloat16, slots=5, rank=16):
    def run():
        meta, i32 = dict(device="meta", dtype=dtype), dict(device="meta", dtype=torch.int32)
        scales = torch.empty(slots, device="meta", dtype=torch.float32)
        with sm_budget(sms):
            for t in (1, 2, 16, 64):
                for k, ns in SHAPES:
                    x = torch.empty(t, k, **meta)
                    a = [torch.empty(slots, rank, k, **meta) for _ in ns]
                    b = [torch.empty(slots, n, rank, **meta) for n in ns]
                    ids, start = torch.empty(t, **i32), torch.empty(slots + 1, **i32)
                    lora_delta_fused(x, a, b, ids, start, scales, t)
                    lora_delta_split(x, a, b, ids, start, scales, t)
                    y = torch.empty(t, sum(ns), **meta)
                    lora_add(y, x, a, b, [sum(ns[:i]) for i in range(len(ns))], ids, start, scales, t)
    return run

rows = c.compile_all(90, [llama8b(132), llama8b(48), llama8b(132, torch.float32)])
bad = [r for r in rows if c.spills(r)]
assert len(rows) >= 10 and not bad, bad
"""


@pytest.mark.slow
def test_lora_kernels_compile_for_sm90():
    """The fused delta, the split delta and the add of Llama-3-8B's projections (batch 1-64, 132 and 48
    SMs) compile for sm_90 without spills: tl.dot's shape rules and shared memory, which the interpreter
    does not check."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHECK], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
