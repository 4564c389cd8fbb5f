"""DecodeCore: the decode thread alone on a CPU core while serving, the other threads on the rest, and
everything put back on leaving."""

import logging
import os
import threading

import pytest
import torch

from harli_train.colocate.decode_core import DecodeCore

from .runtime_support import TOTAL, ScriptedPolicy, requests, runtime

pytestmark = pytest.mark.usefixtures("one_thread")

ALLOWED = os.sched_getaffinity(0)
needs_two = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two usable CPUs")


def _other_thread():
    """A thread started before the block (as the trainer's is), parked until released: (its id, release)."""
    ready, release, tid = threading.Event(), threading.Event(), []

    def park():
        tid.append(threading.get_native_id())
        ready.set()
        release.wait(30)

    threading.Thread(target=park, daemon=True).start()
    ready.wait(10)
    return tid[0], release


@needs_two
def test_the_decode_thread_gets_a_core_of_its_own_and_everything_is_put_back():
    other, release = _other_thread()
    threads_before = torch.get_num_threads()
    try:
        with DecodeCore() as pinned:
            core = max(ALLOWED)
            assert pinned.active and pinned.core == core
            assert os.sched_getaffinity(threading.get_native_id()) == {core}
            assert core not in os.sched_getaffinity(other) and os.sched_getaffinity(other) <= ALLOWED
            assert torch.get_num_threads() == 1  # no OpenMP team made on the decode thread's one core
        assert os.sched_getaffinity(threading.get_native_id()) == ALLOWED
        assert os.sched_getaffinity(other) == ALLOWED
        assert torch.get_num_threads() == threads_before
    finally:
        release.set()


def test_a_core_the_process_may_not_use_leaves_every_thread_as_it_is(caplog):
    with caplog.at_level(logging.WARNING, logger="harli_train.colocate.decode_core"):
        with DecodeCore(core=max(ALLOWED) + 1000) as pinned:
            assert not pinned.active
            assert os.sched_getaffinity(threading.get_native_id()) == ALLOWED
    assert "threads left as they are" in caplog.text


@needs_two
def test_a_colocated_run_serves_with_the_decode_core_and_gives_the_cores_back(tmp_path):
    from harli_train.colocate.runtime_options import RuntimeOptions
    from harli_train.colocate.sm import SMLadder

    ladder = SMLadder.cpu_standin(TOTAL, 8)
    opts = RuntimeOptions(quiet=True, plots=False, trainer_thread=True, decode_core=True)
    rt = runtime(
        tmp_path, ladder, lambda ladder: ScriptedPolicy(ladder, lambda: 48), requests([(0.0, 2, 12)]), opts
    )
    summary = rt.run()
    assert summary["stop_reason"] == "trained" and summary["serving"]["requests"] == 2
    assert os.sched_getaffinity(threading.get_native_id()) == ALLOWED
