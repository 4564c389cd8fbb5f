"""SM ladder: the CPU stand-in partitions correctly; the driver path builds disjoint rungs from one split."""

import logging
from types import SimpleNamespace

import pytest
import torch

from harli_train.colocate import sm
from harli_train.colocate.sm import (
    GreenContextUnavailable,
    SMLadder,
    TimeSliceLadder,
    _GreenBuilder,
    make_ladder,
)


@pytest.mark.parametrize("total,step", [(132, 8), (132, 16), (108, 8), (78, 6)])
def test_standin_rungs_are_complementary_and_disjoint(total, step):
    ladder = SMLadder.cpu_standin(total_sms=total, step=step)
    everything = frozenset(range(total))
    assert ladder.shares == sorted(ladder.shares)
    assert [p.index for p in ladder.partitions] == list(range(len(ladder.partitions)))
    for p in ladder.spatial:
        assert p.infer_sms % step == 0
        assert p.infer_sms + p.train_sms == total
        assert p.infer_stream.sm_ids.isdisjoint(p.train_stream.sm_ids)
        assert p.infer_stream.sm_ids | p.train_stream.sm_ids == everything
        assert len(p.infer_stream.sm_ids) == p.infer_sms and len(p.train_stream.sm_ids) == p.train_sms
    assert ladder.full.infer_sms == total and ladder.full.train_sms == 0 and ladder.full.exclusive
    assert ladder.full is ladder.partitions[-1] and ladder.full not in ladder.spatial
    assert len(ladder.spatial) == (total - 1) // step


def test_select_returns_smallest_rung_with_enough_sms():
    ladder = SMLadder.cpu_standin(132, 8)
    assert ladder.select(0).infer_sms == 8
    assert ladder.select(8).infer_sms == 8
    assert ladder.select(9).infer_sms == 16
    assert ladder.select(127).infer_sms == 128
    assert ladder.select(129) is ladder.full
    assert ladder.select(10_000) is ladder.full


def test_switch_hands_off_decode_with_an_event_and_leaves_the_trainer_streams_alone():
    """The trainer's streams belong to its thread (it may be capturing a graph on one): a switch made on the
    decode thread records and waits on decode's streams only."""
    ladder = SMLadder.cpu_standin(132, 8)
    a, b = ladder.select(32), ladder.select(64)
    assert ladder.switch(a, a) is a and ladder.switch(None, a) is a
    assert a.infer_event.records == 0
    assert ladder.switch(a, b) is b
    assert a.infer_event.stream is a.infer_stream and b.infer_stream.waits == [a.infer_event]
    assert b.train_stream.waits == [] and a.train_stream.waits == []


def test_timeslice_standin_is_one_shared_partition():
    ladder = TimeSliceLadder.cpu_standin(132)
    (p,) = ladder.partitions
    assert ladder.time_sliced and p.time_sliced and p.infer_stream is p.train_stream
    assert ladder.spatial == [] and ladder.select(8) is p and ladder.full is p
    assert ladder.switch(p, p) is p


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_create_without_gpu_raises_clear_error():
    with pytest.raises(GreenContextUnavailable, match="CUDA|cuda|GPU"):
        SMLadder.create(step=8)


def test_make_ladder_falls_back_to_time_slicing(monkeypatch, caplog):
    def unavailable(**_):
        raise GreenContextUnavailable("cuGreenCtxCreate failed with CUDA_ERROR_NOT_SUPPORTED")

    monkeypatch.setattr(SMLadder, "create", classmethod(lambda cls, **kw: unavailable(**kw)))
    monkeypatch.setattr(
        TimeSliceLadder, "create", classmethod(lambda cls, **kw: TimeSliceLadder.cpu_standin())
    )
    with caplog.at_level(logging.WARNING):
        ladder = make_ladder(step=8, fallback=True)
    assert ladder.time_sliced and "cuGreenCtxCreate" in caplog.text
    with pytest.raises(GreenContextUnavailable):
        make_ladder(step=8, fallback=False)


# --- the driver path against a fake cuda.bindings.driver ---------------------------------------------------


class FakeDriver:
    """Enough of cuda.bindings.driver to build a ladder; splits like the H200 (15 x 8 SMs + 12 left)."""

    SUCCESS, NOT_SUPPORTED = "CUDA_SUCCESS", "CUDA_ERROR_NOT_SUPPORTED"
    CUresult = SimpleNamespace(CUDA_SUCCESS=SUCCESS)
    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)

    def __init__(self, total=132, groups=15, fail_on_ctx=None):
        self.total, self.n_groups, self.fail_on_ctx = total, groups, fail_on_ctx
        self.splits, self.ctxs, self.destroyed = 0, [], []

    def _res(self, ids, split):
        sm_ = SimpleNamespace(smCount=len(ids), minSmPartitionSize=8, smCoscheduledAlignment=8)
        return SimpleNamespace(sm=sm_, ids=frozenset(ids), split=split)

    def cuInit(self, flags):
        return (self.SUCCESS,)

    def cuDriverGetVersion(self):
        return (self.SUCCESS, 13000)

    def cuDeviceGet(self, ordinal):
        return (self.SUCCESS, ordinal)

    def cuDeviceGetDevResource(self, dev, kind):
        return (self.SUCCESS, self._res(range(self.total), None))

    def cuDevSmResourceSplitByCount(self, n, res, flags, min_count):
        self.splits += 1
        made = min(n, self.n_groups)
        groups = [self._res(range(i * min_count, (i + 1) * min_count), self.splits) for i in range(made)]
        rest = self._res(range(made * min_count, self.total), self.splits)
        return (self.SUCCESS, groups + [None] * (n - made), made, rest)

    def cuDevResourceGenerateDesc(self, resources, n):
        assert len({r.split for r in resources}) == 1, "resources of one descriptor must come from one split"
        ids = frozenset().union(*(r.ids for r in resources[:n]))
        return (self.SUCCESS, SimpleNamespace(ids=ids))

    def cuGreenCtxCreate(self, desc, dev, flags):
        if self.fail_on_ctx is not None and len(self.ctxs) == self.fail_on_ctx:
            return (self.NOT_SUPPORTED, None)
        self.ctxs.append(desc.ids)
        return (self.SUCCESS, len(self.ctxs) - 1)

    def cuGreenCtxStreamCreate(self, ctx, flags, priority):
        return (self.SUCCESS, 1000 + ctx)

    def cuGreenCtxGetDevResource(self, ctx, kind):
        return (self.SUCCESS, self._res(self.ctxs[ctx], None))

    def cuStreamDestroy(self, stream):
        self.destroyed.append(("stream", stream))
        return (self.SUCCESS,)

    def cuGreenCtxDestroy(self, ctx):
        self.destroyed.append(("ctx", ctx))
        return (self.SUCCESS,)


def fake_torch():
    class Stream:
        def __init__(self, *a, **k):
            self.handle = a[0] if a else None

    cuda = SimpleNamespace(is_available=lambda: True, ExternalStream=Stream, Stream=Stream, Event=object)
    return SimpleNamespace(cuda=cuda, zeros=lambda *a, **k: None, device=lambda *a: a)


def test_driver_ladder_uses_one_split_and_reads_granted_counts():
    cu = FakeDriver()
    ladder = SMLadder._build(_GreenBuilder(0, -1, cu=cu, torch=fake_torch()), step=8)
    assert cu.splits == 1
    assert ladder.shares == [8 * k for k in range(1, 16)] + [132]
    assert [p.train_sms for p in ladder.spatial] == [132 - 8 * k for k in range(1, 16)]
    for i, p in enumerate(ladder.spatial):  # contexts come in (inference, finetune) pairs
        infer_ids, train_ids = cu.ctxs[2 * i], cu.ctxs[2 * i + 1]
        assert infer_ids.isdisjoint(train_ids) and len(infer_ids | train_ids) == 132
        assert p.infer_stream.handle == 1000 + 2 * i
    ladder.close()
    assert sorted(cu.destroyed) == sorted(
        [("ctx", i) for i in range(30)] + [("stream", 1000 + i) for i in range(30)]
    )


def test_driver_failure_names_the_call_and_frees_what_was_made():
    cu = FakeDriver(fail_on_ctx=5)
    with pytest.raises(GreenContextUnavailable, match=r"cuGreenCtxCreate failed .*NOT_SUPPORTED.*CUDA 13\.0"):
        SMLadder._build(_GreenBuilder(0, -1, cu=cu, torch=fake_torch()), step=8)
    assert len([d for d in cu.destroyed if d[0] == "ctx"]) == 5


def test_missing_driver_entry_point_is_reported():
    cu = FakeDriver()
    del_name = "cuGreenCtxCreate"
    stripped = SimpleNamespace(
        **{n: getattr(cu, n) for n in dir(cu) if not n.startswith("_") and n != del_name}
    )
    with pytest.raises(GreenContextUnavailable, match="has no cuGreenCtxCreate"):
        SMLadder._build(_GreenBuilder(0, -1, cu=stripped, torch=fake_torch()), step=8)


def test_module_imports_without_cuda_bindings():
    assert "cuda.bindings" not in sm.__dict__


def test_retired_rungs_leave_the_ladder_and_the_rest_reindexes():
    ladder = SMLadder.cpu_standin(132, 8)
    before = [(p.infer_sms, p.train_sms) for p in ladder.partitions]
    gone = ladder.retire({12, 999, 0})  # 0 names the full rung, which always stays
    assert [(p.infer_sms, p.train_sms) for p in gone] == [(120, 12)]
    assert [(p.infer_sms, p.train_sms) for p in ladder.partitions] == [r for r in before if r != (120, 12)]
    assert [p.index for p in ladder.partitions] == list(range(len(ladder.partitions)))
    assert ladder.full.train_sms == 0 and ladder.select(113).infer_sms == 128  # the next rung up
    assert ladder.retire(set()) == []


def test_warm_up_failures_name_their_budgets_and_the_whole_gpu_must_work(caplog):
    import torch

    from harli_train.colocate.trainer_warmup import try_budgets

    ran = []

    def run(sms):
        ran.append(sms)
        if sms == 12:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`")

    with caplog.at_level(logging.WARNING):
        assert try_budgets([12, 68, 132], run, keep=132) == {12}
    assert ran == [12, 68, 132]  # a failed budget does not stop the others
    assert "fail on 12 SMs" in caplog.text and "CUBLAS_STATUS_EXECUTION_FAILED" in caplog.text
    with pytest.raises(RuntimeError, match="CUBLAS"):
        try_budgets([132], run=lambda sms: run(12), keep=132)

    def oom(sms):
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        try_budgets([12], oom, keep=132)
