"""bench/analyze_colocate.py on a hand-made co-location result (shares, transitions, violations, stalls), and
bench/bench_colocate.py's dry run: the matrix layout, step records analyze reads, merging calls."""

import gzip
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import analyze_colocate  # noqa: E402
import colocate_matrix  # noqa: E402
import colocate_windows  # noqa: E402
import profile_fit  # noqa: E402
import replan_mixed  # noqa: E402
import replay_controller  # noqa: E402
import step_measures  # noqa: E402

from harli_train.colocate.predictor import LatencyPredictor, fit_options  # noqa: E402

COLUMNS = colocate_matrix.STEP_COLUMNS


def _row(t, kind, sms, train, predicted, measured, interval=None, launching=False, prefill=None, queue=None):
    return [t, kind, 4, sms, 132 - sms if train else 0, "beside" if train else "none"] + [
        predicted,
        measured,
        measured,
        interval,
        1,
        launching,
        "bwd" if launching else None,
        "r",
        None,
        queue,
        None,
        prefill,
        0,
        None,
        None,
        None,
        None,
        None,
    ]


def results():
    steps = [
        _row(0.00, "decode", 132, False, 0.005, 0.005),
        _row(0.01, "decode", 48, True, 0.008, 0.009, 0.009),  # exit from the whole GPU: 1.125
        _row(0.02, "decode", 48, True, 0.008, 0.008, 0.0095, True),  # same share: 1.0, 1.5 ms host gap
        _row(0.03, "decode", 64, True, 0.007, 0.0084, 0.0084, queue="loss+fwd"),  # grow: 1.2
        _row(0.06, "prefill", 132, False, None, 0.03),
        _row(0.07, "decode", 64, True, 0.007, 0.0077, None),  # after a prefill: 1.1
        _row(
            0.08, "decode", 48, True, 0.008, 0.024, 0.024, queue="loss"
        ),  # shrink: 3.0, a stall, a violation
        _row(0.09, "decode", 48, True, 0.008, 0.008, 0.008, queue=""),
        _row(0.10, "mixed", 132, False, 0.008, 0.006, 0.0065, prefill=32),  # 0.75, paused: 6.5 ms
        _row(0.11, "mixed", 132, False, 0.008, 0.0064, 0.007, prefill=40),  # 0.8
        _row(0.12, "mixed", 96, True, 0.009, 0.0081, 0.0082, prefill=130),  # 0.9, beside the trainer
    ]
    cell = {
        "harli": {
            "finetune_tokens_per_s": 1000.0,
            "violations": 1,
            "feed": {"rebuilt_chunks": 2, "gpu_busy_s": 0.08, "launch_host_s": 0.05},
            "step_columns": COLUMNS,
            "steps": steps,
        },
        "static:64": {"finetune_tokens_per_s": 800.0, "violations": 0},  # no per-step records: skipped
    }
    return {"env": {"sms": 132}, "setup": {"objective_tpot_ms": 10.0}, "cells": {"bursty/heavy": cell}}


def test_analysis_prints_the_neighbour_excess_a_window_learnt(tmp_path):
    """A harli:neighbour=on row's learnt excess (the controller's ``neighbour_excess``) is printed per
    kind."""
    result = results()
    result["cells"]["bursty/heavy"]["harli"]["neighbour_excess"] = {
        "quantile": 0.95,
        "all": 1.01,
        "kinds": {
            "loss": {"steps": 40, "value": 1.12, "factor": 1.109},
            "fwd": {"steps": 64, "value": 1.0, "factor": 1.0},
        },
        "steps_sized": 17,
    }
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    proc = subprocess.run(
        [sys.executable, str(BENCH / "analyze_colocate.py"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout.split("harli:neighbour=on at the window's end")[1]
    loss = next(line for line in table.splitlines() if " loss " in line)
    assert loss.split()[2:] == ["loss", "40", "1.12", "1.11", "1.01", "17"]


def test_analysis_attributes_steps_and_shares():
    report = analyze_colocate.analyze(results())
    (cell,) = report["cells"].values()
    assert list(cell) == ["harli"]
    r = cell["harli"]
    # Trainer SMs per interval ending at each row: 84, 84, 68, 0 (prefill), 68, 84, 84, 0, 0 (mixed steps on
    # the whole GPU), 36 over 0.01 s each, except the 0.03 s before the prefill.
    spans = [(0.01, 84), (0.01, 84), (0.01, 68), (0.03, 0), (0.01, 68), (0.01, 84), (0.01, 84)]
    spans += [(0.01, 0), (0.01, 0), (0.01, 36)]
    assert r["trainer_sms"] == pytest.approx(sum(d * s for d, s in spans) / 0.12)
    assert r["no_trainer_s"] == pytest.approx(0.05)
    assert r["tokens_per_s_per_sm"] == pytest.approx(1000.0 / r["trainer_sms"])
    t = report["transitions"]["harli"]
    assert t["exit whole GPU"]["median"] == pytest.approx(1.125)
    assert t["grow"]["median"] == pytest.approx(1.2)
    assert t["after prefill"]["median"] == pytest.approx(1.1)
    assert t["shrink"]["max"] == pytest.approx(3.0) and t["shrink"]["over_1"] == 1
    assert t["same share"]["steps"] == 2 and t["same share"]["over_1"] == 0
    (violation,) = r["violating_steps"]
    assert len(violation) == 3 and "measured 24.0" in violation[-1]
    (stall,) = r["stalls"]
    assert "GPU 24.0" in stall and "t=0.080" in stall
    # Host time between decode steps (interval less latency), split by the trainer thread's launching.
    gaps = report["host_gaps_ms"]["harli"]
    assert gaps["trainer launching"]["steps"] == 1 and gaps["trainer launching"]["max"] == pytest.approx(1.5)
    assert gaps["trainer launching bwd"]["steps"] == 1  # and by what it was launching
    assert gaps["trainer idle"]["steps"] == 4 and gaps["trainer idle"]["max"] == pytest.approx(0.0)
    # Mixed steps by their chunk's prefill tokens, and the whole GPU's mixed seconds (the trainer paused).
    chunks = report["mixed_chunks"]["harli"]
    assert chunks["1-63"]["steps"] == 2 and chunks["1-63"]["median"] == pytest.approx(0.775)
    assert chunks["128-255"]["max"] == pytest.approx(0.9) and "64-127" not in chunks
    assert r["whole_gpu_mixed_s"] == pytest.approx(0.0135)
    # Decode steps beside the trainer by share and batch (every row here has 4 sequences).
    beside = report["beside_fit"]["harli"]
    assert list(beside) == ["48 SMs, batch 2-8", "64 SMs, batch 2-8"]
    assert beside["48 SMs, batch 2-8"]["steps"] == 4 and beside["48 SMs, batch 2-8"]["max"] == pytest.approx(
        3.0
    )
    assert beside["48 SMs, batch 2-8"]["median"] == pytest.approx(1.0625)
    assert beside["64 SMs, batch 2-8"]["median"] == pytest.approx(1.15)
    # ... and by the trainer's oldest micro-step on the GPU as they started (no column: unknown).
    by_queue = report["beside_queue_fit"]["harli"]
    assert list(by_queue) == ["loss", "nothing queued", "unknown"]
    assert by_queue["loss"]["steps"] == 2 and by_queue["loss"]["median"] == pytest.approx(2.1)
    assert by_queue["loss"]["p99"] == pytest.approx(3.0) and by_queue["loss"]["max"] == pytest.approx(3.0)
    assert by_queue["nothing queued"]["steps"] == 1 and by_queue["unknown"]["steps"] == 3
    sizes = [step_measures.batch_size(b) for b in (1, 2, 8, 9, 17, 32, 33, 64, 65, 200)]
    assert sizes == ["1", "2-8", "2-8", "9-16", "17-32", "17-32", "33-64", "33-64", "65+", "65+"]


def test_step_breakdown_says_where_the_paused_seconds_went_and_which_shares_each_batch_took():
    """A step's seconds are those since the step before it; paused ones by cause (whole-GPU mixed steps,
    the drain before them, prefill steps, the rest) and by episode; decode shares per batch beside the
    trainer."""
    import step_breakdown

    def row(t, kind, sms, train, batch=2, reason="r", measured=0.009):
        return {"t": t, "kind": kind, "infer_sms": sms, "train": "beside" if train else "none",
                "train_sms": 132 - sms if train else 0, "batch": batch, "reason": reason,
                "measured_s": measured, "predicted_s": 0.01}  # fmt: skip

    drain = step_breakdown.DRAIN_REASON + " on 48 SMs, its prefill waits"
    rows = [
        row(0.00, "decode", 48, True, batch=1),
        row(0.01, "decode", 64, True, batch=1),
        row(0.02, "decode", 48, False, reason=drain),  # episode 1: two drain steps, two mixed
        row(0.03, "decode", 48, False, reason=drain, measured=0.007),  # the queue had ended: decode alone
        row(0.04, "mixed", 132, False, reason=step_breakdown.HANDOFF_REASON),  # harli:handoff=gpu's
        row(0.06, "mixed", 132, False),
        row(0.07, "decode", 48, True, batch=3),
        row(0.08, "prefill", 132, False),  # episode 2: a prefill step and a paused decode step
        row(0.11, "decode", 48, False, batch=3),
        row(0.12, "decode", 48, True, batch=3),
    ]
    got = step_breakdown.paused_time(rows, 132)
    assert got["whole_gpu_mixed_s"] == pytest.approx(0.03) and got["drain_s"] == pytest.approx(0.02)
    assert got["drain_alone_s"] == pytest.approx(0.01)
    assert got["handoffs"] == 1 and got["handoffs_over"] == 0  # counted, within the objective given
    rows[4]["interval_s"] = 0.02
    assert step_breakdown.paused_time(rows, 132, 0.015)["handoffs_over"] == 1
    assert got["prefill_s"] == pytest.approx(0.01) and got["other_s"] == pytest.approx(0.03)
    assert got["episodes"] == 2
    assert got["whole_gpu_mixed_steps_per_episode"] == 1 and got["drain_steps_per_episode"] == 1  # 2, 0
    assert step_breakdown.decode_shares(rows) == {1: {48: 1, 64: 1}, 3: {48: 2}}
    assert step_breakdown.grows(rows) == {"48 -> 64": 1}
    beside = step_breakdown.beside_seconds(rows)
    assert list(beside) == ["decode 48 + trainer 84", "decode 64 + trainer 68"]
    assert beside["decode 48 + trainer 84"] == pytest.approx(0.02)
    assert beside["decode 64 + trainer 68"] == pytest.approx(0.01)
    report = analyze_colocate.analyze(results())
    paused = report["cells"]["bursty/heavy"]["harli"]["paused"]
    assert paused["prefill_s"] == pytest.approx(0.03) and paused["whole_gpu_mixed_s"] == pytest.approx(0.02)
    assert paused["episodes"] == 2


def test_policies_list_keeps_a_variants_options_together():
    import colocate_args

    assert colocate_args.policy_list("harli,harli:window=0.1,launch=ahead,static,,temporal") == [
        "harli",
        "harli:window=0.1,launch=ahead",
        "static",
        "temporal",
    ]
    assert colocate_args.policy_list("harli,static") == ["harli", "static"]


def test_gemv_rows_names_the_most_rows_the_gemv_keeps_up_to_and_forces_each_path():
    import gemv_rows
    import torch

    from harli_train.engine import decode_forward as df

    assert gemv_rows.gemv_up_to({64: 0.8, 96: 0.9, 128: 1.0, 192: 1.1, 256: 0.95}) == 128
    assert gemv_rows.gemv_up_to({64: 1.2, 128: 0.9}) is None
    x, square = torch.zeros(128, 4096), (torch.zeros(4096, 4096),)
    wide = (torch.zeros(14336, 4096), torch.zeros(14336, 4096))
    assert not df._use_gemv(x, wide)  # the rule: past MAX_GEMV_ROWS rows, cuBLAS
    with gemv_rows.path("gemv"):
        assert df._use_gemv(x, wide) and df._use_gemv(x, square)
    with gemv_rows.path("cublas"):
        assert not df._use_gemv(x[:1], wide) and not df._use_gemv(x[:1], square)
    assert (df.MAX_GEMV_ROWS, df.CUBLAS_SQUARE_ROWS) == (64, 64)  # restored


def test_gemv_by_share_names_the_least_share_from_which_the_fmas_keep_up():
    """FMAs belong from the least share where they are no slower there and on every larger share."""
    import gemv_by_share

    assert gemv_by_share.fma_from({132: 1.05, 112: 1.01, 96: 0.99, 80: 1.02, 48: 0.9}) == 112
    assert gemv_by_share.fma_from({132: 1.0, 64: 1.2, 48: 1.1}) == 48
    assert gemv_by_share.fma_from({132: 0.97, 96: 1.3}) is None


@pytest.mark.slow
def test_analysis_reads_plain_and_gzipped_results(tmp_path):
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(json.dumps(results()))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert analyze_colocate.load(plain) == analyze_colocate.load(packed) == json.loads(json.dumps(results()))


def dry_run(out: Path, *args: str) -> dict:
    """bench_colocate.py --dry-run with ``args`` writing to ``out``; its result, read back."""
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_colocate.py"), "--dry-run", *args],
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (result,) = out.glob("bench_colocate-*.json")
    return colocate_matrix.load(result)


def test_analysis_counts_what_harlis_grow_headroom_held_and_the_grows_it_came_before():
    # Budget 10 ms x (1 - 0.2) = 8 ms; within the 5 % headroom: predicted over 7.6 ms, beside the trainer.
    rows = [
        dict(zip(COLUMNS, r, strict=True))
        for r in (
            _row(0.00, "decode", 48, True, 0.0070, 0.007),
            _row(0.01, "decode", 48, True, 0.0078, 0.007),  # near the budget
            _row(0.02, "decode", 48, True, 0.0079, 0.007),  # near the budget
            _row(0.03, "decode", 64, True, 0.0070, 0.007),  # a grow, within 5 steps of one
            _row(0.04, "decode", 48, False, 0.0079, 0.007),  # the trainer paused: nothing held
            _row(0.05, "decode", 48, True, 0.0070, 0.007),
            _row(0.07, "decode", 80, True, 0.0070, 0.007),  # a grow, not within 5 steps of one
            _row(0.08, "decode", 80, True, 0.0070, 0.007),
        )
    ]
    rows[6]["t"] = 0.16
    for i in range(7):
        rows.insert(6, {**rows[5], "t": 0.06 + 0.01 * i})
    got = step_measures.near_budget(rows, 0.008, 0.05)
    assert got["near_budget_steps"] == 2 and got["near_budget_s"] == pytest.approx(0.02)
    assert got["grows"] == 2 and got["grows_after_near"] == 1
    # 14 decode steps before the last, 6 of them within 5 steps after a near one (rows 2-7)
    assert got["grows_by_chance"] == pytest.approx(2 * 6 / 14)
    assert step_measures.near_budget(rows, 0.008, 0.0)["near_budget_steps"] == 0
    assert analyze_colocate.grow_headroom("harli") == 0.05
    assert (
        analyze_colocate.grow_headroom("harli:grow=0.1") == 0.1
        and analyze_colocate.grow_headroom("static:48") == 0
    )
    report = analyze_colocate.analyze({**results(), "setup": {"objective_tpot_ms": 10.0, "margin": 0.2}})
    assert report["cells"]["bursty/heavy"]["harli"]["near_budget_steps"] == 4  # predicted 8.0 ms > 7.6


def test_replan_mixed_moves_whole_gpu_mixed_steps_beside_the_trainer_where_a_floor_fits():
    """bench/replan_mixed.py on the H200 profile of 2026-12-04 (kept in tests/data): a mixed step of 3 decode rows that ran on the whole
    GPU (its chunk capped at 61 prefill tokens by the 64-row graph) fits 32 tokens, and the same 61-62, on 112
    SMs beside the trainer within an 8.8 ms budget, but not 64 (a 128-row graph) on any share."""
    profile = colocate_matrix.load(Path(__file__).parent / "data/h200-llama-8b-profile-2026-12-04.json.gz")
    meta = profile["meta"]
    predictor = LatencyPredictor.fit(profile["samples"], 132, meta["kv_bytes_per_token"], **fit_options(meta))
    rows = [
        dict(zip(COLUMNS, r, strict=True))
        for r in (_row(0.0, "mixed", 132, False, 0.008, 0.007, prefill=61),)
    ]
    for row in rows:
        row["batch"], row["kv_tokens"] = 3, 1450
    shares = [16, 32, 48, 64, 80, 96, 112, 132]
    got = replan_mixed.replan(rows, predictor, shares, 0.0088, [32, 64, 128], 256)
    assert got["moves"][32] == {112: 1} and got["chunks"][(32, 112)][0] >= 61
    assert got["moves"][64] == {None: 1} and got["moves"][128] == {None: 1}
    assert replan_mixed.replan(rows, predictor, shares, 0.0088, [32], 256, 1.2)["moves"][32] == {None: 1}


def test_profile_fit_prices_each_share_against_the_profiles_raw_model_beside_the_trainer_and_alone():
    """bench/profile_fit.py on the H200 profile of 2026-12-04: decode steps beside the trainer measured 1.3x
    the raw co-run model on 32 SMs and as modelled on 96 read 1.3 and 1.0 in the co-run column, and more
    than that against the step alone (the trainer costs decode); steps alone or mixed are left out, and a
    policy family takes harli's variants."""
    profile = colocate_matrix.load(Path(__file__).parent / "data/h200-llama-8b-profile-2026-12-04.json.gz")
    predictor = replan_mixed.fitted(profile)
    rows = []
    for sms, factor, batch in ((32, 1.3, 4), (32, 1.3, 6), (96, 1.0, 20), (96, 1.0, 24)):
        raw = predictor.predict(batch, batch * 500, sms, corun=True, raw=True)
        rows.append(dict(kind="decode", train="beside", batch=batch, kv_tokens=batch * 500, infer_sms=sms,
                         measured_s=factor * raw))  # fmt: skip
    rows += [
        dict(kind="decode", train="none", batch=4, kv_tokens=2000, infer_sms=132, measured_s=0.02),
        dict(kind="mixed", train="beside", batch=4, kv_tokens=2000, infer_sms=32, measured_s=0.02),
    ]
    fit = profile_fit.fit_by_share(predictor, rows)
    assert set(fit) == {(32, "2-8"), (96, "17-32")}
    assert fit[(32, "2-8")]["steps"] == 2 and abs(fit[(32, "2-8")]["corun_median"] - 1.3) < 1e-9
    assert abs(fit[(96, "17-32")]["corun_median"] - 1.0) < 1e-9
    assert all(f["solo_median"] > f["corun_median"] for f in fit.values())
    assert profile_fit.of_policy("harli:grow=0", "harli") and not profile_fit.of_policy("static:64", "harli")
    assert profile_fit.of_policy("static:64", "static:64")


def test_replay_controller_tries_a_share_slower_than_the_model_less_often_with_the_visit_rule():
    """bench/replay_controller.py on the H200 profile of 2026-12-04: a window whose decode steps ran 1.14x
    their raw prediction on 32 SMs and 1.0x on 48 and 64, replayed through a fresh controller (objective
    11.5 ms): with the
    share-visit rule decode returns to 32 SMs far less often, and fewer steps overrun the budget."""
    profile = colocate_matrix.load(Path(__file__).parent / "data/h200-llama-8b-profile-2026-12-04.json.gz")
    meta = profile["meta"]
    predictor = LatencyPredictor.fit(profile["samples"], 132, meta["kv_bytes_per_token"], **fit_options(meta))
    ladder = replay_controller.SMLadder.cpu_standin(132, 16, group_sms=8)
    ratios = {32: [1.14], 48: [1.0], 64: [1.0]}
    steps = [(2, 1400)] * 1500  # 32 SMs: 9.05 ms raw, within the 9.78 ms budget as modelled, 10.3 as run
    runs = {}
    for variant, confirm in (("on", predictor.share_confirm), ("off", float("inf"))):
        predictor.share_confirm = confirm
        runs[variant] = replay_controller.replay(
            predictor, ladder, steps, ratios, 0.0115, 0.15, 0, "harli:margin=fixed"
        )
    assert runs["off"]["visits"][32] >= 3 * max(runs["on"]["visits"][32], 1)
    assert runs["on"]["over_budget"] < runs["off"]["over_budget"]
    # The ratios a window's steps showed, per share, over their raw prediction.
    rows = [dict(zip(COLUMNS, _row(0.0, "decode", 48, True, 0.008, 0.0075), strict=True))]
    rows[0]["batch"], rows[0]["kv_tokens"] = 6, 4200
    raw = predictor.predict(6, 4200, 48, True, raw=True)
    assert replay_controller.both_ratios(predictor, rows)[0] == {48: [pytest.approx(0.0075 / raw)]}
    # A step whose rows ran on an adapter is one adapter to the predictor (the column counts rows); a step
    # carries it third, and the profile's adapter steps price it: decode takes more SMs for the same rows.
    assert [replay_controller.adapter_slots(r) for r in ({"adapter_rows": 5}, {"adapter_rows": 0}, {})] == [
        1,
        0,
        0,
    ]
    predictor.share_confirm = float("inf")

    def mean_share(lora: int | None) -> float:
        steps_of = steps[:200] if lora is None else [(b, kv, lora) for b, kv in steps[:200]]
        run = replay_controller.replay(
            predictor, ladder, steps_of, ratios, 0.0115, 0.15, 0, "harli:margin=fixed"
        )
        return sum(sms * n for sms, n in run["taken"].items()) / sum(run["taken"].values())

    assert mean_share(None) == mean_share(0) < mean_share(1)


def test_replay_controller_draws_by_the_trainers_kinds_and_harli_sees_them():
    """A step is replayed with the kinds the trainer had on the GPU as the run planned it (the record before
    it), draws from its share's ratios beside the same kinds once ``KIND_MIN`` are in, and
    ``harli:neighbour=on`` sizes by them: the steps beside the slow kind take a larger share, and the others
    the share the model gives them."""
    queues = ["fwd", "fwd+loss", "loss", None, "bwd"]
    rows = [
        dict(zip(COLUMNS, _row(i * 0.01, "decode", 48, True, 0.008, 0.0075, queue=q), strict=True))
        for i, q in enumerate(queues)
    ]
    kinds = replay_controller.planned_kinds(rows)
    assert [kinds[id(r)] for r in rows] == [(), ("fwd",), ("fwd", "loss"), ("loss",), ()]
    ratios = {48: [1.0] * 10}
    by_kinds = {(48, ("loss",)): [1.5] * replay_controller.KIND_MIN, (48, ("fwd",)): [2.0]}  # too few: unused
    for draws in replay_controller.DRAWS:
        draw = replay_controller.RatioDraws(ratios, 0, draws, by_kinds)
        assert draw(48, ("loss",)) == draw(50, ("loss",)) == 1.5
        assert draw(48, ("fwd",)) == draw(48) == 1.0
    profile = colocate_matrix.load(Path(__file__).parent / "data/h200-llama-8b-profile-2026-12-04.json.gz")
    meta = profile["meta"]
    predictor = LatencyPredictor.fit(profile["samples"], 132, meta["kv_bytes_per_token"], **fit_options(meta))
    ladder = replay_controller.SMLadder.cpu_standin(132, 16, group_sms=8)
    # One step in 25 is planned beside the loss micro-step and runs 1.12x its raw prediction there.
    steps = [(2, 1400, 0, ("loss",) if i % 25 == 0 else ("fwd",)) for i in range(1500)]
    by_kinds = {(s, ("loss",)): [1.12] * 20 for s in (32, 48, 64)}
    ratios = {s: [1.0] for s in (32, 48, 64)}
    raw32 = predictor.predict(2, 1400, 32, True, raw=True)
    runs = {
        policy: replay_controller.replay(
            predictor,
            ladder,
            steps,
            ratios,
            raw32 / 0.95,
            0.04,
            0,
            policy,
            draws="ordered",
            by_kinds=by_kinds,
        )
        for policy in ("harli:margin=fixed", "harli:margin=fixed,neighbour=on")
    }
    plain, aware = runs["harli:margin=fixed"], runs["harli:margin=fixed,neighbour=on"]
    assert plain["over_tpot"] > 0 and aware["over_tpot"] < plain["over_tpot"]
    # The plain policy learns each miss beside loss GPU-wide and leaves 32 SMs for good; the aware one puts
    # the steps beside loss on a larger share and, the miss foreseen, keeps decode on 32 SMs between them.
    assert plain["taken"][32] < 50 and aware["taken"][32] > 10 * plain["taken"][32]
    assert aware["taken"][48] >= len(steps) // 25


def test_replay_controller_variants_add_harlis_options_and_report_the_trainers_sms():
    """``--options``: each entry is harli's options added to the replayed policy, after the share-visit rule
    on and off; a bad option is refused by name. Steps that run exactly at their raw prediction let a
    learned margin (it falls to its floor) move decode to a smaller share than the fixed 0.15 allows, and the
    trainer's mean SMs rise with it."""
    profile = colocate_matrix.load(Path(__file__).parent / "data/h200-llama-8b-profile-2026-12-04.json.gz")
    meta = profile["meta"]
    predictor = LatencyPredictor.fit(profile["samples"], 132, meta["kv_bytes_per_token"], **fit_options(meta))
    ladder = replay_controller.SMLadder.cpu_standin(132, 16, group_sms=8)
    chosen = replay_controller.variants("harli", ["settle=on", "margin=learn,grow=0"], [0.1])
    assert [(name, policy, margin) for name, _, policy, margin in chosen] == [
        ("visits confirm", "harli", None),
        ("rule off", "harli", None),
        ("settle=on", "harli:settle=on", None),
        ("margin=learn,grow=0", "harli:margin=learn,grow=0", None),
        ("margin 0.1", "harli:margin=fixed", 0.1),  # --margins: the replayed policy held at a margin
    ]
    assert replay_controller.variants("harli:grow=0", ["window=0"])[-1][2] == "harli:grow=0,window=0"
    with pytest.raises(ValueError, match="grow"):
        replay_controller.variants("harli", ["grow=2"])
    with pytest.raises(ValueError, match="margin"):
        replay_controller.variants("harli", [], [1.5])
    steps = [(2, 1400)] * 600
    raw32 = predictor.predict(2, 1400, 32, True, raw=True)
    tpot = raw32 / 0.9  # 32 SMs fit a 10 % margin, not 15 %
    ratios = {s: [1.0] for s in (32, 48, 64)}
    fixed = replay_controller.replay(predictor, ladder, steps, ratios, tpot, 0.15, 0, "harli:margin=fixed")
    learnt = replay_controller.replay(predictor, ladder, steps, ratios, tpot, 0.15, 0, "harli")  # learns
    assert fixed["taken"][32] == 0 and learnt["taken"][32] > 400
    assert learnt["over_tpot"] == 0 and learnt["trainer_sms"] > fixed["trainer_sms"] > 0
    assert learnt["intervals_over_tpot"] == 0 and learnt["violation_rate"] == 0.0
    # Every step over the objective counts its rows' intervals (2 a step here), as the bar does.
    spiky = {s: [1.0] * 9 + [1.6] for s in (32, 48, 64)}  # one step in ten runs 1.6x its raw prediction
    slow = replay_controller.replay(
        predictor, ladder, steps, spiky, tpot, 0.15, 0, "harli:margin=fixed", draws="ordered"
    )
    assert slow["over_tpot"] > 0 and slow["intervals_over_tpot"] == 2 * slow["over_tpot"]
    assert slow["violation_rate"] == pytest.approx(slow["over_tpot"] / len(steps))
    tenth = replay_controller.replay(predictor, ladder, steps, ratios, tpot, 0.1, 0, "harli:margin=fixed")
    assert tenth["taken"][32] > 0.9 * len(steps) and tenth["over_tpot"] == 0  # after the whole GPU's start
    with pytest.raises(ValueError, match="harli's decode steps"):
        replay_controller.replay(predictor, ladder, steps, ratios, tpot, 0.15, 0, "static:48")


def test_a_results_harli_name_is_restated_under_todays_defaults():
    """A result records harli's defaults in force (``setup.harli_defaults``); a stored name replays as the
    policy its run built: ``harli`` of a result written before the record had a fixed margin, ``harli`` of
    one whose record says the margin was learnt is today's ``harli``; options the name lists win, options
    added since the record take today's defaults, and other policies pass through."""
    import harli_defaults

    from harli_train.policy_names import DEFAULT_LEARN_MARGIN, harli_name

    assert harli_defaults.in_force()["learn_margin"] is DEFAULT_LEARN_MARGIN
    assert harli_name(**harli_defaults.in_force()) == "harli"
    old = {"margin": 0.15}  # no record: written before 2026-12-07, the margin fixed
    assert harli_defaults.as_ran("harli", old) == "harli:margin=fixed"
    assert harli_defaults.as_ran("harli:grow=0", old) == "harli:grow=0,margin=fixed"
    assert harli_defaults.as_ran("harli:margin=learn", old) == "harli"
    recorded = {"harli_defaults": harli_defaults.in_force() | {"gone": 1}}
    recorded["harli_defaults"].pop("trainer_window_s")  # an option added after the record
    assert harli_defaults.as_ran("harli", recorded) == "harli"
    assert harli_defaults.as_ran("harli:settle=on", recorded) == "harli:settle=on"
    assert harli_defaults.as_ran("static:64", old) == "static:64"
    with pytest.raises(ValueError, match="unknown harli option"):
        harli_defaults.as_ran("harli:bogus=1", old)
    # the margin a row decided under: a learnt one's median, else the run's fixed one
    learnt = {"learned_margin": {"start": 0.15, "now": 0.05, "min": 0.04, "median": 0.06, "max": 0.15}}
    assert harli_defaults.decided_margin(learnt, 0.15) == 0.06
    assert harli_defaults.decided_margin({"learned_margin": None}, 0.15) == 0.15


def test_replay_controller_puts_the_trainer_where_harli_would_and_draws_ratios_in_order():
    """The trainer's SMs are those of the rung harli launches it on: with decode's step predicted within the
    grow headroom of the budget the trainer keeps clear of the next larger share too (84 SMs beside decode's
    32), so it holds fewer SMs than decode leaves; without the headroom (``grow=0``) it holds all but the
    trail of the start's larger shares. ``ordered`` draws take a
    share's ratios in the window's order from a seeded start, wrapping round; ``iid`` picks at random."""
    profile = colocate_matrix.load(Path(__file__).parent / "data/h200-llama-8b-profile-2026-12-04.json.gz")
    meta = profile["meta"]
    predictor = LatencyPredictor.fit(profile["samples"], 132, meta["kv_bytes_per_token"], **fit_options(meta))
    ladder = replay_controller.SMLadder.cpu_standin(132, 16, group_sms=8)
    steps = [(2, 1400)] * 300
    raw32 = predictor.predict(2, 1400, 32, True, raw=True)
    tpot = raw32 / 0.83  # 32 SMs fit the 15 % margin, within 5 % of the budget
    ratios = {32: [1.0], 48: [1.0]}
    near = replay_controller.replay(predictor, ladder, steps, ratios, tpot, 0.15, 0, "harli:margin=fixed")
    free = replay_controller.replay(
        predictor, ladder, steps, ratios, tpot, 0.15, 0, "harli:grow=0,margin=fixed"
    )
    assert near["taken"] == free["taken"] and near["taken"][32] > 250  # after the start's whole GPU and 64
    assert near["left_sms"] == free["left_sms"] > free["trainer_sms"] > near["trainer_sms"] + 10
    draws = replay_controller.RatioDraws({32: [1.0, 2.0, 3.0], 48: [5.0]}, seed=1, draws="ordered")
    first = draws(32)
    assert [first, draws(32), draws(32), draws(32)] == [first, *(1.0 + (first + k) % 3 for k in range(3))]
    assert draws(46) == 5.0 and draws(20) in (1.0, 2.0, 3.0)  # the nearest share's
    iid = replay_controller.RatioDraws({32: [1.0, 2.0]}, seed=0)
    assert {iid(32) for _ in range(50)} == {1.0, 2.0}
    with pytest.raises(ValueError, match="draws"):
        replay_controller.RatioDraws({32: [1.0]}, seed=0, draws="sorted")


def test_standalone_rates_of_another_gpu_or_trainer_are_measured_again_and_the_file_kept(
    tmp_path, monkeypatch
):
    """A --standalone file measured on another GPU (or naming none), or with the trainer's steps graphed
    where this run's are eager (or the reverse; a file without the key was eager), is not reused: the
    rates are measured on this one, named after it and its trainer, and the file stays as it was; a file of
    this GPU and trainer is read back."""
    ladder = SimpleNamespace(spatial=[SimpleNamespace(train_sms=84, infer_sms=48)], total_sms=132)
    win = colocate_windows.Windows.__new__(colocate_windows.Windows)
    cfg = SimpleNamespace(train=SimpleNamespace(cuda_graphs=False))
    win.col = SimpleNamespace(tpot_s=0.01, ladder=ladder, cfg=cfg)
    ran = []

    def run(name, tpot_s, solo_s):
        ran.append(name)
        return {"solo_tokens_per_s": 100.0 if name == "exclusive" else 60.0}, []

    win.run = run
    monkeypatch.setattr(colocate_windows, "gpu_name", lambda: "GPU B")
    path = tmp_path / "standalone.json"
    theirs = {"whole_gpu_tokens_per_s": 9.0, "by_train_sms": {"132": 9.0}, "solo_s": 5.0, "gpu_name": "GPU A"}
    graphed_here = {**theirs, "gpu_name": "GPU B", "cuda_graphs": True}
    for stored in (theirs, {k: v for k, v in theirs.items() if k != "gpu_name"}, graphed_here):
        path.write_text(json.dumps(stored))
        ran.clear()
        got = win.standalone(path, 0.5)
        assert ran == ["exclusive", "exclusive:48"] and json.loads(path.read_text()) == stored
        assert got == {
            "whole_gpu_tokens_per_s": 100.0,
            "by_train_sms": {"84": 60.0, "132": 100.0},
            "solo_s": 0.5,
            "gpu_name": "GPU B",
            "cuda_graphs": False,
        }
    path.write_text(json.dumps({**theirs, "gpu_name": "GPU B"}))  # this GPU's, eager by its missing key
    ran.clear()
    assert win.standalone(path, 0.5)["whole_gpu_tokens_per_s"] == 9.0 and not ran
    cfg.train.cuda_graphs = True  # a graphed run does not take it
    assert win.standalone(path, 0.5)["cuda_graphs"] is True and ran == ["exclusive", "exclusive:48"]
    cfg.train.cuda_graphs = False
    path.unlink()
    measured = win.standalone(path, 0.5)  # no file: measured and written
    ran.clear()
    assert win.standalone(path, 0.5) == {**measured, "source": str(path)} and not ran


@pytest.mark.slow
def test_bench_colocate_dry_run_writes_the_matrix_and_merges(tmp_path):
    """The bench on the assembly (CPU stand-ins): every cell's harli, at least three fixed splits, the best of
    them, the ideal, the standalone rates; two calls' results merged into one matrix."""
    steady = dry_run(tmp_path / "steady", "--trace", "steady", "--loads", "light,heavy", "--keep-steps", "40")
    varying = dry_run(
        tmp_path / "varying", "--trace", "varying", "--objectives", "auto:2", "--policies", "harli,static"
    )
    solo = steady["standalone"]
    spatial = [r for r in steady["setup"]["ladder"]["rungs"] if r["train_sms"]]
    assert {str(r["train_sms"]) for r in spatial} | {"132"} == set(solo["by_train_sms"])
    assert solo["whole_gpu_tokens_per_s"] > 0 and all(v > 0 for v in solo["by_train_sms"].values())
    assert list(steady["objectives"]) == ["auto:1.5", "auto:2"] and list(varying["objectives"]) == ["auto:2"]
    for result, keys in ((steady, ["steady/light", "steady/heavy"]), (varying, ["varying/1x"])):
        for name, obj in result["objectives"].items():
            assert list(obj["cells"]) == keys and obj["tpot_ms"] > 0 and obj["ttft_ms"] == 1000, name
            assert "best_single_static" in obj["traces"][result["setup"]["trace"]]
            for key, cell in obj["cells"].items():
                rows = cell["policies"]
                static = [n for n in rows if n.startswith("static:")]
                assert len(static) >= 3 and "best_static" in cell and cell["ideal_tokens_per_s"] > 0, key
                for row in rows.values():
                    assert "error" not in row, row.get("trace")
                    assert {"tpot_attainment", "violation_rate", "clean", "share_efficiency"} <= set(row)
                    assert {"tpot_clean", "ttft_attainment", "requests_without_first_token"} <= set(row)
                    assert row["host_counters"]["nonvoluntary_ctxt_switches"] >= 0  # the OS's view
                    assert not row["clean"] or (row["tpot_clean"] and row["ttft_attainment"] >= 0.99)
                    assert row["decode_steps"] > 0 and row["trainer_sm_seconds"]
    assert {"streams", "temporal"} <= set(steady["objectives"]["auto:2"]["cells"]["steady/light"]["policies"])
    harli = steady["objectives"]["auto:2"]["cells"]["steady/heavy"]["policies"]["harli"]
    assert harli["learned_margin"]["start"] == steady["setup"]["margin"]  # harli's default learns it
    assert steady["setup"]["harli_defaults"]["learn_margin"] is True
    policies = steady["objectives"]["auto:2"]["cells"]["steady/heavy"]["policies"]
    assert all(row["learned_margin"] is None for name, row in policies.items() if name.startswith("static:"))
    decode = [r for r in step_measures.rows_of(harli) if r["kind"] == "decode"]
    assert decode and all("launch_s" in r and "kv_tokens" in r for r in decode)  # --keep-steps rows
    report = analyze_colocate.analyze(steady)
    assert any(cell for cell in report["cells"])
    assert "->" in report["cells"]["auto:2 steady/heavy"]["harli"]["margin"]  # learnt: start -> end (range)
    old = {"margin": 0.15}  # a result written before harli's defaults were recorded: the margin was fixed
    assert not analyze_colocate.learns_margin("harli", old)
    assert analyze_colocate.learns_margin("harli", steady["setup"])
    assert analyze_colocate.margin_text(None, 0.15, True) == "0.15 learnt, range not recorded"
    matrix = tmp_path / "matrix.json.gz"
    paths = [str(next((tmp_path / t).glob("*.json"))) for t in ("steady", "varying")]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "analyze_colocate.py"), "--merge", *paths, "--out", str(matrix)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = colocate_matrix.load(matrix)
    assert sorted(merged["objectives"]["auto:2"]["cells"]) == ["steady/heavy", "steady/light", "varying/1x"]
    assert len(merged["calls"]) == 2 and "varying/1x" in proc.stdout and "verdict" in merged


@pytest.mark.slow
def test_bench_colocate_runs_several_traces_on_one_set_up(tmp_path):
    """--trace steady,bursty: both traces' cells in one call (one set-up), each trace with its own best
    single fixed split; a trace named twice or unknown is refused before anything is set up."""
    both = dry_run(
        tmp_path / "both", "--trace", "steady,bursty", "--loads", "light", "--objectives", "auto:1.5"
    )
    obj = both["objectives"]["auto:1.5"]
    assert list(obj["cells"]) == ["steady/light", "bursty/light"]
    assert set(obj["traces"]) == {"steady", "bursty"}
    assert all("best_single_static" in t for t in obj["traces"].values())
    assert (tmp_path / "both" / "bench_colocate-steady-bursty.json").is_file()
    for bad in ("steady,steady", "steady,poisson"):
        proc = subprocess.run(
            [sys.executable, str(BENCH / "bench_colocate.py"), "--dry-run", "--trace", bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and "at most once" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_bench_colocate_repeats_windows_and_measures_the_whole_gpu_in_the_same_call(tmp_path):
    """--repeats 2: each policy's row is one of its two windows, listing both, and the cell keeps that
    window's timeline alone; a harli variant in --policies runs beside harli under its own name;
    --whole-gpu-now: the trainer alone on the whole GPU in this call, which the
    light bar divides by, where the --standalone file's rates serve the rest."""
    solo = tmp_path / "standalone.json"
    rates = {"whole_gpu_tokens_per_s": 1.0, "by_train_sms": {"132": 1.0}, "solo_s": 0.5, "gpu_name": "cpu"}
    solo.write_text(json.dumps(rates))
    # harli:window=0.3 is harli itself (the default window): it does not run twice.
    policies = "harli,harli:window=0.1,harli:window=0.3"
    args = ["--loads", "light", "--objectives", "auto:2", "--policies", policies, "--standalone", str(solo)]
    result = dry_run(tmp_path / "out", *args, "--repeats", "2", "--whole-gpu-now")
    now = result["standalone"]["whole_gpu_now"]
    assert len(now["runs"]) == 2 and now["tokens_per_s"] == min(now["runs"]) > 1.0
    cell = result["objectives"]["auto:2"]["cells"]["steady/light"]
    harli = cell["policies"]["harli"]
    assert len(harli["repeats"]) == 2 and harli["finetune_tokens_per_s"] in [
        r["finetune_tokens_per_s"] for r in harli["repeats"]
    ]
    assert cell["whole_gpu_tokens_per_s"] == now["tokens_per_s"]
    v = result["verdict"]["cells"]["auto:2 steady/light"]
    assert v["fraction_of_standalone"] == pytest.approx(harli["finetune_tokens_per_s"] / now["tokens_per_s"])
    # A variant of harli: its own row beside harli's, its own timeline, never a baseline.
    assert set(cell["policies"]) == {"harli", "harli:window=0.1"}
    variant = cell["policies"]["harli:window=0.1"]
    assert variant["policy"] == "harli:window=0.1" and len(variant["repeats"]) == 2
    assert v.get("best_baseline") is None
    with tarfile.open(tmp_path / "out" / "bench_colocate-steady-timelines.tar.gz") as tar:
        assert sorted(tar.getnames()) == [
            "timelines/auto2/steady-light-harli-window-0.1.png",
            "timelines/auto2/steady-light.png",
        ]


def test_bench_pool_weighs_the_steps_after_a_reclaim_against_the_runs_other_steps():
    """A violation within 5 decode steps of a reclaim counts against it, beside the rate of the run's other
    decode steps (a load the split cannot keep violates there too); overlapping windows count a step once,
    by the nearest reclaim before it; prefill steps are not judged."""
    import bench_pool

    def step(kind, reclaims, violated):
        return {"kind": kind, "reclaims": reclaims, "violated": violated, "batch": 3, "measured_s": 0.02}

    steps = [step("decode", 0, False) for _ in range(10)]
    steps[4]["violated"] = True  # the load's own violation, before any reclaim
    steps.append(step("prefill", 0, True))
    oom = {"kind": "oom", "t": 1.0, "error": "out of memory", "recovery_s": 0.3}  # a step run again
    steps += [step("mixed", 1, True), step("decode", 1, False), oom, step("decode", 2, True)]  # two reclaims
    steps += [step("decode", 2, i in (2, 6)) for i in range(8)]  # decode rows 15 (judged) and 19 (not)
    got = bench_pool.after_reclaims(steps)
    assert got["reclaim_steps"] == 2 and got["steps_judged"] == 7  # steps 10..16 of the decode rows
    assert got["violations"] == 3 and got["violation_rate"] == pytest.approx(3 / 7)
    assert (got["steps_elsewhere"], got["violations_elsewhere"]) == (14, 2)
    assert got["excess_rate"] == pytest.approx(3 / 7 - 2 / 14)
    assert [v["steps_after_reclaim"] for v in got["violating"]] == [0, 0, 3]
    assert got["violating"][0]["kind"] == "mixed" and got["violating"][0]["measured_s"] == 0.02
    # What ran since the decode step before each (the prefill step before the first, the step that ran out
    # of memory before the second, with its recovery's time; nothing else).
    assert [[b["kind"] for b in v["between"]] for v in got["violating"]] == [["prefill"], ["oom"], []]
    assert got["violating"][1]["between"][0]["recovery_s"] == 0.3
    quiet = bench_pool.after_reclaims([step("decode", 0, False)] * 3)
    assert quiet["steps_judged"] == 0 and quiet["violation_rate"] is None and quiet["excess_rate"] is None


@pytest.mark.slow
def test_bench_pool_dry_run_runs_each_phase_in_its_own_process_and_merges_them(tmp_path):
    """bench_pool.py's phases, each in a child process of the same command line, in one result: the loss
    runs' curves, the throughput windows on and off the pool and the pool's cost."""
    out = tmp_path / "bench_pool.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_pool.py"),
            "--dry-run",
            "--windows",
            "1",
            "--traces",
            "steady",
            "--graphs-on-pool",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["setup"]) == {"plain", "loss", "pool"}
    assert result["args"]["graphs_on_pool"] == "True"  # recorded (it opens the gate on a GPU only)
    # Whether the tiny load presses the pool depends on the host's timing: the reclaim tests are elsewhere.
    assert result["loss"]["losses_equal"] and result["loss"]["pressure"]["steps"] > 0
    for phase in ("plain", "pool"):
        assert result[phase]["steady"]["median"] > 0, phase
    assert "cost_vs_plain" in result["pool"]["steady"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_pool.json"]  # the phases' files elsewhere


def test_bench_pool_cut_short_by_sigint_keeps_the_phases_done_and_ends_its_phase_process(tmp_path):
    """A device call's time limit (`timeout -s INT`) stops bench_pool.py mid-phase: the result written
    holds the phases that ended and says where it was cut, and the phase's own process ends too (an orphan
    would hold the GPU for the call's next step)."""
    root = BENCH.parent / "recipes"
    recipe = tmp_path / "cut.yaml"  # a path only this test's processes carry on their command lines
    recipe.write_text(
        (root / "quickstart.yaml")
        .read_text()
        .replace("path: data/quickstart.jsonl", f"path: {root / 'data' / 'quickstart.jsonl'}")
    )
    out = tmp_path / "bench_pool.json"
    args = ["--dry-run", "--recipe", str(recipe), "--windows", "1", "--traces", "steady", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "bench_pool.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not out.exists():  # written as the first phase (plain) ends
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["plain"]["steady"]["median"] > 0 and "pool" not in result
    assert "SIGINT" in result["interrupted"] and "plain" in result["interrupted"]
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(recipe).encode() in cmdline:
            left.append(pid)
    assert not left


def test_probe_ce_interference_prices_each_case_against_decode_alone_and_the_full_grid():
    """bench/probe_ce_interference.py: decode's pass beside each trainer kernel over its pass alone, and the
    cross-entropy kernel's time at each grid over its time at the launch config's full grid. Without a GPU
    it refuses in one line, naming what it needs."""
    import probe_ce_interference as probe

    cases = [
        {"trainer": "nothing", "grid": None, "decode_ms": 2.0, "trainer_ms": None},
        {"trainer": probe.CE, "grid": 672, "decode_ms": 2.5, "trainer_ms": 4.0},
        {"trainer": probe.CE, "grid": 42, "decode_ms": 2.2, "trainer_ms": 6.0},
        {"trainer": "GEMM (compute-bound)", "grid": None, "decode_ms": 2.1, "trainer_ms": 9.0},
    ]
    out = probe.with_ratios(cases, 2.0, 672)
    assert [c["decode_over_alone"] for c in out] == pytest.approx([1.0, 1.25, 1.1, 1.05])
    assert [c["trainer_over_full_grid"] for c in out] == [None, 1.0, 1.5, None]
    assert probe.with_ratios(cases[2:3], 2.0, 672)[0]["trainer_over_full_grid"] is None  # no full-grid case
    proc = subprocess.run(
        [sys.executable, str(BENCH / "probe_ce_interference.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_probe_decode_lora_dry_run_lists_kernels_per_variant_and_their_differences(tmp_path):
    """probe_decode_lora.py on the tiny model: per batch, the step's ops for base rows, one adapter and four,
    and what the adapters add, in one JSON."""

    def probe(*args: str) -> dict:
        proc = subprocess.run(
            [sys.executable, str(BENCH / "probe_decode_lora.py"), "--dry-run", *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OUT": str(tmp_path)},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads((tmp_path / "probe_decode_lora.json").read_text())

    result = probe("--reps", "2")
    assert sorted(result["rows"]) == sorted(
        f"b{b}_{v}" for b in (1, 4) for v in ("base", "lora_1", "lora_mix4")
    )
    for row in result["rows"].values():
        assert row["total_us"] > 0 and all(k["launches"] > 0 for k in row["kernels"].values())
    assert set(result["diffs"]) == {f"b{b}_{v}" for b in (1, 4) for v in ("lora_1", "lora_mix4")}
    # --mixed: mixed steps of each batch plus a chunk of each size, every row on the variant's adapters.
    mixed = probe("--reps", "1", "--mixed", "6", "--split-norm-rows", "64")
    assert mixed["args"]["split_norm_rows"] == 64
    assert sorted(mixed["rows"]) == sorted(
        f"b{b}_n6_{v}" for b in (1, 4) for v in ("base", "lora_1", "lora_mix4")
    )
    assert mixed["args"]["mixed"] == "6" and set(mixed["diffs"]) == {
        f"b{b}_n6_{v}" for b in (1, 4) for v in ("lora_1", "lora_mix4")
    }


def test_probe_corun_times_the_profile_points_on_the_command_lines_assembly(tmp_path):
    """probe_corun.py on the tiny model (the CPU stand-in: the eager workload only): each share's beside /
    alone ratios and the co-run fit of their predictor, in one JSON."""
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "probe_corun.py"),
            "recipes/quickstart.yaml",
            "--colocate-with",
            "tiny",
            "--shares",
            "32",
            "--batches",
            "1",
            "--kv-lens",
            "32,64",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCH.parent,
        env={**os.environ, "OUT": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "probe_corun.json").read_text())
    assert "graphed" not in result and result["grid"]["shares"] == [32]
    eager = result["eager"]
    assert [p[:3] for p in eager["points"]] == [[32, 1, 32], [32, 1, 64]] and all(
        p[3] > 0 for p in eager["points"]
    )
    assert eager["by_share"]["32"]["min"] <= eager["by_share"]["32"]["max"]
    assert eager["fit_corun_mape_pct"] >= 0


def _device_call_env(out: Path, tag: str, call_s: int, cache: Path) -> dict[str, str]:
    """The environment of a `bench/device_call.sh` run here: its archive under ``out``, the project
    installed already, the per-machine profile cache at ``cache``."""
    return {
        **os.environ, "OUT": str(out), "TAG": tag, "CALL_S": str(call_s), "DEVICE_CALL_INSTALL": "0",
        "DEVICE_CALL_CACHE": str(cache),
    }  # fmt: skip


@pytest.mark.slow
def test_device_call_runs_its_steps_within_the_call_and_packs_one_archive(tmp_path):
    """bench/device_call.sh (what a device call runs): an unknown step refused before anything runs; a
    dry-run bench step, then one skipped for want of time; everything in one archive (but a file over 4 MiB,
    such as a main job's adapter, left behind and named), nothing else under $OUT."""
    env = _device_call_env(tmp_path, "c1", 125, tmp_path.parent / f"{tmp_path.name}-cache")
    call = ["bash", str(BENCH / "device_call.sh")]
    dry = "--dry-run --trace steady --loads light --policies harli --objectives auto:2"
    typo = subprocess.run([*call, "colocate", dry, "smoek"], env=env, capture_output=True, text=True)
    assert typo.returncode == 2 and "unknown step 'smoek'" in typo.stderr and not any(tmp_path.iterdir())
    made = 'echo made > "$OUT/made.txt" && head -c 5000000 /dev/zero > "$OUT/weights.bin"'
    # A step starts only with 90 s of the call's 125 left: the sleep (step 3, reached within 35 s) puts the
    # last step past that, whatever the dry run's own time.
    steps = ["cmd", made, "colocate", dry, "cmd", "sleep 36", "colocate", dry]
    proc = subprocess.run([*call, *steps], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "=== 1 cmd: exit 0" in proc.stdout and "=== 2 colocate: exit 0" in proc.stdout
    assert "=== 3 cmd: exit 0" in proc.stdout and "=== 4 colocate: skipped" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c1.tar.gz"]
    with tarfile.open(tmp_path / "c1.tar.gz") as tar:
        names = tar.getnames()
    assert "c1/2-colocate/bench_colocate-steady.json" in names and "c1/profile.json" in names
    assert "c1/1-cmd/made.txt" in names and "c1/1-cmd/weights.bin" not in names
    assert "left behind (over 4 MiB): " in proc.stdout and "weights.bin" in proc.stdout
    assert not any(n.endswith("-timelines.tar.gz") for n in names)


def test_device_call_packs_only_what_this_call_wrote(tmp_path):
    """A machine that kept $OUT from an earlier call of the same TAG: that call's step folders do not come
    back in this call's archive."""
    stale = tmp_path / "c" / "1-colocate"
    stale.mkdir(parents=True)
    (stale / "bench_colocate-bursty.json.gz").write_bytes(b"old")
    env = _device_call_env(tmp_path, "c", 120, tmp_path.parent / f"{tmp_path.name}-cache")
    proc = subprocess.run(
        ["bash", str(BENCH / "device_call.sh"), "cmd", "true"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with tarfile.open(tmp_path / "c.tar.gz") as tar:
        names = tar.getnames()
    assert "c/1-cmd/log" in names and not any(n.startswith("c/1-colocate") for n in names)


def test_device_call_takes_the_stored_profile_and_standalone_rates_of_its_gpu(tmp_path):
    """device_call.sh names the GPU by nvidia-smi: on an H100 it unpacks the H100's stored profile and passes
    the H100's standalone rates, on an H200 the H200's, and on a machine without a GPU the first stored
    profile and the H200's rates of 2026-12-04. Steps whose trainer is graphed take rates measured graphed
    on that GPU (without a GPU: the H200's eager ones, which bench_colocate measures again). A stored
    profile not made beside the graphed co-run workload (``meta.corun_workload``) is named as one to make
    again, and one made beside it is not."""
    fake = tmp_path / "bin"
    fake.mkdir()
    seen = {}
    for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", None):
        smi = fake / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\necho '{gpu}'\n" if gpu else "#!/bin/sh\nexit 9\n")
        smi.chmod(0o755)
        out = tmp_path / f"out-{len(seen)}"
        env = _device_call_env(out, "c", 120, tmp_path / f"cache-{len(seen)}")
        env["PATH"] = f"{fake}:{env['PATH']}"
        proc = subprocess.run(
            ["bash", str(BENCH / "device_call.sh"), "cmd", "true"], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        with tarfile.open(out / "c.tar.gz") as tar:
            log = tar.extractfile("c/call.log").read().decode()
        seen[gpu] = {k: v for line in log.splitlines() for k, v in [line.partition(": ")[::2]]}
    h100, h200, none = seen["NVIDIA H100 80GB HBM3"], seen["NVIDIA H200"], seen[None]
    assert h100["gpu"] == "NVIDIA H100 80GB HBM3" and none["gpu"] == "none"
    assert h100["profile"].endswith(
        "bench/profiles/NVIDIA_H100_80GB_HBM3-llama-8b_torch.bfloat16_batch64_green.json.gz"
    )
    assert h100["standalone"].endswith("/2026-12-05-bench_colocate-standalone-h100.json")
    assert h200["profile"].endswith(
        "bench/profiles/NVIDIA_H200-llama-8b_torch.bfloat16_batch64_green.json.gz"
    )
    assert h200["standalone"].endswith("/2026-12-04-bench_colocate-standalone.json")
    assert none["standalone"].endswith("/2026-12-04-bench_colocate-standalone.json")
    assert h100["standalone graphed"].endswith("/2026-12-06-bench_colocate-standalone-h100-graphs.json")
    assert h200["standalone graphed"].endswith("/2026-12-06-bench_colocate-standalone-h200-graphs.json")
    assert none["standalone graphed"].endswith("/2026-12-04-bench_colocate-standalone.json")
    for seen_gpu in (h100, h200):
        stored = BENCH.parent / seen_gpu["profile"]
        stale = json.loads(gzip.decompress(stored.read_bytes()))["meta"].get("corun_workload") != "graphed"
        assert ("make it again" in seen_gpu.get("profile check", "")) == stale, seen_gpu


@pytest.mark.slow
def test_device_call_makes_the_profile_again_for_the_steps_after_it(tmp_path):
    """device_call.sh's ``profile`` step re-profiles (whatever the stored profile holds) into the call's
    profile: the bench step after it reuses that profile instead of profiling, it comes back in the
    archive, and a later call on the same machine starts from it."""
    env = _device_call_env(tmp_path, "c1", 300, tmp_path / "cache")
    dry = "--dry-run --trace steady --loads light --policies harli --objectives auto:2"
    steps = ["profile", "--dry-run", "colocate", dry]
    proc = subprocess.run(
        ["bash", str(BENCH / "device_call.sh"), *steps], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "=== 1 profile: exit 0" in proc.stdout and "=== 2 colocate: exit 0" in proc.stdout
    with tarfile.open(tmp_path / "c1.tar.gz") as tar:
        logs = {n: tar.extractfile(n).read().decode() for n in ("c1/1-profile/log", "c1/2-colocate/log")}
        made = json.loads(tar.extractfile("c1/profile.json").read())
    assert "profiling decode" in logs["c1/1-profile/log"]
    assert "profiling decode" not in logs["c1/2-colocate/log"]  # the fresh profile, reused
    assert made["key"]["model_id"].startswith("tiny")
    proc = subprocess.run(
        ["bash", str(BENCH / "device_call.sh"), "colocate", dry],
        env={**env, "TAG": "c2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with tarfile.open(tmp_path / "c2.tar.gz") as tar:
        log = tar.extractfile("c2/call.log").read().decode()
        bench_log = tar.extractfile("c2/1-colocate/log").read().decode()
    assert "profile: kept from an earlier call on this machine" in log
    assert "profiling decode" not in bench_log


def test_repeats_cut_short_by_the_time_budget_keep_the_windows_that_ran(tmp_path):
    import colocate_windows

    win = colocate_windows.Windows(None, tmp_path, 0.0, 1.0)
    calls = []

    def run(name, tpot_s, requests=(), **window):
        calls.append(window)
        if len(calls) > 2:
            raise colocate_windows.OutOfTime(name)
        return {"finetune_tokens_per_s": 10.0 * len(calls), "clean": True}, [len(calls)]

    win.run = run
    with pytest.raises(colocate_windows.OutOfTime) as stop:
        win.repeated(3, "harli", 0.01, (), window_s=1.0)
    row, steps = stop.value.kept
    assert row["repeats_cut"] == "2 of 3: out of time" and len(row["repeats"]) == 2
    assert row["finetune_tokens_per_s"] == 10.0 and steps == [1]  # the lower middle of two
    assert all(c["window_s"] == 1.0 and c["plot_to"] is None for c in calls)
    calls[:] = [{}, {}]  # the next window is past the budget
    with pytest.raises(colocate_windows.OutOfTime) as first:
        win.repeated(1, "harli", 0.01, (), window_s=1.0)
    assert first.value.kept is None  # nothing ran: nothing kept


def test_heldout_error_also_counts_only_the_points_whose_trainer_queue_outlasted_them(tmp_path):
    """bench/predictor_heldout.py on the stored H100 profile, some co-run points marked as having run their
    trainer queue dry: the held-out co-run error is also given over the covered points, and those counted."""
    stored = BENCH / "profiles" / "NVIDIA_H100_80GB_HBM3-llama-8b_torch.bfloat16_batch64_green.json.gz"
    profile = json.loads(gzip.decompress(stored.read_bytes()))
    dry = 0
    for r in profile["samples"]:
        if r["corun"] and r["infer_sms"] <= 32 and r["batch"] >= 32:
            r["corun_covered"], dry = False, dry + 1
        elif r["corun"]:
            r["corun_covered"] = True
    path = tmp_path / "marked.json"
    path.write_text(json.dumps(profile))
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(BENCH / "predictor_heldout.py"), str(path), "--seeds", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "predictor_heldout.json").read_text())
    assert dry > 0 and result["corun_ran_dry"] == dry
    assert f"{dry} co-run points" in proc.stdout
    for run in result["runs"]:
        assert run["covered_corun_n"] < run["corun_n"]  # the marked held-out points are left out
        assert run["covered_solo_n"] == run["solo_n"]
    assert set(result["mean"]) == {"solo_mape_pct", "corun_mape_pct", "covered_corun_mape_pct"}
