"""Paged attention and KV-store kernels against SDPA over the unpaged cache (CPU: the Triton interpreter)."""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harli_train.engine.kv_store import kv_store  # noqa: E402
from harli_train.engine.paged_decode import paged_decode, paged_decode_varlen  # noqa: E402
from harli_train.engine.paged_prefill import paged_prefill  # noqa: E402
from harli_train.engine.reference import (  # noqa: E402
    kv_store_reference,
    paged_decode_reference,
    paged_prefill_reference,
)
from harli_train.kernels.reference import apply_rope as apply_rope_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # natively on the GPU machine (bench/smoke_gpu.sh), interpreted here
# Tolerance per dtype (the interpreter's bf16 tl.dot is wrong, so bf16 runs on a GPU only).
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
DECODE_IMPLS = {"triton": paged_decode, "reference": paged_decode_reference}
PREFILL_IMPLS = {"triton": paged_prefill, "reference": paged_prefill_reference}


def _paged(contexts, num_blocks, block_size, hkv, d, dtype, seed=0):
    """Random unpaged K/V per sequence, scattered into a paged cache through shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    width = max(1, max(-(-n // block_size) for n in contexts))
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(contexts), width + 1), 10**6, dtype=torch.int32)  # poison unused entries
    ks, vs, used = [], [], 0
    for i, n in enumerate(contexts):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb].int()
        used += nb
        k = torch.randn(n, hkv, d, generator=g).to(DEVICE, dtype)
        v = torch.randn(n, hkv, d, generator=g).to(DEVICE, dtype)
        for t in range(n):
            blk, off = tables[i, t // block_size], t % block_size
            k_cache[blk, off], v_cache[blk, off] = k[t], v[t]
        ks.append(k)
        vs.append(v)
    assert used <= num_blocks
    return k_cache, v_cache, tables.to(DEVICE), ks, vs


def _sdpa(q, k, v, scale, causal_offset=None):
    # q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, D], fp32 math; causal_offset = position of q row 0.
    mask = None
    if causal_offset is not None:
        q_pos = causal_offset + torch.arange(q.shape[0], device=q.device)
        mask = torch.arange(k.shape[0], device=q.device)[None] <= q_pos[:, None]
    q, k, v = (x.transpose(0, 1).float() for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


@pytest.mark.parametrize("impl", list(DECODE_IMPLS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,contexts,splits",
    [
        (8, 2, 64, 16, [1, 17, 100, 63, 16], None),  # GQA 4, ragged, odd lengths, auto splits
        (8, 2, 64, 16, [1, 17, 100, 0, 63], 3),  # 3 splits (uneven), a padding row (context 0)
        (4, 4, 48, 8, [5, 33, 2], 1),  # MHA, head_dim not a power of two, one split
        (6, 1, 32, 4, [70, 9], 8),  # MQA (group 6, padded to 16), more splits than tiles
    ],
)
def test_paged_decode_matches_sdpa(impl, dtype, hq, hkv, d, block_size, contexts, splits):
    k_cache, v_cache, tables, ks, vs = _paged(contexts, 64, block_size, hkv, d, dtype)
    q = torch.randn(len(contexts), hq, d, device=DEVICE).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    impl_fn = DECODE_IMPLS[impl]
    got = impl_fn(q, k_cache, v_cache, tables, lens, d**-0.5, num_sms=4, num_splits=splits, out=out)
    for i, n in enumerate(contexts):
        if n == 0:
            assert torch.all(got[i] == 0), "a padding row must come out as zeros, not NaN"
            continue
        ref = _sdpa(q[i : i + 1], ks[i], vs[i], d**-0.5)[0]
        torch.testing.assert_close(got[i].float(), ref, **TOL[dtype])


@pytest.mark.parametrize("impl", list(DECODE_IMPLS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,rope", [(1, False), (3, False), (1, True), (3, True)])
def test_paged_decode_stores_and_attends_the_new_token(impl, dtype, splits, rope):
    hq, hkv, d, block_size, contexts = 8, 2, 64, 16, [1, 17, 0, 64, 33]
    k_cache, v_cache, tables, ks, vs = _paged(contexts, 64, block_size, hkv, d, dtype, seed=2)
    slots = torch.full((len(contexts),), -1, dtype=torch.int64, device=DEVICE)
    for i, n in enumerate(contexts):
        if n:
            slots[i] = int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
            # The newest token is not in the cache yet: poison its slot; the kernel must not read it.
            k_cache.view(-1, hkv, d)[slots[i]] = float("nan")
            v_cache.view(-1, hkv, d)[slots[i]] = float("nan")
    k_new = torch.stack([k[-1] if len(k) else torch.zeros(hkv, d, device=DEVICE, dtype=dtype) for k in ks])
    v_new = torch.stack([v[-1] if len(v) else torch.zeros(hkv, d, device=DEVICE, dtype=dtype) for v in vs])
    q = torch.randn(len(contexts), hq, d, device=DEVICE).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    rope_args, q_rot, k_rot = None, q, k_new
    if rope:  # q and the new k arrive unrotated (positions n - 1, as in a decode step)
        positions = torch.tensor([max(n - 1, 0) for n in contexts], device=DEVICE)[:, None] * 37
        freqs = positions.float() * (10000.0 ** (-torch.arange(0, d, 2, device=DEVICE).float() / d))
        emb = torch.cat((freqs, freqs), dim=-1)
        rope_args = (emb.cos().contiguous(), emb.sin().contiguous())
        q_r, k_r = apply_rope_reference(
            q[:, None], k_new[:, None], rope_args[0][:, None], rope_args[1][:, None]
        )
        q_rot, k_rot = q_r[:, 0], k_r[:, 0]
    got = DECODE_IMPLS[impl](
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        d**-0.5,
        num_sms=4,
        num_splits=splits,
        new_kv=(k_new, v_new, slots),
        rope=rope_args,
    )
    for i, n in enumerate(contexts):
        if n == 0:
            assert torch.all(got[i] == 0)
            continue
        keys = torch.cat([ks[i][:-1], k_rot[i : i + 1]])
        torch.testing.assert_close(
            got[i].float(), _sdpa(q_rot[i : i + 1], keys, vs[i], d**-0.5)[0], **TOL[dtype]
        )
        torch.testing.assert_close(k_cache.view(-1, hkv, d)[slots[i]], k_rot[i], **TOL[dtype])
        assert torch.equal(v_cache.view(-1, hkv, d)[slots[i]], v_new[i])


@pytest.mark.parametrize("impl", list(PREFILL_IMPLS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,q_lens,contexts",
    [
        (8, 2, 64, 16, [5, 1, 33, 17], [5, 20, 70, 17]),  # fresh prompts and chunks after a cached prefix
        (4, 4, 48, 8, [40, 3], [40, 11]),  # MHA, odd head_dim, q longer than one tile
        (6, 2, 32, 4, [2, 29], [2, 29]),
    ],
)
def test_paged_prefill_matches_sdpa(impl, dtype, hq, hkv, d, block_size, q_lens, contexts):
    k_cache, v_cache, tables, ks, vs = _paged(contexts, 64, block_size, hkv, d, dtype, seed=1)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), hq, d, device=DEVICE).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    got = PREFILL_IMPLS[impl](q, k_cache, v_cache, tables, cu, lens, max(q_lens), d**-0.5, out=out)
    _check_prefill(got, q, cu, q_lens, contexts, ks, vs, d, dtype)


def _check_prefill(got, q, cu, q_lens, contexts, ks, vs, d, dtype):
    for i, (nq, n) in enumerate(zip(q_lens, contexts, strict=True)):
        lo = int(cu[i])
        ref = _sdpa(q[lo : lo + nq], ks[i], vs[i], d**-0.5, causal_offset=n - nq)
        torch.testing.assert_close(got[lo : lo + nq].float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_lens,contexts",
    [
        ([3, 20, 1, 9], [3, 900, 300, 2100]),  # one-tile rows over short and long contexts (split 1..8)
        ([0, 40, 2], [0, 600, 1300]),  # an empty row first; a row of two tiles (fp32 tiles are 32) unsplit
    ],
)
def test_paged_prefill_splits_a_short_rows_keys_and_merges_them(dtype, q_lens, contexts):
    """split_context: rows of one query tile over a long context split their keys between programs and
    a second kernel merges the splits; every row still equals SDPA; padding tokens past the rows are not
    written. A step past SPLIT_MAX_TOKENS does not split (and is checked the same)."""
    hq, hkv, d, block_size = 8, 2, 64, 16
    k_cache, v_cache, tables, ks, vs = _paged(contexts, 320, block_size, hkv, d, dtype, seed=4)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens) + 5, hq, d, device=DEVICE).to(dtype)  # 5 padding tokens after the rows
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    got = paged_prefill(
        q, k_cache, v_cache, tables, cu, lens, max(q_lens), d**-0.5, out=out, split_context=True
    )
    _check_prefill(got, q, cu, q_lens, contexts, ks, vs, d, dtype)
    assert torch.isnan(got[sum(q_lens) :]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,d,block_size,q_lens,contexts",
    [
        # decode rows (one token, long and short contexts) beside chunks, a one-token chunk, an empty row
        (8, 2, 64, 16, [1, 5, 1, 1, 17, 0, 1], [300, 5, 1, 700, 40, 0, 64]),
        (4, 4, 48, 8, [1, 40, 1], [129, 40, 3]),  # MHA, odd head_dim
        (6, 1, 32, 16, [2, 1, 29], [2, 2100, 29]),  # MQA, a context past the split cap (16 x 128 in fp32)
    ],
)
def test_mixed_step_attention_splits_decode_rows_from_chunks(dtype, hq, hkv, d, block_size, q_lens, contexts):
    """A varlen step's one-token rows through the split decode kernel and its other rows through the
    prefill kernel (skip_single) write disjoint rows that together equal SDPA: each kernel leaves the
    other's rows alone (the output is poisoned first)."""
    k_cache, v_cache, tables, ks, vs = _paged(contexts, 256, block_size, hkv, d, dtype, seed=3)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), hq, d, device=DEVICE).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    single = torch.zeros(sum(q_lens), dtype=torch.bool)
    for i, nq in enumerate(q_lens):
        single[int(cu[i]) : int(cu[i]) + nq] = nq == 1
    single = single.to(DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, k_cache, v_cache, tables, cu, lens, max(q_lens), d**-0.5, out=out, skip_single=True,
                  split_context=True)  # fmt: skip
    assert torch.isnan(out[single]).all() and not torch.isnan(out[~single]).any()
    alone = torch.full_like(q, float("nan"))
    paged_decode_varlen(q, k_cache, v_cache, tables, cu, lens, d**-0.5, alone)
    assert torch.isnan(alone[~single]).all() and not torch.isnan(alone[single]).any()
    paged_decode_varlen(q, k_cache, v_cache, tables, cu, lens, d**-0.5, out, num_rows=len(q_lens))
    for i, (nq, n) in enumerate(zip(q_lens, contexts, strict=True)):
        lo = int(cu[i])
        if nq:
            ref = _sdpa(q[lo : lo + nq], ks[i], vs[i], d**-0.5, causal_offset=n - nq)
            torch.testing.assert_close(out[lo : lo + nq].float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_store_matches_reference(dtype):
    hkv, d, nb, bs = 2, 48, 12, 8
    k = torch.randn(9, hkv, d, device=DEVICE).to(dtype)
    v = torch.randn(9, hkv, d, device=DEVICE).to(dtype)
    slots = torch.tensor([3, -1, 17, 95, 5, 40, -1, 64, 0], device=DEVICE)
    caches = [torch.randn(nb, bs, hkv, d, device=DEVICE).to(dtype) for _ in range(2)]
    got = [c.clone() for c in caches]
    want = [c.clone() for c in caches]
    kv_store(k, v, got[0], got[1], slots)
    kv_store_reference(k, v, want[0], want[1], slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    flat = got[0].view(-1, hkv, d)
    assert torch.equal(flat[17], k[2]) and torch.equal(flat[95], k[3])
    # Padding slots (-1) write nothing: every slot not named keeps its old value.
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[[3, 17, 95, 5, 40, 64, 0]] = False
    assert torch.equal(flat[untouched.to(DEVICE)], caches[0].view(-1, hkv, d)[untouched.to(DEVICE)])


_COMPILE_CHECK = """
import torch
from harli_train.kernels import compile_check as c
from harli_train.engine.kv_store import kv_store
from harli_train.engine.paged_decode import paged_decode, paged_decode_varlen
from harli_train.engine.paged_prefill import paged_prefill

def llama8b(dtype=torch.bfloat16, hq=32, hkv=8, d=128, bs=16):
    meta = dict(device="meta", dtype=dtype)
    i32 = dict(device="meta", dtype=torch.int32)
    kc, vc = torch.empty(4096, bs, hkv, d, **meta), torch.empty(4096, bs, hkv, d, **meta)
    for b in (1, 8, 64, 256):
        q, kn = torch.empty(b, hq, d, **meta), torch.empty(b, hkv, d, **meta)
        bt, cl = torch.empty(b, 131, **i32), torch.empty(b, **i32)
        slots = torch.empty(b, device="meta", dtype=torch.int64)
        for sms in (132, 48):
            paged_decode(q, kc, vc, bt, cl, d ** -0.5, sms, new_kv=(kn, kn.clone(), slots))
            rope = torch.empty(b, d, device="meta", dtype=torch.float32)
            paged_decode(q, kc, vc, bt, cl, d ** -0.5, sms, new_kv=(kn, kn.clone(), slots), rope=(rope, rope))
    q, k = torch.empty(1000, hq, d, **meta), torch.empty(1000, hkv, d, **meta)
    kv_store(k, k.clone(), kc, vc, torch.empty(1000, device="meta", dtype=torch.int64))
    paged_prefill(q, kc, vc, torch.empty(4, 131, **i32), torch.empty(5, **i32), torch.empty(4, **i32), 400,
                  d ** -0.5)
    # a mixed step: one-token rows split, the chunks' rows skipping them
    bt, cu, cl = torch.empty(64, 131, **i32), torch.empty(65, **i32), torch.empty(64, **i32)
    paged_prefill(q, kc, vc, bt, cu, cl, 576, d ** -0.5, skip_single=True)
    paged_prefill(q[:128], kc, vc, bt, cu, cl, 128, d ** -0.5, skip_single=True, split_context=True)
    paged_decode_varlen(q, kc, vc, bt, cu, cl, d ** -0.5, torch.empty_like(q), num_rows=64)

rows = c.compile_all(90, [llama8b, lambda: llama8b(torch.float32, 8, 2, 64, 16)])
bad = [r for r in rows if c.spills(r)]
assert len(rows) >= 10 and not bad, bad
"""


@pytest.mark.slow
def test_engine_kernels_compile_for_sm90():
    """Every engine kernel launch of Llama-3-8B decode and prefill compiles for sm_90 without spills."""
    pytest.importorskip("triton.backends.nvidia")
    pytest.importorskip("harli_train.kernels.compile_check")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHECK], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
