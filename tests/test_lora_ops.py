"""The batched LoRA shrink/expand kernels against the plain-torch reference: odd shapes, ranks 8/16/64, one
to three slices, mixed slots with base rows (left untouched), split-K, and a graph-sized grid."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from harli_train.engine.lora_ops import (  # noqa: E402
    lora_add,
    lora_add_reference,
    lora_config,
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
