"""AdapterUpdate against torch's own clip and fused AdamW (the CPU's fused kernel; the GPU test in test_gpu.py
replays it as a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from harli_train.train import adapter_update
from harli_train.train.adapter_update import AdapterUpdate, make_optimizer_state


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 24), (40, 8), (8, 40), (24, 8), (3, 5)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _optimizer(params, **kw) -> torch.optim.AdamW:
    """A fused AdamW with its state made up front, as the trainer makes it (a step at lr 0, steps zeroed)."""
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True, **kw)
    make_optimizer_state(opt)
    return opt


@pytest.mark.parametrize("max_norm", [0.3, None], ids=["clipped", "unbounded"])
def test_update_equals_torch_clip_and_fused_adamw_bit_for_bit(max_norm):
    ours, theirs = _params(0), _params(0)
    opt_ours, opt_theirs = _optimizer(ours), _optimizer(theirs)
    update = AdapterUpdate(opt_ours, max_norm)
    for step in range(4):
        g = torch.Generator().manual_seed(10 + step)
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        lr = 1e-2 / (step + 1)
        norm = update(lr)
        opt_theirs.param_groups[0]["lr"] = lr
        want = torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm is not None else float("inf"))
        opt_theirs.step()
        assert torch.equal(norm, want)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
            sa, sb = opt_ours.state[a], opt_theirs.state[b]
            assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert float(opt_ours.state[ours[0]]["step"]) == 4
    # The gradients left are clipped to the bound (unbounded: as they were).
    left = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours]))
    assert float(left) == pytest.approx(0.3 if max_norm is not None else float(norm), rel=1e-5)


def test_update_empties_the_masters_cast_cache(monkeypatch):
    """Fused AdamW changes the masters without bumping their versions: the cast cache must be told."""
    params = _params(1)
    update = AdapterUpdate(_optimizer(params), 1.0)
    for p in params:
        p.grad = torch.ones_like(p)
    cleared = []
    # The cache the update tells (the kernels' tests may have reloaded lora_linear since it was imported).
    casts = adapter_update.forget_master_casts.__globals__["_master_casts"]
    monkeypatch.setattr(casts, "clear", lambda *a: cleared.append(a))
    update(1e-3)
    assert cleared


def test_only_what_it_computes_exactly_is_taken():
    params = _params(2)
    assert AdapterUpdate.fits(_optimizer(params))
    assert not AdapterUpdate.fits(torch.optim.AdamW(params))  # not fused
    assert not AdapterUpdate.fits(torch.optim.AdamW(params, fused=True, amsgrad=True))
    assert not AdapterUpdate.fits(torch.optim.Adam(params, fused=True))
    two = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], fused=True)
    assert not AdapterUpdate.fits(two)
    with pytest.raises(ValueError, match="fused AdamW"):
        AdapterUpdate(torch.optim.AdamW(params), 1.0)


def test_an_optimizer_without_state_is_refused_before_anything_changes():
    params = _params(3)
    before = [p.detach().clone() for p in params]
    update = AdapterUpdate(torch.optim.AdamW(params, fused=True), 1.0)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="state"):
        update(1e-2)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
