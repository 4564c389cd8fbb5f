"""Triton kernels against the fp32 torch reference, forward and backward: natively on a GPU (fp32, fp16 and
bf16), in Triton's CPU interpreter elsewhere (fp32 and fp16: the interpreter computes tl.dot on bf16 wrongly).
Shapes are small and odd; outputs are poisoned with NaN before kernels write them; inputs are random and
never zero (lora_b included).
"""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# On a GPU the kernels compile for it (TRITON_INTERPRET must stay unset: CUDA graph capture, which other test
# modules use, cannot record interpreted kernels); elsewhere they run in the interpreter.
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined

import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from harli_train import kernels  # noqa: E402

pytestmark = pytest.mark.gpu  # natively on the GPU machine (bench/smoke_gpu.sh), interpreted here
interpreter_only = pytest.mark.skipif(ON_GPU, reason="checks the CPU interpreter's dispatch rules")

# triton.language decides at import whether its own jit helpers (tl.sum, ...) are interpreted: if an
# earlier test module imported it (peft does) before TRITON_INTERPRET was set, nothing here can run.
if not ON_GPU and not isinstance(tl.sum, InterpretedFunction):
    reason = (
        "triton.language was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py "
        "(before anything imports triton) to run the kernel tests in any order"
    )
    pytest.skip(reason, allow_module_level=True)
# Kernel modules imported earlier (without the interpreter) hold JIT kernels: re-execute them.
if not ON_GPU:
    for _name in ["rms_norm", "rope", "swiglu", "lora_linear", "linear_cross_entropy"]:
        if f"harli_train.kernels.{_name}" in sys.modules:
            importlib.reload(sys.modules[f"harli_train.kernels.{_name}"])
from harli_train.kernels import reference  # noqa: E402
from harli_train.kernels.common import poison_outputs  # noqa: E402
from harli_train.kernels.launch_config import get_config, num_sms, set_num_sms, sm_budget  # noqa: E402

# One tolerance table for every comparison against the fp32 reference (inputs identical after rounding).
# Both tensors are divided by max(1, max |reference|) first, so atol is relative to the tensor's scale
# (a gradient summed over rows can reach ~100, where one fp16 ulp is 0.06).
# Triton's fp32 tl.dot runs in TF32 on a GPU (10-bit mantissa inputs): ~1e-3 of the scale, where the
# interpreter computes IEEE fp32 (torch's own matmuls are kept IEEE by the fixture below).
TOLERANCES = {
    torch.float32: dict(atol=3e-3, rtol=3e-3) if ON_GPU else dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (an unwritten, poisoned element?)"
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().float() / scale,
        expected.detach().float() / scale,
        **TOLERANCES[dtype],
        msg=lambda m: f"{what} (scaled by {scale:.3g}): {m}",
    )


@pytest.fixture(autouse=True)
def _triton_poisoned():
    torch.manual_seed(0)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference's matmuls in IEEE fp32
    try:
        with kernels.use_backend("triton"), poison_outputs():
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def rand(*shape, dtype=torch.float32, scale=1.0, grad=True):
    return (torch.randn(*shape) * scale).to(DEVICE, dtype).requires_grad_(grad)


def ref_copy(*tensors):
    """fp32 leaf copies of the (already rounded) inputs, for the reference."""
    return [None if t is None else t.detach().float().requires_grad_(t.requires_grad) for t in tensors]


def grads(outputs, inputs, seed=1):
    """Gradients of sum(out * random) w.r.t. inputs, with the same random cotangents for every call."""
    outputs = [o for o in outputs if o is not None]
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outputs]
    return torch.autograd.grad(outputs, inputs, cot)


# --- RMSNorm --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 100), (2, 5, 64)])
def test_rms_norm(dtype, shape):
    x, w = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    y = kernels.rms_norm(x, w, 1e-6)
    assert y.grad_fn.name().startswith("RMSNormFunction")
    xr, wr = ref_copy(x, w)
    yr = reference.rms_norm(xr, wr, 1e-6)
    assert_close(y, yr, dtype, "y")
    (dx, dw), (dxr, dwr) = grads([y], [x, w]), grads([yr], [xr, wr])
    assert_close(dx, dxr, dtype, "dx")
    assert_close(dw, dwr, dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 100), (2, 5, 64)])
def test_add_rms_norm(dtype, shape):
    x, r, w = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype, grad=False)
    y, h = kernels.add_rms_norm(x, r, w, 1e-5)
    xr, rr, wr = ref_copy(x, r, w)
    yr, hr = reference.add_rms_norm(xr, rr, wr, 1e-5)
    assert_close(h, hr, dtype, "h")
    assert_close(y, yr, dtype, "y")
    got, want = grads([y, h], [x, r]), grads([yr, hr], [xr, rr])
    for g, w_, name in zip(got, want, ["dx", "dresidual"], strict=True):
        assert_close(g, w_, dtype, name)
    # Only the normalised output used (the residual stream unused), and the reverse.
    y, h = kernels.add_rms_norm(x, r, w, 1e-5)
    yr, hr = reference.add_rms_norm(xr, rr, wr, 1e-5)
    (dx,), (dxr,) = grads([y], [x]), grads([yr], [xr])
    assert_close(dx, dxr, dtype, "dx (y only)")
    y, h = kernels.add_rms_norm(x, r, w, 1e-5)
    yr, hr = reference.add_rms_norm(xr, rr, wr, 1e-5)
    (dr,), (drr,) = grads([h], [r]), grads([hr], [rr])
    assert_close(dr, drr, dtype, "dresidual (h only)")


# --- RoPE -----------------------------------------------------------------------------------------------


def _rope_tables(batch, seq, head_dim):
    pos = torch.arange(seq, dtype=torch.float32)[None, :, None] + torch.arange(batch)[:, None, None]
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.cat([pos * inv, pos * inv], dim=-1)
    return ang.cos().to(DEVICE), ang.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rope_strided_views(dtype, cos_batch):
    b, t, hq, hk, d = 2, 5, 6, 3, 24
    qkv = rand(b, t, (hq + 2 * hk) * d, dtype=dtype)
    cos, sin = _rope_tables(cos_batch, t, d)
    (qkv_r,) = ref_copy(qkv)

    def views(base):
        q = base[..., : hq * d].view(b, t, hq, d)
        k = base[..., hq * d : (hq + hk) * d].view(b, t, hk, d)
        return q, k

    q, k = views(qkv)
    assert not q.is_contiguous() and not k.is_contiguous()
    qo, ko = kernels.apply_rope(q, k, cos, sin)
    qr, kr = reference.apply_rope(*views(qkv_r), cos, sin)
    assert_close(qo, qr, dtype, "q")
    assert_close(ko, kr, dtype, "k")
    assert_close(grads([qo, ko], [qkv])[0], grads([qr, kr], [qkv_r])[0], dtype, "dqkv")


def test_rope_inplace_launcher():
    from harli_train.kernels.rope import rope_launch

    q, k = rand(2, 5, 4, 16, grad=False), rand(2, 5, 2, 16, grad=False)
    cos, sin = _rope_tables(1, 5, 16)
    qo, ko = rope_launch(q, k, cos, sin)
    q2, k2 = rope_launch(q.clone(), k.clone(), cos, sin, inplace=True)
    assert torch.equal(qo, q2) and torch.equal(ko, k2)
    # The backward rotation undoes the forward one (R is orthogonal).
    qb, kb = rope_launch(qo, ko, cos, sin, backward=True)
    assert_close(qb, q, torch.float32, "R^T R q")
    assert_close(kb, k, torch.float32, "R^T R k")


# --- SwiGLU ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 100), (2, 3, 1100)])
def test_swiglu(dtype, shape):
    g, u = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    y = kernels.swiglu(g, u)
    gr, ur = ref_copy(g, u)
    yr = reference.swiglu(gr, ur)
    assert_close(y, yr, dtype, "y")
    for got, want, name in zip(grads([y], [g, u]), grads([yr], [gr, ur]), ["dgate", "dup"], strict=True):
        assert_close(got, want, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_gives_the_forwards_output_from_the_same_pass(dtype):
    # `with_output`: the backward's pass over gate and up also writes silu(gate) * up, bit for bit the
    # forward's, and the same gradients as without it.
    from harli_train.kernels.swiglu import swiglu_bwd, swiglu_fwd

    g, u, dy = (rand(37, 1100, dtype=dtype, grad=False) for _ in range(3))
    dg, du, y = swiglu_bwd(dy, g, u, with_output=True)
    assert torch.equal(y, swiglu_fwd(g, u))
    for got, want in zip((dg, du), swiglu_bwd(dy, g, u), strict=True):
        assert torch.equal(got, want)


def test_swiglu_lora_linear_with_frozen_gate_and_up():
    # Only the adapter trains: no SwiGLU backward runs, and dA's input is recomputed on its own.
    w, b, a, bb, s = _lora_member(100, 48, 8, torch.float32)
    g, u = rand(37, 100, grad=False), rand(37, 100, grad=False)
    y = kernels.swiglu_lora_linear(g, u, w, b, a, bb, s)
    composed = kernels.lora_linear(kernels.swiglu(g, u), w, b, a, bb, s)
    for got, want in zip(grads([y], [a, bb]), grads([composed], [a, bb]), strict=True):
        assert torch.equal(got, want)


# --- LoRA linear ----------------------------------------------------------------------------------------


def _lora_member(n_in, n_out, rank, dtype, bias=False, scale=2.0):
    # Frozen W, b in the activation dtype; trainable fp32 masters A, B (B random: never zero in tests).
    w = rand(n_out, n_in, dtype=dtype, scale=n_in**-0.5, grad=False)
    b = rand(n_out, dtype=dtype, grad=False) if bias else None
    a = rand(rank, n_in, scale=n_in**-0.5)
    bb = rand(n_out, rank, scale=rank**-0.5)
    return w, b, a, bb, scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(37,), (1, 37)])
def test_lora_linear(dtype, bias, lead):
    w, b, a, bb, s = _lora_member(48, 80, 8, dtype, bias=bias)
    x = rand(*lead, 48, dtype=dtype)
    y = kernels.lora_linear(x, w, b, a, bb, s)
    assert y.shape == (*lead, 80) and y.dtype == dtype
    xr, wr, br, ar, bbr = ref_copy(x, w, b, a, bb)
    yr = reference.lora_linear(xr, wr, br, ar, bbr, s)
    assert_close(y, yr, dtype, "y")
    got, want = grads([y], [x, a, bb]), grads([yr], [xr, ar, bbr])
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32, "master grads must be fp32"
    for g, r, name in zip(got, want, ["dx", "dA", "dB"], strict=True):
        assert_close(g, r, dtype, name)


def test_lora_linear_frozen_input():
    # The first layer's input needs no gradient: only A and B get one.
    w, b, a, bb, s = _lora_member(48, 80, 8, torch.float32)
    x = rand(37, 48, grad=False)
    ar, bbr = ref_copy(a, bb)
    y, yr = kernels.lora_linear(x, w, b, a, bb, s), reference.lora_linear(x, w, b, ar, bbr, s)
    assert_close(y, yr, torch.float32, "y")
    for g, r, name in zip(grads([y], [a, bb]), grads([yr], [ar, bbr]), ["dA", "dB"], strict=True):
        assert_close(g, r, torch.float32, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(37,), (2, 19)])
def test_swiglu_lora_linear(dtype, lead):
    # The MLP's down projection over its SwiGLU, the activation recomputed in backward: against the fp32
    # reference, and bit for bit what swiglu then lora_linear compute (the same kernels in the same order).
    w, b, a, bb, s = _lora_member(100, 48, 8, dtype)
    g, u = rand(*lead, 100, dtype=dtype), rand(*lead, 100, dtype=dtype)
    y = kernels.swiglu_lora_linear(g, u, w, b, a, bb, s)
    assert y.shape == (*lead, 48) and y.dtype == dtype and y.grad_fn.name().startswith("SwiGLULoRA")
    gr, ur, wr, ar, bbr = ref_copy(g, u, w, a, bb)
    yr = reference.lora_linear(reference.swiglu(gr, ur), wr, None, ar, bbr, s)
    assert_close(y, yr, dtype, "y")
    got, want = grads([y], [g, u, a, bb]), grads([yr], [gr, ur, ar, bbr])
    for x, r, name in zip(got, want, ["dgate", "dup", "dA", "dB"], strict=True):
        assert_close(x, r, dtype, name)
    composed = kernels.lora_linear(kernels.swiglu(g, u), w, b, a, bb, s)
    assert torch.equal(y, composed)
    for x, r in zip(got, grads([composed], [g, u, a, bb]), strict=True):
        assert torch.equal(x, r)


def test_swiglu_lora_linear_keeps_gate_and_up_but_not_the_activation():
    w, b, a, bb, s = _lora_member(100, 48, 8, torch.float32)
    g, u = rand(37, 100), rand(37, 100)

    def saved_bytes(fn):
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            fn()
        ids = {id(t): t for t in seen if not (t.requires_grad and t.is_leaf) and t is not w}
        return sum(t.nbytes for t in ids.values())

    fused = saved_bytes(lambda: kernels.swiglu_lora_linear(g, u, w, b, a, bb, s))
    composed = saved_bytes(lambda: kernels.lora_linear(kernels.swiglu(g, u), w, b, a, bb, s))
    assert composed - fused == 37 * 100 * 4  # one [M, in] activation less


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_group(dtype):
    members = [
        _lora_member(48, 80, 8, dtype, bias=True, scale=2.0),
        _lora_member(48, 24, 8, dtype, scale=0.5),
        _lora_member(48, 40, 16, dtype, bias=True, scale=1.0),
    ]
    x = rand(37, 48, dtype=dtype)
    ys = kernels.lora_linear_group(x, members)
    ref_members = [(*ref_copy(*m[:4]), m[4]) for m in members]
    (xr,) = ref_copy(x)
    yrs = reference.lora_linear_group(xr, ref_members)
    for i, (y, yr) in enumerate(zip(ys, yrs, strict=True)):
        assert_close(y, yr, dtype, f"y{i}")
    params = [x] + [t for m in members for t in m[2:4]]
    params_r = [xr] + [t for m in ref_members for t in m[2:4]]
    for i, (g, r) in enumerate(zip(grads(ys, params), grads(yrs, params_r), strict=True)):
        assert_close(g, r, dtype, f"grad {i}")
    # A member whose output is unused (e.g. v not reaching the loss) gets zero gradients.
    ys = kernels.lora_linear_group(x, members)
    yrs = reference.lora_linear_group(xr, ref_members)
    got = torch.autograd.grad([ys[0], ys[2]], params, [torch.ones_like(ys[0]), torch.ones_like(ys[2])])
    want = torch.autograd.grad(
        [yrs[0], yrs[2]], params_r, [torch.ones_like(yrs[0]), torch.ones_like(yrs[2])], allow_unused=True
    )
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        assert_close(g, torch.zeros_like(g) if r is None else r, dtype, f"grad {i} (v unused)")


def test_lora_master_casts_are_made_once_per_optimizer_step():
    """fp16 activations, fp32 masters: the casts of A and B are made at the first forward after an update and
    reused until the next one; a fused AdamW step (which bumps no version counter) and an in-place edit both
    make the next forward cast again, so outputs always follow the current masters."""
    mod = importlib.import_module("harli_train.kernels.lora_linear")
    members = [_lora_member(48, 40, 8, torch.float16), _lora_member(48, 24, 8, torch.float16, scale=0.5)]
    x = rand(21, 48, dtype=torch.float16, grad=False)
    masters = [t for m in members for t in m[2:4]]

    def check():
        ys = kernels.lora_linear_group(x, members)
        ref = [(*ref_copy(*m[:4]), m[4]) for m in members]
        for y, yr in zip(ys, reference.lora_linear_group(ref_copy(x)[0], ref), strict=True):
            assert_close(y, yr, torch.float16, "y")
        return ys

    mod._master_casts.clear()
    ys = check()
    (entry,) = mod._master_casts._entries.values()
    check()
    (again,) = mod._master_casts._entries.values()
    assert again[2] is entry[2], "the second forward reuses the cast A"
    sum(y.float().sum() for y in ys).backward()
    torch.optim.AdamW(masters, lr=0.1, fused=True).step()
    assert not mod._master_casts._entries, "an optimizer step empties the cache"
    check()  # casts the updated masters
    with torch.no_grad():
        members[0][2].mul_(2.0)  # an in-place edit bumps the version: the entry no longer matches
    check()
    (entry,) = mod._master_casts._entries.values()
    assert entry[1] == tuple(t._version for t in masters)
    # Under inference mode nothing is cached: its tensors could not be saved by a later training forward.
    mod._master_casts.clear()
    with torch.inference_mode():
        kernels.lora_linear_group(x, members)
    assert not mod._master_casts._entries
    sum(y.float().sum() for y in check()).backward()
    # A freed master takes its entry with it (no cast copies of a previous model kept).
    assert mod._master_casts._entries
    members.clear()
    masters.clear()
    ys = None  # its autograd graph holds the masters too
    gc.collect()
    assert not mod._master_casts._entries


def test_lora_shrink_split_k_and_sm_budget():
    from harli_train.kernels.lora_linear import lora_shrink

    x, a = rand(37, 520, grad=False), rand(8, 520, grad=False)
    with sm_budget(1):
        assert get_config("lora_shrink", (37, 520, 8), num_sms(), torch.float32)["SPLIT_K"] == 1
        one = lora_shrink(x, a, 0.5)
    assert get_config("lora_shrink", (37, 520, 8), num_sms(), torch.float32)["SPLIT_K"] > 1
    split = lora_shrink(x, a, 0.5)
    assert_close(one, 0.5 * x @ a.t(), torch.float32, "shrink, 1 split")
    assert_close(split, one, torch.float32, "shrink, split K")


# --- Linear + cross-entropy -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_rows", [None, 16])
def test_linear_cross_entropy(dtype, chunk_rows):
    from harli_train.kernels.linear_cross_entropy import linear_cross_entropy

    h, w = rand(37, 48, dtype=dtype), rand(203, 48, dtype=dtype, scale=0.3, grad=False)
    labels = torch.randint(0, 203, (37,), device=DEVICE)
    labels[::5] = -100
    loss, n = linear_cross_entropy(h, w, labels, -100, chunk_rows)
    hr, wr = ref_copy(h, w)
    loss_r, n_r = reference.linear_cross_entropy(hr, wr, labels, -100)
    assert n.item() == n_r.item() == 29 and loss.dtype == torch.float32
    assert_close(loss, loss_r, dtype, "loss")
    (dh,), (dhr,) = torch.autograd.grad(loss * 0.7, h), torch.autograd.grad(loss_r * 0.7, hr)
    assert_close(dh, dhr, dtype, "dhidden")
    assert dh[::5].abs().max() == 0, "ignored rows must get no gradient"


def test_linear_cross_entropy_all_ignored_and_no_grad():
    h, w = rand(9, 48), rand(203, 48, grad=False)
    loss, n = kernels.linear_cross_entropy(h, w, torch.full((9,), -100, device=DEVICE))
    assert loss.item() == 0 and n.item() == 0
    assert torch.autograd.grad(loss, h)[0].abs().max() == 0
    with torch.no_grad():
        labels = torch.randint(0, 203, (9,), device=DEVICE)
        loss, _ = kernels.linear_cross_entropy(h, w, labels)
        assert_close(loss, reference.linear_cross_entropy(h, w, labels)[0], torch.float32, "no-grad loss")


# --- Dispatcher and launch configs ----------------------------------------------------------------------


def test_backend_switch_same_results():
    x, w = rand(37, 100), rand(100, grad=False)
    lw, lb, la, lbb, s = _lora_member(100, 40, 8, torch.float32)
    with kernels.use_backend("torch"):
        y_ref = kernels.lora_linear(kernels.rms_norm(x, w, 1e-6), lw, lb, la, lbb, s)
        assert y_ref.grad_fn.name() == "AddBackward0"
    y_tri = kernels.lora_linear(kernels.rms_norm(x, w, 1e-6), lw, lb, la, lbb, s)
    assert y_tri.grad_fn.name().startswith("LoRALinearGroupFunction")
    assert_close(y_tri, y_ref, torch.float32, "triton vs torch")
    assert kernels.get_backend() == "triton"


@interpreter_only
def test_backend_selection_rules(monkeypatch):
    x, w = rand(4, 32), rand(32, grad=False)
    with kernels.use_backend("auto"):  # CPU tensors take the reference under auto, interpreter or not
        assert not kernels.rms_norm(x, w, 1e-6).grad_fn.name().startswith("RMSNorm")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.set_backend("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.rms_norm(x, w, 1e-6)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Unsupported cases fall back to the reference: fp64, and a weight that requires grad.
    assert kernels.swiglu(x.double(), x.double()).grad_fn.name() == "MulBackward0"
    lw, lb, la, lbb, s = _lora_member(32, 16, 4, torch.float32)
    y = kernels.lora_linear(x, lw.requires_grad_(), lb, la, lbb, s)
    assert y.grad_fn.name() == "AddBackward0"


def test_public_names_survive_submodule_imports():
    for name in ["rms_norm", "swiglu", "lora_linear", "linear_cross_entropy", "rope"]:
        importlib.import_module(f"harli_train.kernels.{name}")
    for name in ["rms_norm", "add_rms_norm", "apply_rope", "swiglu", "lora_linear", "linear_cross_entropy"]:
        assert callable(getattr(kernels, name)) and getattr(kernels, name).__module__ == "harli_train.kernels"


def test_sm_budget_changes_grid_not_result():
    x, w = rand(37, 100, grad=False), rand(100, grad=False)
    full = kernels.rms_norm(x, w, 1e-6)
    with sm_budget(2):
        assert num_sms() == 2
        assert get_config("rms_norm", (37, 100), num_sms(), torch.float32)["num_programs"] == 16
        small = kernels.rms_norm(x, w, 1e-6)
        with sm_budget(1):
            assert num_sms() == 1
        assert num_sms() == 2
    assert get_config("rms_norm", (37, 100), num_sms(), torch.float32)["num_programs"] == 37
    assert torch.equal(full, small)
    set_num_sms(5)
    try:
        assert num_sms() == 5
        with sm_budget(3):
            assert num_sms() == 3
    finally:
        set_num_sms(None)
    assert num_sms() == 132  # no CUDA device: the H200 default
    with pytest.raises(ValueError):
        with sm_budget(0):
            pass


def test_backward_uses_forward_budget_on_another_thread(monkeypatch):
    # Autograd runs CUDA backward nodes on worker threads, which a thread-local budget does not reach.
    import threading

    module = sys.modules["harli_train.kernels.swiglu"]
    seen = []

    def recording_get_config(op, shape, n_sms, dtype):
        seen.append(n_sms)
        return get_config(op, shape, n_sms, dtype)

    monkeypatch.setattr(module, "get_config", recording_get_config)
    g, u = rand(8, 40), rand(8, 40)
    with sm_budget(3):
        y = kernels.swiglu(g, u)
    worker = threading.Thread(target=lambda: y.sum().backward())
    worker.start()
    worker.join()
    assert seen == [3, 3] and g.grad is not None


@pytest.mark.slow
def test_kernels_compile_for_sm90(tmp_path):
    """Every launch of the Llama-3-8B workload compiles for sm_90 (what the interpreter cannot check),
    without local memory or more than a token stack frame (register spills); each variant's SASS is
    written out, headed by its kernel and constexprs."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = (
        "import sys\n"
        "from harli_train.kernels import compile_check as c\n"
        "rows = c.compile_all(90, c.default_workloads()[:1], sass_dir=sys.argv[1])\n"
        "bad = [r for r in rows if r.get('local') or r.get('stack', 0) > 64]\n"
        "assert len(rows) >= 15 and not bad, bad\n"
        "print(len(rows))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", code, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(tmp_path.glob("*.sass"))
    assert len(files) == int(proc.stdout.split()[-1])
    text = files[0].read_text()
    assert text.startswith("// ") and "EXIT" in text


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="the bench's CPU dry run (on a GPU the bench itself runs)")
def test_bench_dry_run(tmp_path):
    """bench/bench_kernels.py runs end to end on the CPU (two ops, one reduced SM budget)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OUT=str(tmp_path))
    ops = "add_rms_norm,lora_qkv_group"
    cmd = [sys.executable, "bench/bench_kernels.py", "--dry-run", "--ops", ops, "--sms", "8"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert not result["errors"], result["errors"]
    assert result["correctness"]["lora_qkv_group"]["ok"]
    assert result["timing"]["add_rms_norm"]["8sm"]["sms"] == 8
