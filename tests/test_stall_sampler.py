"""The bench's stall diagnosis (bench/stall_sampler.py): the sampler tells a stall that held it too from one
it watched, and the OS counters of a window are read."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from stall_sampler import HostCounters, StallSampler, stall_spans  # noqa: E402


def test_a_stall_that_holds_the_gil_leaves_no_sample_inside_and_a_late_one_after():
    sampler = StallSampler(period_s=1e-3)
    with sampler:
        time.sleep(0.02)  # samples on time
        t0 = time.perf_counter()
        sum(range(3_000_000))  # one C call: the GIL is held throughout (tens of ms)
        held = time.perf_counter() - t0
        time.sleep(0.02)
    # The first half of the stall: `held` is read only once this thread has the GIL back, which on a loaded
    # host can be milliseconds after the samplers (this one, and any another test left running) took it.
    (got,) = sampler.around([(0.002, 0.5 * held)], t0)
    assert got["samples"] == []  # nobody sampled while the GIL was held
    assert got["after"] is not None and got["after"]["late_ms"] > 0.4e3 * held  # the sampler waited too
    (calm,) = sampler.around([(-0.015, -0.005)], t0)
    assert calm["samples"] and all(s["late_ms"] < 0.5e3 * held for s in calm["samples"])


def test_host_counters_report_this_threads_context_switches_and_the_machines_steal():
    counters = HostCounters().start()
    for _ in range(5):
        time.sleep(0.001)  # each sleep gives the CPU up: a voluntary switch
    got = counters.delta()
    assert got["voluntary_ctxt_switches"] >= 5 and got["nonvoluntary_ctxt_switches"] >= 0
    assert got["steal_s"] >= 0


def test_stall_spans_hold_slow_launches_gaps_and_waits_inside_decode_steps():
    ms = 1e-3
    rows = [
        dict(
            t=1.000, kind="mixed", measured_s=14 * ms, gpu_s=10 * ms, interval_s=14.5 * ms, launch_s=0.5 * ms
        ),
        # launched ahead of the mixed step's tokens: its 13 ms launch delayed them
        dict(t=1.007, kind="decode", measured_s=6 * ms, gpu_s=11 * ms, interval_s=6.5 * ms, launch_s=13 * ms),
        dict(t=1.020, kind="decode", measured_s=6 * ms, gpu_s=6 * ms, interval_s=10 * ms, launch_s=0.4 * ms),
        dict(t=1.030, kind="decode", measured_s=9 * ms, gpu_s=6 * ms, interval_s=9 * ms, launch_s=None),
    ]
    spans = stall_spans(rows)
    assert len(spans) == 3
    launch, gap, inside = spans
    assert launch[0] <= 1.000 - 13 * ms and launch[1] == 1.007  # from before the launch to its row's end
    assert gap == (1.020 - 10 * ms, 1.020 - 6 * ms)  # the host gap before the step
    assert inside == (1.030 - 9 * ms, 1.030)  # waiting inside the step past its GPU span


def test_stall_report_names_slow_launches_and_where_the_decode_thread_sat():
    from stall_report import sampled_stalls, slow_launches

    rows = [
        dict(
            t=0.5,
            kind="mixed",
            batch=17,
            infer_sms=132,
            launch_s=0.0215,
            forward_launch_s=0.0212,
            gpu_s=0.022,
        ),
        dict(t=0.6, kind="decode", batch=4, infer_sms=32, launch_s=0.0005),
        dict(t=0.1, kind="prefill", batch=0, infer_sms=132, launch_s=0.049),  # a prefill's launch is its work
    ]
    (line,) = slow_launches(rows)
    assert "mixed batch 17 on 132 SMs: launch 21.5 ms (forward 21.2)" in line
    stack = lambda frame: {"MainThread": [frame], "harli-train": ["trainer_worker.py:307 _loop"]}  # noqa: E731
    spans = [
        {  # on time, the decode thread in one frame: a call that released the GIL blocked
            "span": [0.52, 0.55],
            "samples": [
                {"t": 0.52 + i * 1e-3, "late_ms": 0.1, "stacks": stack("mixed_graphs.py:205 replay")}
                for i in range(9)
            ]
            + [{"t": 0.54, "late_ms": 0.4, "stacks": stack("runtime.py:355 _record")}],
        },
        {"span": [1.0, 1.02], "samples": [], "after": {"t": 1.021, "late_ms": 19.0}},  # the GIL held
        {"span": [2.0, 2.002], "samples": []},  # too short to report
    ]
    held, blind = sampled_stalls(spans)
    assert "mixed_graphs.py:205 replay (9 of 10 samples)" in held and "late by 0.4 ms" in held
    assert "trainer_worker.py:307 _loop (10)" in held
    assert "no sample inside" in blind and "19.0 ms late" in blind
