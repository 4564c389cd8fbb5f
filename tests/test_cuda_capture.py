"""A graph capture whose launches raise leaves torch's allocator as capture_end would have (`cuda_capture`),
and TrainerMemory.close neither drops its MemPool under an open routing nor leaves a failed capture's
routing behind. The allocator's entry points are fakes here (they exist only in CUDA builds); the real
capture is tests/test_gpu.py's."""

import logging
import subprocess
import sys

import pytest
import torch

from harli_train.cuda_capture import capturing, end_failed_capture
from harli_train.memory import trainer_memory
from harli_train.memory.native import PoolError


class FakeGraph:
    def __init__(self, end_fails: bool, begin_error: Exception | None = None):
        self.end_fails, self.begin_error, self.calls = end_fails, begin_error, []

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.calls.append(("begin", pool, capture_error_mode))
        if self.begin_error is not None:
            raise self.begin_error

    def capture_end(self):
        self.calls.append(("end",))
        if self.end_fails:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


@pytest.fixture
def allocator(monkeypatch):
    """Fake allocator entry points: `routed` is the (device, pool) entries registered as capturing."""
    state = {"routed": [], "released": []}

    def end(dev, pool):
        if (dev, pool) not in state["routed"]:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        state["routed"].remove((dev, pool))

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(
        torch._C, "_cuda_releasePool", lambda d, p: state["released"].append((d, p)), raising=False
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return state


def test_a_failed_capture_whose_end_fails_is_ended_in_the_allocator_and_its_error_propagates(allocator):
    graph, pool = FakeGraph(end_fails=True), (0, 7)
    allocator["routed"].append((0, pool))  # what capture_begin registered
    with pytest.raises(ValueError, match="the body's error"), capturing(graph, pool):
        raise ValueError("the body's error")
    assert graph.calls == [("begin", pool, "thread_local"), ("end",)]
    assert allocator["routed"] == [] and allocator["released"] == [(0, pool)]


def test_a_failed_capture_that_capture_end_closes_is_left_to_torch(allocator):
    graph, pool = FakeGraph(end_fails=False), (0, 7)
    with pytest.raises(KeyError), capturing(graph, pool, error_mode="global"):
        raise KeyError("x")
    assert graph.calls == [("begin", pool, "global"), ("end",)]
    assert allocator["released"] == []


def test_a_capture_end_that_failed_after_ending_the_routing_releases_nothing(allocator):
    # capture_end got past endAllocateToPool (e.g. instantiation failed): nothing is registered any more.
    assert end_failed_capture(FakeGraph(end_fails=True), (0, 9), device=0) is False
    assert allocator["released"] == []


def test_a_capture_end_that_fails_after_a_clean_body_ends_the_routing_and_raises(allocator):
    # A capture invalidated from outside it: the body ran, capture_end fails before ending the routing.
    graph, pool = FakeGraph(end_fails=True), (0, 8)
    allocator["routed"].append((0, pool))
    with pytest.raises(RuntimeError, match="during capture"), capturing(graph, pool):
        pass
    assert allocator["routed"] == [] and allocator["released"] == [(0, pool)]


def test_a_clean_capture_ends_once():
    graph = FakeGraph(end_fails=False)
    with capturing(graph, (0, 3)):
        pass
    assert graph.calls == [("begin", (0, 3), "thread_local"), ("end",)]


def test_a_capture_begin_refused_after_registering_ends_the_registration(allocator):
    # torch's pinned-host allocator refuses a pool id whose graphs are all gone, after the device
    # allocator registered the capture: that registration must not outlive the error.
    pool = (0, 1)
    allocator["routed"].append((0, pool))  # what capture_begin registered before the refusal
    refusal = RuntimeError('it->second->use_count > 0 INTERNAL ASSERT FAILED at "CachingHostAllocator.h"')
    body = []
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):
        with capturing(FakeGraph(end_fails=False, begin_error=refusal), pool):
            body.append(1)
    assert body == [] and allocator["routed"] == [] and allocator["released"] == [(0, pool)]


def test_a_capture_begin_refused_as_already_recording_leaves_the_other_registration(allocator):
    pool = (0, 1)
    allocator["routed"].append((0, pool))  # someone else's
    refusal = RuntimeError("beginAllocateToPool: already recording to mempool_id")
    with pytest.raises(RuntimeError, match="already recording"), capturing(FakeGraph(False, refusal), pool):
        pass
    assert allocator["routed"] == [(0, pool)] and allocator["released"] == []


def test_the_trainer_mempool_is_anchored_once_at_its_first_capture(monkeypatch):
    anchors = []
    monkeypatch.setattr(trainer_memory, "anchor_pool", lambda pool, dev: anchors.append(pool) or "graph")
    mem = _memory([])
    for _ in range(3):
        with mem.capture() as pool:
            assert pool == (0, 5)
    assert anchors == [(0, 5)] and mem._anchor == "graph"


def _memory(routes):
    mem = object.__new__(trainer_memory.TrainerMemory)
    mem.mempool = type("Pool", (), {"id": (0, 5)})()
    mem._routes = list(routes)
    mem._anchor = None
    mem.pool = type("P", (), {"device": torch.device("cpu")})()
    mem.pool.device = type("D", (), {"index": 0})()
    return mem


def test_close_with_a_scope_open_refuses_and_keeps_the_mempool():
    mem = _memory([("stream", True)])
    kept = mem.mempool
    before = sys.getrefcount(kept)
    with pytest.raises(PoolError, match=r"1 scope\(\) still open"):
        mem.close()
    assert mem.mempool is kept and sys.getrefcount(kept) > before  # a reference never dropped


def test_close_ends_the_routings_that_failed_captures_left_on_the_mempool(allocator, caplog):
    mem = _memory([])
    allocator["routed"] += [(0, (0, 5)), (0, (0, 5))]
    with caplog.at_level(logging.WARNING, logger=trainer_memory.__name__):
        mem._end_stale_routings()
    assert allocator["routed"] == [] and allocator["released"] == [(0, (0, 5))] * 2
    assert sum("failed graph capture" in r.message for r in caplog.records) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_a_capture_invalidated_on_the_gpu_leaves_a_mempool_that_closes_cleanly():
    """A synchronize inside a capture invalidates it (capture_end then fails); with `capturing` the MemPool
    the capture used is destroyed and the process exits cleanly instead of aborting in torch's allocator."""
    code = """
import torch
from harli_train.cuda_capture import capturing
pool = torch.cuda.MemPool()
x = torch.ones(1024, device="cuda")
graph = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
try:
    with torch.cuda.stream(s), capturing(graph, pool.id):
        y = x * 2
        torch.cuda.synchronize()
except Exception as err:
    print("capture failed:", type(err).__name__)
else:
    raise SystemExit("the capture did not fail")
del graph, pool
torch.cuda.empty_cache()
print("closed")
"""
    _exits_cleanly(code, "closed")


def _exits_cleanly(code: str, marker: str) -> None:
    """``code`` in a fresh interpreter: exit 0, ``marker`` printed, no abort from torch's allocator."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and marker in proc.stdout, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_an_anchored_mempool_takes_captures_again_after_its_graphs_are_gone():
    """A trainer replaced on the same MemPool: every graph of the first is released before the second
    captures. With the pool anchored (`anchor_pool`) the second capture succeeds, replays, and the process
    exits cleanly."""
    code = """
import torch
from harli_train.cuda_capture import anchor_pool, capturing
pool = torch.cuda.MemPool()
anchor = anchor_pool(pool.id, torch.device("cuda"))
x = torch.ones(1024, device="cuda")
s = torch.cuda.Stream()
for round in range(3):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), capturing(graph, pool.id):
        y = x * (round + 2)
    graph.replay()
    torch.cuda.synchronize()
    assert float(y[0]) == round + 2, float(y[0])
    del graph, y
del anchor, pool
torch.cuda.empty_cache()
print("recaptured")
"""
    _exits_cleanly(code, "recaptured")


def test_a_capture_begins_under_the_lock_another_threads_record_looks_under(allocator, monkeypatch):
    """`capturing` begins a capture holding the lock `record_unless_capturing` holds between its look at a
    stream and its record there, so no capture begins in between."""
    from harli_train import cuda_capture

    held = []
    graph = FakeGraph(end_fails=False)
    begin = graph.capture_begin
    monkeypatch.setattr(
        graph, "capture_begin", lambda **kw: held.append(cuda_capture._BEGIN.locked()) or begin(**kw)
    )
    with capturing(graph, (0, 1)):
        assert not cuda_capture._BEGIN.locked()  # only the begin holds it: other threads go on meanwhile
    assert held == [True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_no_event_is_recorded_on_a_stream_another_thread_captures_on():
    """A second thread asks for an event on a stream while the first captures a graph there: None (an event
    recorded there would join the capture, and waiting on it fails); an event once the capture ended. The
    graph is unharmed: it replays what was captured."""
    code = """
import threading
import torch
from harli_train.cuda_capture import capturing, record_unless_capturing
s = torch.cuda.Stream()
x = torch.zeros(4, device="cuda")
with torch.cuda.stream(s):
    x.add_(0)  # the kernel loaded before the capture
s.synchronize()
graph = torch.cuda.CUDAGraph()
inside, looked, seen = threading.Event(), threading.Event(), []
def other():
    inside.wait(30)
    seen.append(record_unless_capturing(s))
    looked.set()
t = threading.Thread(target=other)
t.start()
with torch.cuda.stream(s), capturing(graph, torch.cuda.graph_pool_handle()):
    x.add_(1)
    inside.set()
    looked.wait(30)
t.join()
assert seen == [None], seen
event = record_unless_capturing(s)
assert event is not None
event.synchronize()
graph.replay()
torch.cuda.synchronize()
assert x.tolist() == [1.0] * 4, x.tolist()
print("unharmed")
"""
    _exits_cleanly(code, "unharmed")
