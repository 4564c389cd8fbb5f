"""The decode thread's host-priority gate: who waits, for how long, and that every Triton launcher asks it."""

import threading
import time

import pytest
import torch

from harli_train import kernels
from harli_train.colocate.host_priority import HostPriority
from harli_train.kernels import launch_config


def _in_thread(fn):
    """Run fn in another thread; returns (the thread, the seconds fn took, filled in when it is done)."""
    took = []

    def body():
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)

    t = threading.Thread(target=body)
    t.start()
    return t, took


def test_other_threads_wait_while_held_and_the_holder_never_does():
    gate = HostPriority(timeout_s=5.0)
    gate.wait()  # open: nobody waits
    gate.hold()
    gate.wait()  # the holder passes its own gate
    assert gate.waits == 0
    t, took = _in_thread(gate.wait)
    time.sleep(0.05)
    assert t.is_alive()  # held: the other thread waits
    gate.release()
    t.join(2.0)
    assert not t.is_alive() and took[0] >= 0.04
    assert gate.stats()["waits"] == 1 and gate.stats()["timeouts"] == 0


def test_a_gate_left_held_costs_a_timeout_not_a_deadlock():
    gate = HostPriority(timeout_s=0.03)
    gate.hold()
    t, took = _in_thread(gate.wait)
    t.join(2.0)
    assert not t.is_alive() and 0.02 <= took[0] < 1.0
    assert gate.timeouts == 1 and gate.wait_s >= 0.02


def test_yielded_opens_the_gate_for_the_holder_only_and_takes_it_back():
    gate = HostPriority(timeout_s=5.0)
    with gate.holding():
        with gate.yielded():  # the holder waits for the GPU: others may launch meanwhile
            assert not gate.held
            t, _ = _in_thread(gate.wait)
            t.join(2.0)
            assert not t.is_alive()
        assert gate.held
        # A thread that does not hold it yields nothing.
        done = []
        other = threading.Thread(target=lambda: done.append(gate.yielded().__enter__() or gate.held))
        other.start()
        other.join(2.0)
        assert done == [True]
    assert not gate.held


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "rope", "lora_linear", "cross_entropy"])
def test_every_triton_launcher_asks_the_gate_first(op):
    calls = []
    previous = launch_config.set_launch_gate(lambda: calls.append(threading.get_ident()))
    try:
        torch.manual_seed(0)
        with kernels.use_backend("triton"):
            if op == "rms_norm":
                x = torch.randn(5, 32, requires_grad=True)
                kernels.rms_norm(x, torch.ones(32), 1e-6).sum().backward()
            elif op == "swiglu":
                g, u = torch.randn(5, 24, requires_grad=True), torch.randn(5, 24, requires_grad=True)
                kernels.swiglu(g, u).sum().backward()
            elif op == "rope":
                q, k = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16)
                cos, sin = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
                kernels.apply_rope(q, k, cos, sin)
            elif op == "lora_linear":
                x = torch.randn(6, 32, requires_grad=True)
                w, a, b = torch.randn(24, 32), torch.randn(4, 32), torch.randn(24, 4)
                kernels.lora_linear(x, w, None, a.requires_grad_(), b.requires_grad_(), 2.0).sum().backward()
            else:
                h, w = torch.randn(6, 32, requires_grad=True), torch.randn(40, 32)
                kernels.linear_cross_entropy(h, w, torch.randint(0, 40, (6,)))[0].backward()
    finally:
        launch_config.set_launch_gate(previous)
    assert calls, f"{op}: no launcher asked the gate"
