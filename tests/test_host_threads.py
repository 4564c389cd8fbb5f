"""A helper thread's torch CPU ops run without an OpenMP team of their own; other threads keep theirs."""

import threading

import pytest
import torch

from harli_train.host_threads import single_threaded_ops


def test_a_helper_thread_runs_its_ops_alone_and_the_main_thread_keeps_its_team():
    before = torch.get_num_threads()
    seen = {}

    def helper():
        seen["cut"] = single_threaded_ops()
        seen["threads"] = torch.get_num_threads()
        x = torch.randn(256, 256)
        seen["ok"] = torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-3)

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    if not seen["cut"]:
        pytest.skip("torch's OpenMP runtime is not libgomp here")
    assert seen["threads"] == 1 and seen["ok"]
    assert torch.get_num_threads() == before
