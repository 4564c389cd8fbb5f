"""Mixed steps in co-location: the mixed-step model, the prefill chunk each policy sizes with it, the
objective accounting over every token interval, and a co-located run that rides prefill in decode steps."""

import dataclasses
import gzip
import json
import time
from pathlib import Path

import numpy as np
import pytest

from harli_train.colocate.accounting import objective_stats
from harli_train.colocate.mixed_model import MixedStepModel, attention_pairs
from harli_train.colocate.policy import DRAIN_HEADROOM, MIN_CHUNK, largest_chunk, make_policy
from harli_train.colocate.policy.plan import paused
from harli_train.colocate.predictor import LatencyPredictor, fit_options, split_samples
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.sm import SMLadder
from harli_train.engine.metrics import EngineMetrics
from harli_train.engine.sampling_params import SamplingParams
from harli_train.engine.sequence import Sequence
from harli_train.engine.step_work import PrefillPiece, StepPreview
from harli_train.policy_names import MIN_PREFILL_FLOOR, harli_name, parse_harli_options

from .runtime_support import TOTAL, ScriptedPolicy, requests, rows, runtime, synthetic_predictor

ROOT = Path(__file__).resolve().parents[1]


def mixed_predictor(shares):
    """The runtime tests' decode model (``synthetic_predictor``) plus mixed steps of 1 ms * (1 + 64/s) +
    0.1 ms * 64/s per row."""
    pred = synthetic_predictor(shares)
    pred.mixed = MixedStepModel({s: [1e-3 * (1 + 64 / s), 1e-4 * 64 / s, 0, 0, 0, 0] for s in shares}, {})
    return pred


def test_mixed_model_fits_the_spline_and_holds_out():
    rng = np.random.default_rng(0)
    truth = {s: [2e-3 + 0.1 / s, 4e-6 * 64 / s, 3e-6 * 64 / s, 1e-6, 2e-9, 1e-8] for s in (32, 64, 132)}
    samples = []
    for s, c in truth.items():
        for b in (8, 32):
            for n in (32, 128, 256, 512):
                for ctx in (0, 768):
                    pairs = attention_pairs([(n, ctx)])
                    r = b + n
                    t = c[0] + c[1] * r + c[2] * max(r - 64, 0) + c[3] * max(r - 256, 0) + c[4] * pairs
                    t = (t + c[5] * b * 512) * (1 + rng.normal(0, 0.01))
                    base = dict(batch=b, kv_tokens=b * 512, prefill_tokens=n, attn_pairs=pairs, infer_sms=s)
                    samples.append({**base, "corun": False, "latency_s": t})
                    samples.append({**base, "corun": True, "latency_s": t * 1.2})
    fit, held = split_samples(samples, 0.7, seed=1)
    model = MixedStepModel.fit(fit)
    errors = model.evaluate(held)
    assert errors["mixed_solo_mape_pct"] < 3 and errors["mixed_corun_mape_pct"] < 3
    assert model.slowdown[64] == pytest.approx(0.2, abs=0.03)
    # The fit reports its own leave-one-point-out error: each grid point by its share's fit without it.
    report = MixedStepModel.fit(samples).fit_report
    assert 0 < report["heldout_mixed_solo_mape_pct"] < 3 and 0 < report["heldout_mixed_corun_mape_pct"] < 3
    assert report["heldout_mixed_solo_max_ape_pct"] >= report["heldout_mixed_solo_mape_pct"]
    assert MixedStepModel.from_dict(json.loads(json.dumps(model.to_dict()))).coef == model.coef
    # A share the profile lacks: the nearest one, slower in proportion to the SMs it has fewer.
    assert model.predict(8, 4096, 128, 0, 16, False) > model.predict(8, 4096, 128, 0, 32, False)


def test_the_mixed_model_counts_the_rows_a_graph_bucket_pads_to():
    # On graphs a mixed step's tokens are padded to its bucket and the projections run over every padded
    # row: the cost steps up at each bucket and is flat within one. Fitted on the buckets, the model predicts
    # the small chunks the default grid profiles; fitted on the rows alone, it misses them.
    from harli_train.colocate.mixed_model import padded_rows
    from harli_train.colocate.profile_grid import MixedGrid

    buckets = (16, 32, *range(64, 1088, 64))
    assert [padded_rows(r, buckets) for r in (1, 16, 17, 33, 65, 2000)] == [16, 16, 32, 64, 128, 2000]

    def truth(b, n, pairs):
        r = padded_rows(b + n, buckets)
        return 4e-3 + 5e-6 * r + 2.5e-5 * max(r - 64, 0) + 1e-9 * pairs + 2e-8 * b * 512

    grid = MixedGrid()
    samples = [
        dict(batch=b, kv_tokens=b * grid.kv_len, prefill_tokens=n, attn_pairs=attention_pairs([(n, c)]),
             infer_sms=132, corun=False, latency_s=truth(b, n, attention_pairs([(n, c)])))
        for b, n, c in grid.points()
    ]  # fmt: skip
    padded, plain = MixedStepModel.fit(samples, buckets), MixedStepModel.fit(samples)
    assert padded.fit_report["heldout_mixed_solo_max_ape_pct"] < 1
    assert plain.fit_report["heldout_mixed_solo_max_ape_pct"] > 5
    restored = MixedStepModel.from_dict(json.loads(json.dumps(padded.to_dict())))
    assert restored.buckets == buckets
    for b, n in ((2, 20), (4, 28), (9, 40), (3, 100)):  # off the grid
        want = truth(b, n, attention_pairs([(n, 1000)]))
        assert restored.predict(b, b * 512, n, attention_pairs([(n, 1000)]), 132, False) == pytest.approx(
            want, rel=0.01
        )
    # Within a bucket a chunk costs (nearly) what its bucket costs: the chunk sized to a budget between
    # two buckets' costs fills the smaller one.
    pred = synthetic_predictor([132])
    pred.mixed = padded
    preview = StepPreview(2, 2 * 512, (PrefillPiece(300, 0, 0),), mixed=True)
    budget = (truth(2, 62, attention_pairs([(62, 0)])) + truth(2, 63, attention_pairs([(63, 0)]))) / 2
    n, _, _ = largest_chunk(pred, preview, 132, False, budget)
    assert n == 62  # 2 decode rows + 62 tokens: the 64-token bucket, full


@pytest.mark.parametrize(
    "max_batch,max_tokens,max_len,on_gpu",
    [(64, 4096, 1707, True), (16, 127, 255, True), (16, 96, 255, False)],
)
def test_every_engine_gets_a_mixed_grid_the_model_can_fit(max_batch, max_tokens, max_len, on_gpu):
    from harli_train.colocate.predictor_setup import mixed_grid

    grid = mixed_grid(max_batch, max_tokens, max_len, on_gpu)
    assert all(b < max_batch for b in grid.batches) and set(grid.corun_batches) <= set(grid.batches)
    assert len(grid.tokens) >= 3 and max(grid.tokens) <= max_tokens
    assert all(n + c <= max_len for _, n, c in grid.points())
    samples = [
        dict(batch=b, kv_tokens=b * grid.kv_len, prefill_tokens=n, attn_pairs=attention_pairs([(n, c)]),
             infer_sms=64, corun=False, latency_s=1e-3 + 1e-5 * (b + n) + 1e-9 * attention_pairs([(n, c)]))
        for b, n, c in grid.points()
    ]  # fmt: skip
    model = MixedStepModel.fit(samples)
    assert model.evaluate(samples)["mixed_solo_mape_pct"] < 1


def test_the_predictor_separates_and_keeps_mixed_samples():
    pred = mixed_predictor([16, 64])
    restored = LatencyPredictor.from_dict(json.loads(json.dumps(pred.to_dict())))
    assert restored.predict_mixed(4, 100, 50, 0, 64, False) == pytest.approx(
        pred.predict_mixed(4, 100, 50, 0, 64, False)
    )
    raw = pred.predict_mixed(4, 100, 50, 0, 64, True, raw=True)
    pred.alpha_up = 0.5
    pred.observe(64, True, 1.4 * raw, raw, mixed=True)
    assert pred.correction(64, True, mixed=True) > 1.1 and pred.correction(64, True) == 1.0  # kept apart
    with pytest.raises(ValueError, match="no mixed-step samples"):
        synthetic_predictor([16]).predict_mixed(1, 1, 1, 0, 16)


def test_chunks_fit_the_budget_on_each_policys_share():
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    preview = StepPreview(2, 40, (PrefillPiece(200, 0, 0), PrefillPiece(100, 0, 0)), mixed=True)
    assert preview.kind == "mixed" and preview.prefill_tokens == 300
    # 18.09 ms budget: on s SMs, 1e-3 (1 + 64/s) + 1e-4 (64/s) (2 + n) fits n <= 158 at 64 SMs, 73 at 32.
    budget = 0.0201 * 0.9
    n, t, _ = largest_chunk(pred, preview, 64, True, budget)
    assert n == 158 and t <= budget < pred.predict_mixed(2, 40, 159, 0, 64, True)
    assert largest_chunk(pred, preview, 8, True, budget)[0] == MIN_CHUNK  # nothing fits: prefill still moves
    assert (
        largest_chunk(pred, StepPreview(2, 40, (PrefillPiece(20, 0, 0),), mixed=True), 8, True, budget)[0]
        == 20
    )
    static = make_policy("static:32", ladder, pred, 0.0201, 0.1)
    plan = static.plan(preview)
    assert plan.partition.infer_sms == 32 and plan.prefill_tokens == 73 and plan.mixed_raw_s is not None
    # harli: the smallest share that fits at least its floor (128 tokens; 48 SMs fit 116), filled to what
    # fits there.
    harli = make_policy("harli", ladder, pred, 0.0201, 0.1)
    plan = harli.plan(preview)
    assert plan.partition.infer_sms == 64 and plan.prefill_tokens == 158 and not plan.paused
    assert plan.train_from_sm >= 64 and plan.transient
    # Nothing fits beside the trainer: the whole GPU, the trainer paused, but only once the trainer has
    # nothing on the GPU. First decode alone on its share without prefill: the trainer is told to stop.
    tight = make_policy("harli", ladder, pred, 0.004, 0.1)
    plan = tight.plan(preview)
    assert plan.paused and plan.prefill_tokens == 0 and plan.mixed_raw_s is None
    assert plan.decision is not None and "trainer stops launching" in plan.reason
    busy = [True]
    tight.trainer_busy = lambda: busy[0]
    plan = tight.plan(preview)  # paused, but its queued micro-steps still run: decode alone again
    assert plan.paused and plan.prefill_tokens == 0 and "queued work ends" in plan.reason
    busy[0] = False
    plan = tight.plan(preview)
    assert plan.paused and plan.partition.infer_sms == TOTAL and plan.prefill_tokens >= MIN_CHUNK
    assert plan.mixed_raw_s is not None and not plan.corun
    # Without a mixed model a policy leaves the engine's default budget.
    assert (
        make_policy("static:32", ladder, synthetic_predictor(ladder.shares), 0.02)
        .plan(preview)
        .prefill_tokens
        is None
    )


def test_harli_handoff_gpu_plans_the_whole_gpu_step_while_the_trainers_last_work_ends():
    """harli:handoff=gpu: once the trainer is held, a whole-GPU mixed step is planned while its queued work
    is expected to run for less than the budget, its chunk sized for the budget less that time, ordered
    after that work on the GPU (``after_trainer``) and not learnt from; otherwise decode runs alone."""
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    preview = StepPreview(2, 40, (PrefillPiece(2000, 0, 0),), mixed=True)
    tpot, margin = 0.006, 0.1  # no share beside the trainer fits the floor; the whole GPU fits 78 tokens
    budget = tpot * (1 - margin)
    plain, handoff = (
        make_policy("harli", ladder, pred, tpot, margin),
        make_policy("harli:handoff=gpu", ladder, pred, tpot, margin),
    )
    assert handoff.name == "harli:handoff=gpu" and handoff.handoff_gpu and not plain.handoff_gpu
    assert "handoff=" not in harli_name() and harli_name(handoff_gpu=True) == "harli:handoff=gpu"
    left = [0.001]
    for policy in (plain, handoff):
        policy.trainer_busy, policy.trainer_left_s = (lambda: True), (lambda: left[0])
        first = policy.plan(preview)  # the trainer is told to stop: decode alone, whatever the option
        assert first.paused and first.prefill_tokens == 0 and not first.after_trainer
    assert plain.plan(preview).prefill_tokens == 0  # host hand-off: waits until the work is seen to end
    plan = handoff.plan(preview)
    assert plan.paused and plan.partition is ladder.full and plan.after_trainer and not plan.corun
    assert plan.prefill_tokens >= MIN_CHUNK and plan.predicted_s <= budget - left[0]
    whole, _, _ = largest_chunk(pred, preview, TOTAL, False, budget)
    assert plan.prefill_tokens < whole  # the wait's share of the budget is not filled with prefill
    assert "once the trainer's queued work ends" in plan.reason
    corrections = pred.correction(TOTAL, False, mixed=True)
    handoff.observe(plan, 10 * budget)  # an interval that includes the wait says nothing of the step
    assert pred.correction(TOTAL, False, mixed=True) == corrections
    left[0] = budget * 0.9  # too long a wait for the least chunk: decode alone again
    plan = handoff.plan(preview)
    assert plan.prefill_tokens == 0 and not plan.after_trainer and "queued work ends" in plan.reason
    left[0] = float("inf")  # still launching
    assert handoff.plan(preview).prefill_tokens == 0
    handoff.trainer_busy = lambda: False  # the work has ended: the plain whole-GPU step, all of the budget
    plan = handoff.plan(preview)
    assert plan.prefill_tokens == whole and not plan.after_trainer
    assert parse_harli_options("handoff=host") == {"handoff_gpu": False}
    with pytest.raises(ValueError, match="handoff"):
        parse_harli_options("handoff=later")


def test_a_step_planned_after_the_trainer_waits_on_the_gpu_for_its_queue_end(tmp_path):
    # Every step launched under a plan marked `after_trainer` (harli:handoff=gpu's whole-GPU step) asks the
    # engine to start it after the queue's end event the trainer's snapshot holds as the step is launched.
    ladder = SMLadder.cpu_standin(TOTAL, 8)

    class AfterTrainer(ScriptedPolicy):
        def plan(self, preview):
            plan = paused(self.ladder.full, "after the trainer's queued work", None)
            plan.after_trainer = True
            return plan

    load = requests([(0.0, 2, 6)])
    opts = RuntimeOptions(until="load", quiet=True, plots=False)
    rt = runtime(tmp_path, ladder, lambda ladder: AfterTrainer(ladder, lambda: TOTAL), load, opts)
    end = object()  # the queue's end event (a CUDA event on a GPU)
    take = rt.worker._take_snapshot
    rt.worker._take_snapshot = lambda: dataclasses.replace(take(), queue_end=end)
    rt.worker._publish()
    waits = []
    wait = rt.engine.wait_before_next
    rt.engine.wait_before_next = lambda event: (waits.append(event), wait(event))
    rt.run()
    steps = [r for r in rows(tmp_path) if r["kind"] in ("prefill", "decode", "mixed")]
    assert steps and len(waits) >= len(steps) and all(w is end for w in waits)


def test_a_mixed_step_never_resumes_a_paused_trainer():
    """After a step that paused the trainer, a mixed step that would fit beside it runs on the whole GPU
    with the trainer still paused; the next decode step resumes it, and mixed steps ride beside it again."""
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    preview = StepPreview(2, 40, (PrefillPiece(200, 0, 0), PrefillPiece(100, 0, 0)), mixed=True)
    harli = make_policy("harli", ladder, pred, 0.0201, 0.1)
    harli.trainer_busy = lambda: False
    assert not harli.plan(preview).paused  # beside the running trainer: 64 SMs fit 158 tokens
    harli._held = True  # as after a step that paused it (a prefill, a drain on the whole GPU)
    plan = harli.plan(preview)
    assert plan.paused and plan.partition.infer_sms == TOTAL and not plan.corun
    assert plan.prefill_tokens == 300 and plan.mixed_raw_s is not None  # the whole GPU fits it all
    assert harli.plan(preview).paused  # still held: still the whole GPU
    decode = [harli.plan(StepPreview(2, 40, ())) for _ in range(harli.controller.hysteresis_steps + 1)]
    assert not decode[-1].paused  # decode steps resume the trainer (once the controller's share shrinks)
    plan = harli.plan(preview)
    assert not plan.paused and plan.partition.infer_sms == 64 and plan.prefill_tokens == 158


def test_a_learned_margin_covers_the_mixed_steps_it_sizes():
    """``harli:margin=learn``: a mixed step's chunk fills the budget, so its measured / predicted ratio joins
    the learned margin as a decode step's does; mixed steps running 20 % over their prediction widen the
    margin (the step needs a larger share for the floor's tokens), mixed steps on time narrow it (a smaller
    share fits them, leaving the trainer more). With ``margin=fixed`` the budget stays put."""
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    preview = StepPreview(2, 40, (PrefillPiece(2000, 0, 0),), mixed=True)
    shares = {}
    for ratio in (1.2, 1.0):
        harli = make_policy("harli:margin=learn", ladder, mixed_predictor(ladder.shares), 0.0201, 0.1)
        harli.trainer_busy = lambda: False
        first = harli.plan(preview)
        assert first.mixed_raw_s is not None and first.prefill_tokens == 158
        for _ in range(100):
            plan = harli.plan(preview)
            harli.observe(plan, plan.predicted_s * ratio)
        plan = harli.plan(preview)
        assert not plan.paused and plan.prefill_tokens >= harli.prefill_floor
        shares[ratio] = plan.partition.infer_sms
        margin = harli.controller.margin
        assert harli.budget_s == pytest.approx(0.0201 * (1 - margin))
        if ratio > 1:
            assert margin == pytest.approx(1 - 1 / ratio)
        else:
            assert margin == harli.controller.learned_margin.floor
    assert shares[1.0] < first.partition.infer_sms == 64 < shares[1.2]
    fixed = make_policy("harli:margin=fixed", ladder, mixed_predictor(ladder.shares), 0.0201, 0.1)
    fixed.trainer_busy = lambda: False
    for _ in range(100):
        plan = fixed.plan(preview)
        fixed.observe(plan, plan.predicted_s * 1.2)
    assert fixed.controller.margin == 0.1 and fixed.budget_s == pytest.approx(0.0201 * 0.9)


def test_harli_bisects_the_chunk_only_on_the_share_it_takes(monkeypatch):
    """A mixed step's planning is host time inside its token interval: a share where even the floor does
    not fit costs one prediction, and the bisection runs once, on the share the plan takes (the same plan
    as bisecting every share)."""
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    calls = []
    predict = LatencyPredictor.predict_mixed
    monkeypatch.setattr(
        LatencyPredictor, "predict_mixed", lambda self, *a, **k: calls.append(a[4]) or predict(self, *a, **k)
    )
    preview = StepPreview(2, 40, (PrefillPiece(2000, 0, 0),), mixed=True)
    harli = make_policy("harli", ladder, pred, 0.0201, 0.1)
    plan = harli.plan(preview)
    chosen = plan.partition.infer_sms
    assert chosen == 64 and plan.prefill_tokens == 158  # 128 tokens fit from 48 SMs up, 48 fits only 116
    below = [s for s in ladder.shares if s < chosen]
    own = harli.controller.target(2, 40)[0].infer_sms
    assert all(calls.count(s) == 1 for s in below if s >= own)  # the floor ruled each out
    assert calls.count(chosen) <= 1 + 2 + int(np.log2(2000)) + 1  # the floor, then one bisection
    assert set(calls) <= {s for s in ladder.shares if s <= chosen}  # larger shares never looked at


def test_harli_floor_sets_the_least_chunk_a_mixed_step_beside_the_trainer_takes():
    """``harli:floor=N``: a mixed step takes the smallest share (at least decode's own) where N prefill tokens
    fit beside the trainer; a floor no share fits sends it to the whole GPU, the trainer paused."""
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    preview = StepPreview(2, 40, (PrefillPiece(2000, 0, 0),), mixed=True)
    plans = {}
    for floor in (64, 128, 1024):
        harli = make_policy(f"harli:floor={floor}", ladder, pred, 0.0201, 0.1)
        harli.trainer_busy = lambda: False
        assert (
            harli.name == ("harli" if floor == 128 else f"harli:floor={floor}")
            and harli.prefill_floor == floor
        )
        plans[floor] = harli.plan(preview)
    assert (plans[64].partition.infer_sms, plans[64].prefill_tokens) == (32, 73) and not plans[64].paused
    assert (plans[128].partition.infer_sms, plans[128].prefill_tokens) == (64, 158) and not plans[128].paused
    assert plans[1024].paused and plans[1024].prefill_tokens == 0  # first the trainer stops launching
    for bad in ("harli:floor=16", "harli:floor=0", "harli:floor=x"):
        with pytest.raises(ValueError, match="unknown harli option"):
            make_policy(bad, ladder, pred, 0.0201, 0.1)
    assert MIN_PREFILL_FLOOR == MIN_CHUNK  # the grammar's least floor is the least chunk


def test_harli_floor_match_runs_beside_the_trainer_where_a_share_fits_what_the_whole_gpu_would():
    """On the H200 profile of 2026-12-04 (kept in tests/data), 3 decode rows over 1,450 cached tokens and a 512-token prompt, budget
    8.8 ms, with whole-GPU mixed steps measured at 1.32x their raw prediction (as in the H200's light cells):
    the whole GPU's chunk is capped at the 64-row graph (128 rows miss the budget), and no share fits the
    128-token floor beside the trainer. harli pauses the trainer for the whole GPU; harli:floor=match runs
    the step on 112 SMs beside it, with as many tokens as the whole GPU would take."""
    profile = json.loads(
        gzip.decompress(
            (Path(__file__).parent / "data/h200-llama-8b-profile-2026-12-04.json.gz").read_bytes()
        )
    )
    meta = profile["meta"]
    pred = LatencyPredictor.fit(profile["samples"], 132, meta["kv_bytes_per_token"], **fit_options(meta))
    ladder = SMLadder.cpu_standin(132, 16)
    preview = StepPreview(3, 1450, (PrefillPiece(512, 0, 0),), mixed=True)
    raw = pred.predict_mixed(3, 1450, 61, attention_pairs([(61, 0)]), 132, False, raw=True)
    for _ in range(64):
        pred.observe(132, False, 1.32 * raw, raw, mixed=True)
    tpot, margin = 0.0088 / 0.85, 0.15
    whole, _, _ = largest_chunk(pred, preview, 132, False, 0.0088)
    assert 32 <= whole < 64
    plain = make_policy("harli", ladder, pred, tpot, margin)
    plain.trainer_busy = lambda: False
    assert plain.plan(preview).paused  # the trainer is told to stop, for the whole GPU next
    match = make_policy("harli:floor=match", ladder, pred, tpot, margin)
    match.trainer_busy = lambda: False
    plan = match.plan(preview)
    assert match.name == "harli:floor=match" and match.floor_match
    assert not plan.paused and plan.partition.infer_sms == 112 and plan.prefill_tokens >= whole
    assert plan.train_from_sm >= 112 and plan.transient and "as many as the whole GPU" in plan.reason
    # Beside-the-trainer steps measured slower than that: no share fits the whole GPU's chunk any more.
    raw_112 = pred.predict_mixed(3, 1450, whole, attention_pairs([(whole, 0)]), 112, True, raw=True)
    for _ in range(64):
        pred.observe(112, True, 1.4 * raw_112, raw_112, mixed=True)
    assert match.plan(preview).paused


def test_a_ttft_objective_runs_a_due_prompt_whole_on_the_whole_gpu():
    # A prompt that has waited the TTFT objective less the margin gets all of its pending prefill in the next
    # step, on the whole GPU with the trainer held back, past the TPOT budget if need be; every policy alike.
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    pieces = (PrefillPiece(400, 0, 0), PrefillPiece(100, 0, 0))
    budget = 0.0201 * 0.9
    for name in ("harli", "static:32"):
        policy = make_policy(name, ladder, pred, 0.0201, 0.1)
        early = StepPreview(2, 40, pieces, mixed=True, prefill_waits=(0.05,))
        assert policy.ttft_plan(early) is None  # no TTFT objective
        policy.ttft_s = 0.2
        assert policy.ttft_plan(early) is None and policy.plan(early).prefill_tokens < 400  # not yet due
        due = StepPreview(2, 40, pieces, mixed=True, prefill_waits=(0.2 * 0.9,))
        plan = policy.plan(due)
        assert plan.reason.startswith("ttft") and plan.paused and plan.partition is ladder.full
        assert plan.prefill_tokens == 400 and not plan.corun  # the whole first prompt, not what fits
        assert plan.predicted_s > budget and plan.mixed_raw_s == pytest.approx(plan.predicted_s)
        # A prompt whose first token came already, or a step with nothing pending: the policy's own plan.
        assert policy.ttft_plan(StepPreview(2, 40, (), mixed=True, prefill_waits=())) is None


def test_a_ttft_objective_drains_a_burst_on_the_whole_gpu_within_the_budget_before_any_prompt_is_due(
    monkeypatch,
):
    # Four prompts of 300 tokens, each waited 100 ms of a 180 ms deadline (0.2 s less the 10 % margin). The
    # whole GPU computes `fit` tokens a step within the TPOT budget, so the fourth needs 4 such steps, and
    # twice their time (DRAIN_HEADROOM) plus this step is more than is left. The step goes to the whole GPU,
    # the trainer held back, with `fit` tokens and within the TPOT budget, although no prompt is due yet.
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    tpot, margin = 0.0201, 0.1
    budget = tpot * (1 - margin)
    pieces = tuple(PrefillPiece(300, 0, 0) for _ in range(4))
    assert DRAIN_HEADROOM == 2.0
    for name in ("harli", "static:32"):
        policy = make_policy(name, ladder, pred, tpot, margin)
        policy.ttft_s = 0.2
        burst = StepPreview(2, 40, pieces, mixed=True, prefill_waits=(0.1,) * 4)
        fit, period, _ = largest_chunk(pred, burst, ladder.full.infer_sms, False, budget)
        assert 300 < fit < 600 and (2 * 4 + 1) * period > 0.08 > 4 * period  # the case the comment describes
        plan = policy.plan(burst)
        assert plan.reason.startswith("ttft") and plan.paused and plan.partition is ladder.full
        assert plan.prefill_tokens == fit and plan.predicted_s <= budget and not plan.corun
        # The trainer's queued work still runs on the whole GPU: the step is predicted (and sized) co-run.
        policy.trainer_busy = lambda: True
        assert policy.plan(burst).corun
        policy.trainer_busy = lambda: False
        # Two of them just arrived under a 0.5 s objective: in time on the policy's own share.
        fresh = StepPreview(2, 40, pieces[:2], mixed=True, prefill_waits=(0.0, 0.0))
        calls: list[tuple] = []

        def counted(self, *a, _calls=calls, _predict=LatencyPredictor.predict_mixed, **k):
            _calls.append(a)
            return _predict(self, *a, **k)

        monkeypatch.setattr(LatencyPredictor, "predict_mixed", counted)
        policy.ttft_s = 0.5
        assert policy.ttft_plan(fresh) is None
        assert calls == []  # far from every deadline, known from the last step: no bisection
        policy.ttft_s = 0.2
        assert policy.ttft_plan(fresh) is None and calls  # 2 steps fit twice over in 180 ms, but not far
        monkeypatch.undo()


def test_a_drain_that_would_overrun_beside_the_trainers_queue_waits_for_it_while_the_prompts_can():
    # Beside the trainer's queued work (mixed steps measured at 3x their raw prediction co-run) even the
    # least chunk overruns the TPOT budget, which it fits once that work is gone. With time for the drain at
    # that pace and a step to spare, the step decodes alone with no prefill (the trainer launching nothing
    # new) on decode's own SMs; once the trainer's work has left, the prefill goes on within the budget; a
    # prompt    # too close to its deadline for a step more is drained at once, past the budget.
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    full = ladder.full.infer_sms
    margin = 0.1
    for name, own in (("harli", None), ("static:32", 32)):
        pred = mixed_predictor(ladder.shares)
        preview = StepPreview(2, 40, (PrefillPiece(300, 0, 0),), mixed=True, prefill_waits=(0.0,))
        raw = pred.predict_mixed(2, 40, MIN_CHUNK, attention_pairs([(MIN_CHUNK, 0)]), full, True, raw=True)
        for _ in range(64):
            pred.observe(full, True, 3 * raw, raw, mixed=True)
        solo = pred.predict_mixed(2, 40, MIN_CHUNK, attention_pairs([(MIN_CHUNK, 0)]), full, False)
        budget = 1.5 * solo
        assert budget < 3 * raw * 0.99  # co-run, the least chunk overruns it
        policy = make_policy(name, ladder, pred, budget / (1 - margin), margin)
        policy.ttft_s = 1.0
        co_period = largest_chunk(pred, preview, full, True, budget)[1]
        steps = -(-300 // MIN_CHUNK)
        # The drain is due (twice its steps do not fit) and the step more fits: wait.
        wait = 0.9 - (steps + 3) * co_period
        assert (2 * steps + 1) * co_period > 0.9 - wait
        busy = StepPreview(2, 40, preview.pieces, mixed=True, prefill_waits=(wait,))
        policy.trainer_busy = lambda: True
        plan = policy.plan(busy)
        assert plan.paused and plan.prefill_tokens == 0 and "decode alone" in plan.reason
        assert own is None or plan.partition.infer_sms == own
        policy.trainer_busy = lambda: False
        plan = policy.plan(busy)  # the drain's pace, or the policy's own plan where that keeps up
        assert plan.prefill_tokens >= MIN_CHUNK
        assert own is not None or plan.predicted_s <= budget  # (static:32's own SMs fit no chunk in it)
        # No step to spare: the drain goes now, beside the queue, past the budget.
        policy.trainer_busy = lambda: True
        late = StepPreview(2, 40, preview.pieces, mixed=True, prefill_waits=(0.9 - (steps + 1) * co_period,))
        plan = policy.plan(late)
        assert plan.prefill_tokens >= MIN_CHUNK and plan.corun and plan.predicted_s > budget


def test_a_ttft_objective_reaches_a_prompt_due_further_down_the_line_past_the_budget():
    # Two prompts of 400 tokens, both within 10 ms of their deadline: no whole-GPU step ends in time, so the
    # step computes both, past the TPOT budget.
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    policy = make_policy("static:32", ladder, pred, 0.0201, 0.1)
    policy.ttft_s = 0.2
    pieces = (PrefillPiece(400, 0, 0), PrefillPiece(400, 0, 0), PrefillPiece(400, 0, 0))
    preview = StepPreview(2, 40, pieces, mixed=True, prefill_waits=(0.175, 0.17, 0.0))
    plan = policy.plan(preview)
    assert plan.reason.startswith("ttft") and plan.prefill_tokens == 800  # the third prompt can wait
    assert plan.predicted_s > 0.0201 * 0.9


def test_a_preview_says_how_long_its_oldest_pending_prompt_has_waited():
    import torch

    from harli_train.engine import DecodeEngine, EngineConfig
    from harli_train.model import load_model

    clock = [10.0]
    model = load_model("tiny", torch.float32, "cpu")
    cfg = EngineConfig(num_kv_blocks=64, max_model_len=128, kernels="torch", mixed_prefill=True)
    engine = DecodeEngine(model, cfg, clock=lambda: clock[0])
    assert engine.peek().prefill_wait_s is None
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4), arrival_time=9.5)
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=4), arrival_time=9.8)
    assert engine.peek().prefill_wait_s == pytest.approx(0.5)  # the first in line
    assert engine.peek().prefill_waits == pytest.approx((0.5, 0.2))  # and each one's
    engine.step()
    assert engine.peek().prefill_wait_s is None  # both prompts computed: nothing pending


def _seq(i: int, times: list[float], arrival: float = 0.0) -> Sequence:
    seq = Sequence(i, [1, 2, 3], SamplingParams(max_tokens=len(times)), arrival)
    seq.token_ids += [5] * len(times)
    seq.token_times = list(times)
    seq.first_token_time = times[0] if times else None
    seq.finish_time = times[-1] if times else None
    seq.finish_reason = "length"
    return seq


def test_objective_counts_every_interval_and_requests_still_running():
    metrics = EngineMetrics(0.0)
    metrics.add_finished(_seq(0, [0.10, 0.11, 0.12, 0.20]))  # one 80 ms wait (a prefill stalled it)
    metrics.add_finished(_seq(1, [0.10, 0.11, 0.12, 0.13]))
    running = _seq(2, [0.3, 0.302, 0.322])  # cut off at the end: counted with its tokens so far
    stats = objective_stats(metrics, 0.015, [running])
    assert stats["intervals"] == 3 + 3 + 2 and stats["violations"] == 2  # the 80 ms and a 20 ms wait
    assert stats["violation_rate"] == pytest.approx(2 / 8)
    # TPOT (first to last): 33.3 ms (misses), 10 ms, 11 ms: 2 of 3 meet 15 ms.
    assert stats["tpot_attainment"] == pytest.approx(2 / 3) and stats["requests_missing_tpot"] == 1
    assert not stats["clean"] and stats["token_interval_ms"]["max"] == pytest.approx(80)
    # The request that stalled the most is named, with its preemptions (none here).
    worst = stats["longest_wait"]
    assert worst["request_id"] == "0" and worst["max_interval_ms"] == pytest.approx(80)
    assert worst["preemptions"] == 0 == stats["preemptions"] and worst["output_tokens"] == 4
    clean = EngineMetrics(0.0)
    for i in range(3):
        clean.add_finished(_seq(i, [0.1, 0.11, 0.12]))
    assert objective_stats(clean, 0.015)["clean"]


def test_requests_without_a_first_token_count_their_wait_in_ttft_and_a_ttft_objective_judges_clean():
    metrics = EngineMetrics(0.0)
    for i in range(3):  # served at once: TTFT 100 ms each
        metrics.add_finished(_seq(i, [0.1, 0.11, 0.12]))
    starved = Sequence(3, [1, 2, 3], SamplingParams(max_tokens=4), 0.0)  # cut off at 2.0 s, no token
    starved.finish_time, starved.finish_reason = 2.0, "aborted"
    metrics.add_finished(starved)
    queued = Sequence(4, [1, 2, 3], SamplingParams(max_tokens=4), 0.5)  # still waiting at 3.0 s
    stats = objective_stats(metrics, 0.015, [], None, [queued], now=3.0)
    assert stats["requests_without_first_token"] == 2 and stats["ttft_ms"]["count"] == 5
    assert stats["ttft_ms"]["max"] == pytest.approx(2500) and stats["tpot_clean"] and stats["clean"]
    held = objective_stats(metrics, 0.015, [], 1.0, [queued], now=3.0)
    assert held["ttft_attainment"] == pytest.approx(3 / 5) and held["tpot_clean"] and not held["clean"]
    # Without the engine's clock a queued request has no wait to count.
    assert objective_stats(metrics, 0.015, [], 1.0, [queued])["ttft_ms"]["count"] == 4


def test_a_colocated_run_rides_prefill_in_decode_steps(tmp_path):
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    # A short hysteresis: decode starts on the whole GPU and must leave it within the few steps a loaded
    # CPU fits in the window (6 steps, where the default 8 kept the trainer paused throughout).
    make = lambda ladder: make_policy("harli", ladder, mixed_predictor(ladder.shares), 0.05, 0.1, 2)
    # The later prompts arrive while the first two still decode, on a fast host too (400 tokens: the window
    # cuts them on a slow one, and they count with the tokens they drew).
    load = requests([(0.0, 2, 400), (0.4, 3, 8), (0.6, 2, 8)])
    opts = RuntimeOptions(until="load", window_s=1.5, quiet=True, finish=False, plots=False)
    # Short micro-steps (the CPU runs them between engine steps), so the requests are served as they arrive.
    small = ("train.steps=200", "train.batch_size=2", "data.seq_len=32", "colocation.mixed_prefill=true")
    summary = runtime(tmp_path, ladder, make, load, opts, None, None, *small).run()
    steps = rows(tmp_path)
    mixed = [r for r in steps if r["kind"] == "mixed"]
    assert mixed and all(r["batch"] > 0 and r["prefill_tokens"] > 0 for r in mixed)
    decoding = [r for r in steps if r["kind"] in ("decode", "mixed")]
    assert summary["serving"]["decode_steps"] == len(decoding)
    assert summary["serving"]["mixed_steps"] == len(mixed)
    # Prefill steps of their own only while nothing decodes.
    requests_out = [
        json.loads(x) for x in (tmp_path / "colocate/serve/requests.jsonl").read_text().splitlines()
    ]
    served = sum(r["output_tokens"] - 1 for r in requests_out if r["output_tokens"] > 1)
    sv = summary["serving"]
    assert sv["intervals"] == served and sv["tpot_attainment"] is not None
    assert set(sv) >= {"violations", "violation_rate", "tpot_attainment", "clean", "ttft_ms", "tpot_ms"}
    assert sv["tpot_clean"] == sv["clean"]  # no TTFT objective: clean is the TPOT bars alone
    # Every request of the load counts in TTFT, a first token or not (cut off at the window's end).
    assert sv["ttft_ms"]["count"] == len(requests_out)
    assert sv["requests_without_first_token"] == sum(r["output_tokens"] == 0 for r in requests_out)
    # The trainer's SMs over the whole run, plan to plan (what its shares were worth).
    held = summary["trainer_sm_seconds"]
    assert sum(held.values()) == pytest.approx(summary["duration_s"], rel=0.05, abs=0.02)
    assert any(int(sms) > 0 for sms in held)


def test_a_colocated_run_under_a_ttft_objective_reports_it(tmp_path):
    from harli_train.config import RecipeError, load_recipe

    from .runtime_support import QUICKSTART

    ladder = SMLadder.cpu_standin(TOTAL, 8)

    def make(ladder):
        policy = make_policy("harli", ladder, mixed_predictor(ladder.shares), 0.05, 0.1)
        policy.ttft_s = 1e-9  # every pending prompt is due at once
        return policy

    # Prompts arriving while the first requests decode (600 tokens: past the window on any host), spread
    # over the window: the run's first step comes ~0.2 s in on this machine, after set-up, and prompts that
    # are all in by then are computed in one prefill step, never in a mixed one.
    load = requests([(0.0, 2, 600), (0.4, 3, 8), (0.8, 3, 8), (1.2, 3, 8)])
    opts = RuntimeOptions(until="load", window_s=2.0, quiet=True, finish=False, plots=False)
    small = ("train.steps=200", "train.batch_size=2", "data.seq_len=32", "colocation.mixed_prefill=true")
    summary = runtime(tmp_path, ladder, make, load, opts, None, None, *small).run()
    due = [r for r in rows(tmp_path) if r["kind"] == "mixed" and r["reason"].startswith("ttft")]
    assert due and all(r["paused"] and r["infer_sms"] == TOTAL for r in due)
    assert summary["objective"]["ttft_ms"] == pytest.approx(1e-6)
    # harli's default learns its margin: the objective says so, and the policy's detail gives its range
    assert summary["objective"]["margin"] == 0.1 and summary["objective"]["margin_learned"] is True
    learned = summary["policy_detail"]["controller"]["learned_margin"]
    assert learned["start"] == 0.1 and learned["min"] <= learned["now"] <= learned["max"]
    assert summary["serving"]["ttft_attainment"] == 0.0  # no first token comes within a nanosecond
    assert summary["serving"]["objective_ttft_ms"] == pytest.approx(1e-6)
    # The recipe key: a positive number of milliseconds, or none.
    assert load_recipe(QUICKSTART, ["colocation.ttft_ms=250"]).colocation.ttft_ms == 250.0
    assert load_recipe(QUICKSTART, []).colocation.ttft_ms is None
    with pytest.raises(RecipeError):
        load_recipe(QUICKSTART, ["colocation.ttft_ms=-1"])


def test_the_trainer_counts_as_busy_until_its_last_queued_micro_step_has_ended():
    # What harli asks before a mixed step takes the whole GPU: a launch under way, or a queued micro-step
    # whose end event has not been reached (queried at the time of asking).
    from types import SimpleNamespace

    from harli_train.colocate.trainer_worker import TrainerSnapshot, TrainerWorker

    class End:
        done = False

        def query(self):
            return self.done

    end = End()
    idle = TrainerSnapshot(False, 3, 10, 1.0, 0.0, (), None, None, False, 5, 0)
    busy = lambda snap: TrainerWorker.gpu_busy(SimpleNamespace(snapshot=snap))
    assert not busy(idle)
    assert busy(dataclasses.replace(idle, in_round=True))
    assert busy(dataclasses.replace(idle, launching_kind="fwd"))
    queued = dataclasses.replace(idle, queue=("fwd", "bwd"), queue_end=end)
    assert busy(queued)
    end.done = True
    assert not busy(queued)
    # How long its queued work should run still (what harli:handoff=gpu sizes a chunk by): none once the
    # last end event is reached; unknown (infinite) while it may launch more; else the queue's estimated end
    # less now, a quarter micro-step once that estimate has passed.
    left = lambda snap: TrainerWorker.gpu_left_s(SimpleNamespace(snapshot=snap))  # noqa: E731
    assert left(idle) == 0.0 and left(queued) == 0.0
    end.done = False
    assert left(dataclasses.replace(queued, in_round=True)) == float("inf")
    soon = dataclasses.replace(queued, finish_at=time.perf_counter() + 0.5, ewma_s=0.008)
    assert 0.4 < left(soon) <= 0.5
    assert left(dataclasses.replace(soon, finish_at=time.perf_counter() - 1.0)) == pytest.approx(0.002)


def test_harli_backward_on_sizes_a_mixed_step_beside_a_trainer_backward_by_the_steps_seen_beside_one():
    # `harli:backward=on`: mixed steps planned with a trainer backward on the GPU keep a quantile of their own
    # (on the H200 they ran to 1.28x their prediction at the 98th percentile, those beside a forward 0.99x).
    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    pred.alpha = 0.1  # the corrections decay, as in a run
    harli = make_policy("harli:backward=on", ladder, pred, 0.0201, 0.1)
    assert (
        harli.name == "harli:backward=on" and make_policy("harli", ladder, pred, 0.0201, 0.1).name == "harli"
    )
    on_gpu: list[tuple[str, ...]] = [("bwd",)]
    harli.trainer_on_gpu = lambda: on_gpu[0]
    preview = StepPreview(2, 40, (PrefillPiece(2000, 0, 0),), mixed=True)
    before = harli.plan(preview)
    assert before.beside_backward and not before.paused
    # Eight steps beside a backward ran 1.3x their raw prediction, then 64 beside a forward 0.9x: only the
    # backward's quantile remembers the slow ones.
    for _ in range(8):
        harli.observe(before, before.mixed_raw_s * 1.3)
    assert len(pred._mixed_q[2]) == 8
    on_gpu[0] = ("fwd",)
    plain = harli.plan(preview)
    assert not plain.beside_backward
    for _ in range(64):
        harli.observe(plain, plain.mixed_raw_s * 0.9)
    assert len(pred._mixed_q[2]) == 8  # a step beside a forward feeds only the co-run quantile
    sms = before.partition.infer_sms
    slow = pred.correction(sms, True, mixed=True, beside_backward=True)
    assert slow >= 1.3 > pred.correction(sms, True, mixed=True) + 0.1
    beside_fwd = harli.plan(preview)
    on_gpu[0] = ("fwd", "bwd")
    beside_bwd = harli.plan(preview)
    assert beside_bwd.beside_backward and beside_bwd.predicted_s <= harli.budget_s
    # The slow quantile buys a smaller chunk, or a larger share for the same chunk.
    assert (beside_bwd.prefill_tokens, -beside_bwd.partition.infer_sms) < (
        beside_fwd.prefill_tokens,
        -beside_fwd.partition.infer_sms,
    )
    # Off (the default), the backward on the GPU changes nothing.
    off = make_policy("harli", ladder, pred, 0.0201, 0.1)
    off.trainer_on_gpu = lambda: ("bwd",)
    assert not off.plan(preview).beside_backward


def test_no_mixed_step_takes_more_prefill_than_the_largest_graph_bucket_holds():
    """With the engine's mixed graphs (buckets up to 128 tokens here), neither a chunk sized to the budget
    nor a TTFT drain past it takes more prefill tokens than fit the largest bucket beside the decode rows:
    such a step would run eagerly, slower than the graph's step and the next one together."""
    from dataclasses import replace

    from harli_train.colocate.policy.base import graph_room

    ladder = SMLadder.cpu_standin(TOTAL, 16)
    pred = mixed_predictor(ladder.shares)
    pieces = (PrefillPiece(400, 0, 0), PrefillPiece(400, 0, 0))
    due = StepPreview(2, 40, pieces, mixed=True, prefill_waits=(0.175, 0.17))
    loose = StepPreview(2, 40, pieces, mixed=True)
    policy = make_policy("static:32", ladder, pred, 0.0201, 0.1)
    policy.ttft_s = 0.2
    assert graph_room(pred, due) == 800 and policy.plan(due).prefill_tokens == 800  # no graphs: unbounded
    fits, _, _ = largest_chunk(pred, loose, TOTAL, False, 1.0)
    assert fits == 800
    pred.mixed = replace(pred.mixed, buckets=(16, 32, 64, 128))
    assert graph_room(pred, due) == 126
    plan = policy.plan(due)
    assert plan.reason.startswith("ttft") and plan.prefill_tokens == 126
    assert largest_chunk(pred, loose, TOTAL, False, 1.0)[0] == 126
