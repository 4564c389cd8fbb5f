"""bench/colocate_sweep.py and bench/colocate_load.py: the fixed splits a cell runs (a sweep that brackets
the best clean one, the top-ups of a trace's single split) and the cells' windows and loads."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import colocate_load as cl  # noqa: E402
import colocate_sweep as cs  # noqa: E402

SHARES = [16, 32, 48, 64, 80, 96, 112]


def world(threshold: int, tokens=lambda s: 200.0 - s):
    """A cell where a split is clean from ``threshold`` SMs up and trains ``tokens(share)``; records runs."""
    ran: list[int] = []

    def run(share: int) -> dict:
        ran.append(share)
        return {"clean": share >= threshold, "finetune_tokens_per_s": tokens(share)}

    return run, ran


@pytest.mark.parametrize(
    ("threshold", "start", "expected"),
    [
        (48, 48, [48, 32, 64]),  # clean start: down to the first unclean one, up one past the best
        (80, 48, [48, 64, 80, 96]),  # unclean start: up until clean, then one more
        (16, 16, [16, 32, 48]),  # clean at the bottom: up one, then outward to three rungs
        (16, 112, [112, 96, 80, 64, 48, 32]),  # clean all the way down: capped at max_rungs (6)
        (200, 80, [80, 96, 112]),  # nothing clean: up to the largest
    ],
)
def test_the_sweep_brackets_the_best_clean_split(threshold, start, expected):
    run, ran = world(threshold)
    rows = cs.sweep(SHARES, start, run, min_rungs=3, max_rungs=6)
    assert ran == expected and sorted(rows) == sorted(expected)
    clean = [s for s in ran if s >= threshold]
    if clean and len(ran) < 6:  # uncapped, the best clean split has its neighbours run (or is at an end)
        best = max(clean, key=lambda s: 200 - s)
        i = SHARES.index(best)
        assert (i == 0 or SHARES[i - 1] in rows) and (i + 1 == len(SHARES) or SHARES[i + 1] in rows)


def test_the_sweep_goes_on_up_while_tokens_improve_and_counts_errors_as_unclean():
    run, ran = world(32, tokens=lambda s: {32: 100.0, 48: 120.0, 64: 110.0}.get(s, 50.0))
    cs.sweep(SHARES, 32, run)
    assert ran == [32, 16, 48, 64]  # 48 beat 32, so one more; 64 did not

    def failing_at_48(share: int) -> dict:
        return {"error": "RuntimeError"} if share == 48 else {"clean": True, "finetune_tokens_per_s": 1.0}

    rows = cs.sweep(SHARES, 48, failing_at_48)  # a failed window: not clean, so no step down from it
    assert not cs.clean(rows[48]) and list(rows) == [48, 64, 80]


def test_the_start_is_the_least_split_predicted_to_fit_the_peak():
    rows = [
        {"kind": "prefill", "batch": 0},
        {"kind": "decode", "batch": 3, "kv_tokens": 900},
        {"kind": "decode", "batch": 6, "kv_tokens": 1800},
        {"kind": "decode", "batch": 6, "kv_tokens": 2000},  # the peak: the largest batch, then KV
    ]
    seen = []
    predict = lambda b, kv, s, n: seen.append((b, kv, n)) or 0.1 * (b + n / 10) * 64 / s
    assert cs.start_share(rows, SHARES, predict, budget_s=0.5) == 80  # 0.48 s on 80 SMs, 0.6 on 64
    assert set(seen) == {(6, 2000, 0)}
    # A step that must also compute 20 prompt tokens to keep up: 0.8 s on 64, 0.53 on 96, 0.46 on 112.
    assert cs.start_share(rows, SHARES, predict, budget_s=0.5, prefill_tokens=20) == 112
    assert cs.start_share(rows, SHARES, predict, budget_s=0.01) == 112  # none fits: the largest
    assert cs.start_share([], SHARES, predict, 0.5) == 64  # no decode step: the middle
    # 3000 prompt tokens over 15 s is 200 a second: 2 in a 10 ms step.
    assert cs.prefill_per_step([(0.0, 1000), (7.0, 1500), (15.0, 500)], 0.01, span_s=20.0) == 2
    # The busiest 10 s of a load that ramps: 4000 tokens from 20 s to 30 s, 4 in a 10 ms step.
    ramp = [(float(t), 100) for t in range(20)] + [(20 + 0.25 * i, 100) for i in range(40)]
    assert cs.prefill_per_step(ramp, 0.01) == 4
    assert cs.prefill_per_step([], 0.01) == 0


def test_top_ups_run_the_single_split_wherever_it_is_missing():
    ran = {
        "t/light": {16: {"clean": False}, 32: {"clean": True}, 48: {"clean": True}},
        "t/heavy": {48: {"clean": False}, 64: {"clean": True}, 80: {"clean": True}},
    }
    assert cs.single_split(ran, SHARES) == 64  # the least split above every cell's failures
    verdicts = {("t/light", 64): False, ("t/light", 80): True}  # 64 fails at light after all: on to 80
    done = cs.top_up(ran, SHARES, lambda cell, s: {"clean": verdicts[cell, s], "finetune_tokens_per_s": 1.0})
    assert done == ["t/light static:64", "t/light static:80"] and 80 in ran["t/light"]
    assert cs.single_split({"c": {112: {"clean": False}}}, SHARES) is None


def test_windows_last_15_s_and_hold_50_requests_lengthening_the_trace_past_its_end():
    steady = cl.lengthened("steady", 60.0)
    assert len(steady) == 115
    light, medium, heavy = cl.make_cells("steady", ["light", "medium", "heavy"], 15.0, 50)
    assert (light.key, light.window_s, len(light.requests)) == ("steady/light", 21.5, 50)  # 50th at 21.16 s
    assert (medium.window_s, medium.time_scale) == (15.0, 0.5) and len(medium.requests) >= 50
    assert heavy.window_s == 15.0 and len(heavy.requests) == 115  # 60 s of trace at 4x
    long = cl.make_cell("steady", "heavy", 20.0, 50)  # 80 s of trace: the shipped 60 s, then the generator
    assert long.requests[:115] == tuple(steady) and all(
        60.0 <= r.arrival_s < 80.0 for r in long.requests[115:]
    )
    assert [r.request_id for r in long.requests[115:118]] == ["115", "116", "117"]
    assert all(r.arrival_s * long.time_scale < long.window_s for r in long.requests)
    (varying,) = cl.make_cells("varying", ["light", "heavy"], 15.0, 50)  # whole, at 1x
    assert (varying.key, varying.window_s, varying.time_scale, len(varying.requests)) == (
        "varying/1x",
        90.0,
        1.0,
        261,
    )


def test_a_dry_run_cell_thins_and_speeds_up_the_same_load():
    heavy = cl.make_cell("bursty", "heavy", 15.0, 50)
    dry = cl.compressed(heavy, 1.0, 8, 48, 24)
    first, original = dry.requests[0], heavy.requests[0]
    assert len(dry.requests) == 8 and first.arrival_s == original.arrival_s
    assert (first.prompt_len, first.output_len) == (
        min(original.prompt_len, 48),
        min(original.output_len, 24),
    )
    assert all(r.prompt_len <= 48 and r.output_len <= 24 for r in dry.requests)
    assert max(r.arrival_s * dry.time_scale for r in dry.requests) == pytest.approx(0.8)
    assert dry.requests[-1].arrival_s > 40  # spread over the whole 60 s of trace, not its first burst


def test_no_split_clean_needs_the_largest_split_run_and_every_split_unclean():
    shares = [16, 32, 48, 64, 80, 96, 112]
    bad, good = {"clean": False, "finetune_tokens_per_s": 1.0}, {"clean": True, "finetune_tokens_per_s": 1.0}
    assert cs.no_split_clean({80: bad, 96: bad, 112: bad}, shares)
    assert not cs.no_split_clean({80: bad, 96: bad}, shares)  # the sweep stopped short of the largest
    assert not cs.no_split_clean({80: bad, 96: good, 112: bad}, shares)
    assert not cs.no_split_clean({112: {"error": "out of memory"}, 96: good}, shares)
    assert not cs.no_split_clean({}, shares) and not cs.no_split_clean(None, shares)
