"""The co-located runtime on the CPU stand-ins: policies, shares and streams, pause and resume, outputs, and
the training result of a co-located run equal to a standalone run (co-location changes when, never what)."""

import contextlib
import dataclasses
import gc
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import types
from collections import deque
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from harli_train import kernels
from harli_train.cli import main
from harli_train.colocate import report
from harli_train.colocate.assembly import assemble, build_engine
from harli_train.colocate.commands import out_of_memory_message, run_colocated
from harli_train.colocate.gc_pauses import GcPauses
from harli_train.colocate.policy import (
    BESIDE,
    HarliPolicy,
    Policy,
    StaticPolicy,
    StepPlan,
    StreamsPolicy,
    TemporalPolicy,
    make_policy,
)
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.predictor_setup import check_objective
from harli_train.colocate.runtime import ColocatedRuntime
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.shared_model import base_view, shares_weights
from harli_train.colocate.sm import SMLadder, TimeSliceLadder
from harli_train.config import RecipeError, load_recipe
from harli_train.data.tokenizer import load_tokenizer
from harli_train.engine.launched_step import LaunchedStep
from harli_train.engine.load import TraceRequest
from harli_train.engine.scheduler import PrefillPiece, StepPreview
from harli_train.kernels import launch_config
from harli_train.model import load_model
from harli_train.train.divergence import TrainingDiverged
from harli_train.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
SMALL = [
    "train.steps=6",
    "train.batch_size=2",
    "data.seq_len=32",
    "train.layers_per_microstep=2",
    "train.warmup_steps=1",
    "train.log_every=100",
    "output.checkpoint_every=0",
]
LOAD = [
    "colocation.rate=20",
    "colocation.duration_s=1.0",
    "colocation.prompt_len=16",
    "colocation.output_len=8",
    "colocation.max_batch=8",
    "colocation.tpot_ms=50",
]


def preview(
    kind: str, batch: int = 0, kv_tokens: int = 0, after: tuple[int, int] | None = None
) -> StepPreview:
    """A StepPreview of a decode step (``batch`` rows over ``kv_tokens``), or of a pure prefill step whose
    prompts make the decode step after it ``after`` = (sequences, KV tokens)."""
    if kind == "decode":
        return StepPreview(batch, kv_tokens)
    b, kv = after or (1, kv_tokens or 2)
    sizes = [kv // b - 1] * b
    sizes[0] += kv - sum(n + 1 for n in sizes)
    return StepPreview(0, 0, tuple(PrefillPiece(n, 0, 0) for n in sizes))


TOTAL = 132


pytestmark = pytest.mark.usefixtures("one_thread")


def recipe(out: Path, *extra: str):
    return load_recipe(QUICKSTART, [*SMALL, *LOAD, f"output.dir={out}", *extra])


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("standalone")
    trainer = Trainer(recipe(out), quiet=True)
    trainer.setup()
    trainer.train()
    return out


def synthetic_predictor(shares, per_seq_s=2e-3):
    """1 ms * (1 + 64/s) + per_seq_s per sequence alone, +25 % beside the trainer; no online correction."""
    params = {s: [1e-3 * (1 + 64 / s), 0.0, 0.25] for s in shares}
    pred = LatencyPredictor(TOTAL, 1.0, list(shares), params, [0.0, 0.0, 0.0, per_seq_s], [0.0, 0.0], 256)
    pred.alpha = 0.0  # measured CPU latencies must not move these test predictions
    return pred


def requests(spec):
    """[(arrival_s, count, output_len)] -> trace requests of 16-token prompts."""
    out = []
    for arrival, count, output_len in spec:
        out += [
            TraceRequest(arrival, output_len, prompt_len=16, request_id=str(len(out) + i))
            for i in range(count)
        ]
    return out


def runtime(out: Path, ladder, make_policy_fn, load, options: RuntimeOptions, spy=None, hook=None, *extra):
    """A runtime over the tiny model with shared weights, the given ladder, policy and load."""
    cfg = recipe(out, *extra)
    trainer = Trainer(cfg, model=load_model("tiny", torch.float32, "cpu"), quiet=True)
    trainer.setup()
    if spy is not None:
        original = trainer.micro_steps
        trainer.micro_steps = lambda: spy(trainer, original())
    engine = build_engine(
        base_view(trainer.model),
        load_tokenizer("tiny", True),
        ladder,
        load,
        16,
        mixed_prefill=cfg.colocation.mixed_prefill,
    )
    return ColocatedRuntime(trainer, engine, make_policy_fn(ladder), load, out / "colocate", options, hook)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "colocate" / "steps.jsonl").read_text().splitlines()]


# ---- policies ----------------------------------------------------------------------------------------


def test_make_policy_names_and_shapes():
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    pred = synthetic_predictor(ladder.shares)
    static = make_policy("static:50", ladder, None, 0.05)
    assert isinstance(static, StaticPolicy) and static.part.infer_sms == 56 and static.name == "static:56"
    assert static.plan(preview("decode", 4, 100)).train_stream is static.part.train_stream
    streams = make_policy("streams", ladder, None, 0.05)
    plan = streams.plan(preview("decode", 4, 100))
    assert isinstance(streams, StreamsPolicy) and plan.partition.infer_sms == plan.train_sms == TOTAL
    assert plan.partition.infer_stream is not plan.train_stream and not plan.isolated
    temporal = make_policy("temporal", ladder, pred, 0.05)
    assert isinstance(temporal, TemporalPolicy)
    (part,) = temporal.partitions()
    assert part.time_sliced and part.infer_stream is ladder.full.infer_stream
    harli = make_policy("harli", ladder, pred, 0.05)
    assert isinstance(harli, HarliPolicy) and harli.prefill.mode == "rung" and harli.name == "harli"
    assert make_policy("harli:prefill=beside", ladder, pred, 0.05).name == "harli:prefill=beside"
    assert make_policy("harli:prefill=paused", ladder, pred, 0.05).prefill.mode == "paused"
    variant = make_policy("harli:prefill=rung", ladder, pred, 0.05)
    assert variant.name == "harli"
    # Decode starts on the whole GPU: a prefill then keeps the trainer paused; once decode has shrunk to a
    # share, prefills run on about half the GPU (the default rung: the least of the trainer's rungs that leaves
    # decode half), the trainer on the rest.
    first = variant.plan(preview("prefill", 1, 10))
    assert first.paused and first.partition.infer_sms == TOTAL
    while variant.plan(preview("decode", 1, 10)).partition.infer_sms == TOTAL:
        pass
    later = variant.plan(preview("prefill", 1, 10))
    assert later.partition is variant.prefill.rung and not later.paused
    assert later.partition.infer_sms == 72 and later.train_stream is later.partition.train_stream  # >= 66
    with pytest.raises(ValueError, match="unknown harli option"):
        make_policy("harli:prefill=sometimes", ladder, pred, 0.05)
    both = make_policy("harli:grow=0.1,prefill=paused", ladder, pred, 0.05)
    assert both.name == "harli:prefill=paused,grow=0.1" and (both.prefill.mode, both.grow_headroom) == (
        "paused",
        0.1,
    )
    assert make_policy("harli:backward=on,stride=3", ladder, pred, 0.05).name == "harli:stride=3,backward=on"
    assert make_policy("harli:backward=off", ladder, pred, 0.05).name == "harli"
    for bad in ("harli:grow=0.5", "harli:grow=x", "harli:speed=2", "harli:backward=yes"):
        with pytest.raises(ValueError, match="unknown harli option"):
            make_policy(bad, ladder, pred, 0.05)
    # The streams each policy's trainer launches on (the ones warmed up before serving).
    for name in ("harli", "static:56", "streams", "temporal", "exclusive"):
        places = make_policy(name, ladder, pred, 0.05).trainer_partitions()
        assert places and all(p.train_stream is not None for p in places), name
    assert make_policy("temporal", ladder, pred, 0.05).trainer_partitions()[0].time_sliced
    assert make_policy("harli", ladder, pred, 0.05).trainer_partitions()[-1] is ladder.full
    assert make_policy("exclusive", ladder, None, 0.05).serve_alone
    with pytest.raises(ValueError, match="green contexts"):
        make_policy("static:48", TimeSliceLadder.cpu_standin(TOTAL), None, 0.05)
    with pytest.raises(ValueError, match="no SMs"):
        make_policy("static:132", ladder, None, 0.05)
    alone = make_policy("exclusive:50", ladder, None, 0.05)  # the trainer alone on static:56's trainer SMs
    assert alone.name == "exclusive:56" and alone.serve_alone and alone.partitions() == [ladder.full]
    assert alone.trainer_partitions() == [ladder.select(56)] and alone.idle_plan().train_sms == TOTAL - 56
    with pytest.raises(ValueError, match="green contexts"):
        make_policy("exclusive:48", TimeSliceLadder.cpu_standin(TOTAL), None, 0.05)
    with pytest.raises(ValueError, match="predictor"):
        make_policy("harli", ladder, None, 0.05)


# ---- the main job: outputs, shared weights, equality --------------------------------------------------


@pytest.mark.parametrize(("step", "shares", "static"), [(None, [16, 32, 48], 48), (8, [8, 16, 24], 40)])
def test_the_recipe_sets_the_ladder_step(tmp_path, step, shares, static):
    extra = ["colocation.policy=static:40"] + ([f"colocation.ladder_step={step}"] if step else [])
    col = assemble(recipe(tmp_path, *extra), "tiny")
    try:  # static:40 takes the least rung with at least 40 SMs
        assert col.ladder.shares[:3] == shares and col.policy.name == f"static:{static}"
    finally:
        col.close()


def test_colocated_run_writes_outputs_and_equals_standalone(tmp_path, standalone):
    cfg = recipe(tmp_path)
    summary = run_colocated(cfg, "tiny", policy="harli", quiet=True)
    col = tmp_path / "colocate"
    for name in ("steps.jsonl", "summary.json", "timeline.png", "throughput.png", "serve/requests.jsonl"):
        assert (col / name).is_file(), name
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "checkpoints" / "step_000006" / "trainer_state.json").is_file()
    assert summary["shared_weights"] and summary["stop_reason"] == "trained" and not summary["interrupted"]
    assert summary["finetune"]["steps_run"] == 6 and summary["serving"]["decode_steps"] > 0
    assert summary["serving"]["requests"] > 0 and summary["serving"]["tpot_ms"]["p50"] is not None
    assert sum(summary["share_histogram"].values()) == summary["serving"]["decode_steps"]
    assert json.loads((col / "summary.json").read_text())["policy"] == "harli"
    assert summary["gc_pauses"]["max_ms"] >= 0 and gc.get_freeze_count() == 0  # unfrozen after the run
    assert summary["gc_pauses"]["scheduled"] and gc.isenabled()  # the decode thread's while serving only
    step_rows = rows(tmp_path)
    last_decode = [r for r in step_rows if r["kind"] in ("decode", "mixed")][-1]
    assert {
        "batch",
        "kv_tokens",
        "infer_sms",
        "predicted_s",
        "measured_s",
        "micro_steps",
    } <= last_decode.keys()
    # Co-location changes when the trainer's work runs, never what it computes.
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


@pytest.mark.parametrize("policy", ["harli", "static:40", "streams"])
def test_an_objective_no_decode_step_can_meet_is_refused_up_front(tmp_path, policy):
    # colocation.tpot_ms=0.0001 once ran with every decode step violated and "trainer paused 100 %". The
    # profile (harli) or a few timed steps (policies without a predictor) show it impossible before serving.
    cfg = recipe(tmp_path, f"colocation.policy={policy}", "colocation.tpot_ms=0.0001")
    with pytest.raises(RecipeError) as info:
        assemble(cfg, "tiny", warm_up=False)
    message = str(info.value)
    assert message.startswith(
        f"{QUICKSTART}: colocation.tpot_ms: expected an objective a decode step can meet"
    )
    share = 48 if policy == "static:40" else TOTAL
    assert f"(batch 1, decode on {share} of {TOTAL} SMs, the trainer paused) takes" in message
    assert message.endswith(", got 0.0001")
    fastest_ms = float(message.split(" takes ")[1].split(" ms ")[0])
    assert 0.0001 < fastest_ms < 1000  # a CPU decode step of the tiny model: fractions of a ms to tens of ms


def test_a_profile_slowed_by_a_busy_host_does_not_refuse_a_reachable_objective(tmp_path):
    # A CPU profile's few steps can run 50x slow on a loaded host: before refusing, steps are timed again.
    cfg = recipe(tmp_path)  # colocation.tpot_ms=50
    col = assemble(cfg, "tiny", warm_up=False)
    try:
        slow = synthetic_predictor(col.ladder.shares, per_seq_s=1.0)  # over a second for any step
        assert slow.predict(1, 1, TOTAL, corun=False, raw=True) > 1.0
        check_objective(cfg, col.policy, col.engine, slow)  # timed now: a few ms, so accepted
        cfg.colocation.tpot_ms = 1e-4
        with pytest.raises(RecipeError, match=r"takes [0-9.]+ ms measured now, got 0.0001$"):
            check_objective(cfg, col.policy, col.engine, slow)
    finally:
        col.close()


def test_the_cli_refuses_an_impossible_objective_with_exit_2(tmp_path):
    args = [str(QUICKSTART), "--colocate-with", "tiny", *SMALL, *LOAD, "colocation.tpot_ms=0.0001"]
    result = CliRunner().invoke(main, [*args, f"output.dir={tmp_path}", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "colocation.tpot_ms: expected an objective a decode step can meet" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "colocate").exists()


@pytest.mark.parametrize("threaded", [False, True])
def test_a_diverged_colocated_run_stops_without_saving(tmp_path, threaded, caplog):
    # The trainer diverges at step 2 (lr 1e30); co-located, from the decode loop or the trainer thread, the
    # run stops with TrainingDiverged and keeps step 1's checkpoint, no adapter written.
    cfg = recipe(tmp_path, "train.lr=1e30", "train.warmup_steps=0", "output.checkpoint_every=1")
    with pytest.raises(TrainingDiverged) as info:
        run_colocated(cfg, "tiny", options=RuntimeOptions(quiet=True, trainer_thread=threaded))
    assert info.value.step == 2 and info.value.what == "loss"
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # the CLI prints the one line
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]
    assert not (tmp_path / "adapter").exists()


def test_a_load_request_past_the_context_is_refused_and_the_run_goes_on(tmp_path):
    # A 100000-token trace line once sized the co-located tiny engine past the machine's memory (killed at
    # 24 GB). The engine is capped at tiny's 2048-token context; that request alone is refused and recorded.
    trace = tmp_path / "trace.jsonl"
    lines = [{"arrival_s": 0.01 * i, "prompt_len": 16, "output_len": 6} for i in range(4)]
    lines.insert(2, {"arrival_s": 0.015, "prompt_len": 100000, "output_len": 8, "id": "huge"})
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_colocated(recipe(tmp_path / "run", f"colocation.trace={trace}"), "tiny", quiet=True)
    assert summary["stop_reason"] == "trained" and summary["trainer"]["steps"] == 6
    assert summary["serving"]["refused"] == 1 and summary["serving"]["requests"] == 4
    served = tmp_path / "run" / "colocate" / "serve" / "requests.jsonl"
    refused = [r for r in map(json.loads, served.open()) if r["finish_reason"] == "refused"]
    assert [r["request_id"] for r in refused] == ["huge"]
    assert "100008 exceeds the model's context of 2048 tokens" in refused[0]["error"]


def test_live_and_final_tpot_are_one_statistic_over_the_same_requests(tmp_path, capsys, caplog):
    # The live line once showed p99 436 ms (token intervals, last 512) where the summary said 102 ms (per
    # request TPOT, all requests). Both are now accounting.objective_stats over every request so far (those
    # still running with their tokens so far), so the last live line and the run's last line agree.
    opts = RuntimeOptions(progress_every_s=0.0)  # a progress line on every pass of the loop
    with caplog.at_level(logging.INFO):
        summary = run_colocated(recipe(tmp_path), "tiny", options=opts)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[harli] train")]
    assert len(lines) > 10
    counts = [int(line.split("TPOT p50/p99 over ")[1].split(" ")[0]) for line in lines]
    # The figure moved during the run (how many distinct values it passes through depends on the machine's speed).
    assert counts == sorted(counts) and counts[0] < counts[-1]
    final = report.objective_text(summary["objective_stats"])
    assert final in lines[-1] and final in caplog.text
    served = [json.loads(line) for line in (tmp_path / "colocate" / "serve" / "requests.jsonl").open()]
    judged = [r for r in served if r["output_tokens"] >= 2 and r["finish_reason"] != "refused"]
    assert final.startswith(f"TPOT p50/p99 over {len(judged)} requests so far ")


def test_base_view_shares_weights_without_the_adapter():
    model = load_model("tiny", torch.float32, "cpu")
    model.add_lora(4, 8.0, 0.0, seed=1)
    with torch.no_grad():
        for p in model.lora_parameters():
            p.normal_(0, 0.1)
    view = base_view(model)
    assert shares_weights(model, view)
    assert not any(m.has_lora for m in view.lora_modules().values())
    ids = torch.randint(0, 256, (1, 12))
    fresh = load_model("tiny", torch.float32, "cpu")
    torch.testing.assert_close(view(ids), fresh(ids), rtol=0, atol=0)
    assert not torch.allclose(model(ids), fresh(ids))


# ---- shares, streams, pause and resume -----------------------------------------------------------------


def test_the_trainer_side_queues_at_most_max_in_flight_micro_steps_on_the_gpu(tmp_path):
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    make = lambda ladder: make_policy("static:64", ladder, None, 0.05)
    rt = runtime(tmp_path, ladder, make, requests([(0.0, 1, 4)]), RuntimeOptions(quiet=True, plots=False))
    feeder, plan = rt.worker.side, rt.policy.plan(preview("decode", 1, 10))
    assert plan.train == "beside" and feeder.max_in_flight == 2
    may = lambda: feeder._may_launch(plan, False, 1.0, 1e-3, 0, "fwd")  # the GPU path, budget to spare
    assert may()
    feeder.in_flight.extend([(None, None, "fwd")] * 2)
    assert not may()  # a full queue waits, whatever the time budget says
    feeder.in_flight.pop()
    assert may()
    feeder.in_flight.clear()
    # The runtime hands its option down, and refuses a cap that would stop the trainer for good.
    opts = RuntimeOptions(quiet=True, plots=False, max_in_flight=3)
    assert runtime(tmp_path / "three", ladder, make, [], opts).worker.side.max_in_flight == 3
    with pytest.raises(ValueError, match="max_in_flight"):
        RuntimeOptions(max_in_flight=0)


def test_temporal_keeps_one_micro_step_queued_while_idle(tmp_path):
    # Temporal's decode shares the trainer's stream: a request arriving while idle waits for what is queued,
    # so the idle plan caps the queue at one micro-step; its decode steps keep the runtime's cap.
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    make = lambda ladder: make_policy("temporal", ladder, synthetic_predictor(ladder.shares), 0.05)  # noqa: E731
    rt = runtime(tmp_path, ladder, make, requests([(0.0, 1, 4)]), RuntimeOptions(quiet=True, plots=False))
    feeder, idle = rt.worker.side, rt.policy.idle_plan()
    assert idle.max_queued == 1 and feeder.max_in_flight == 2
    may = lambda plan: feeder._may_launch(plan, False, 1.0, 1e-3, 0, "fwd")  # noqa: E731
    assert may(idle)
    feeder.in_flight.append((None, None, "fwd"))
    assert not may(idle)
    beside_plan = make_policy("static:64", ladder, None, 0.05).plan(preview("decode", 1, 10))
    assert beside_plan.max_queued == 0 and may(beside_plan)  # other plans: the runtime's cap of two
    feeder.in_flight.clear()


def test_a_time_sliced_step_never_lets_a_micro_step_overrun_its_slack(tmp_path):
    # Temporal's decode steps give the trainer the slack after the step on the same stream: a micro-step
    # that does not fit would hold the next decode step past the objective, however long the trainer has
    # waited and however few samples its estimate rests on. Between requests (no objective at stake) the
    # first micro-step always goes.
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    make = lambda ladder: make_policy("temporal", ladder, synthetic_predictor(ladder.shares), 0.05)  # noqa: E731
    rt = runtime(tmp_path, ladder, make, requests([(0.0, 1, 4)]), RuntimeOptions(quiet=True, plots=False))
    feeder, policy = rt.worker.side, rt.policy
    for _ in range(20):  # past the hysteresis that starts it paused
        plan = policy.plan(preview("decode", 1, 10))
    assert plan.train == "after" and plan.strict
    feeder._kind_s.clear()
    # Before any micro-step has been timed nothing is known to fit: the first micro-step waits for a step
    # with no objective at stake (on the H200 a fresh trainer's first micro-step, estimated at 0, held the
    # next step 78 ms).
    assert not feeder._may_launch(plan, False, 0.005, feeder.expected_s("next"), 0, "next")
    assert feeder._may_launch(policy.idle_plan(), False, 0.005, feeder.expected_s("next"), 0, "next")
    feeder._kind_s["fwd"] = deque([0.020])  # one slow sample
    feeder._kind_s["optim"] = deque([0.001, 0.001, 0.001])
    # A kind never timed (the step boundary's) is estimated at the largest median, not the mean.
    assert feeder.expected_s("next") == 0.020
    for _ in range(50):
        assert not feeder._may_launch(plan, False, 0.005, feeder.expected_s("fwd"), 0, "fwd")
        assert not feeder._may_launch(plan, False, 0.005, feeder.expected_s("next"), 0, "next")
    assert feeder._may_launch(plan, False, 0.005, feeder.expected_s("optim"), 0, "optim")
    loose = dataclasses.replace(plan, strict=False)
    assert feeder._may_launch(loose, False, 0.005, 0.020, 0, "fwd")  # nothing launched yet: one goes
    assert not feeder._may_launch(loose, False, 0.005, 0.020, 1, "fwd")


def test_harli_trainer_launches_on_every_rung_or_every_nth_clear_of_decode():
    # By default the trainer may launch on every partial rung; `stride=N` keeps every N-th, counted from the
    # one with the fewest trainer SMs. Either way it never runs on decode's SMs.
    ladder = SMLadder.cpu_standin(
        132, 16
    )  # decode 16, 32, ... 128 SMs (the H200's green ladder stops at 112)
    assert HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1).trainer_rungs == ladder.spatial
    policy = HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1, trainer_stride=2)
    assert [p.train_sms for p in policy.trainer_rungs] == [100, 68, 36, 4]  # the last rung always
    for decode in ladder.shares:
        rung = policy.rungs.select(decode)
        assert rung in policy.trainer_rungs or rung is ladder.full
        assert rung.train_sms <= 132 - decode  # disjoint from decode's SMs
        assert 132 - decode - rung.train_sms < 2 * 16  # gives up less than one stride of SMs
    assert policy.rungs.select(16).train_sms == 100 and policy.rungs.select(129) is ladder.full
    with pytest.raises(ValueError, match="trainer_stride"):
        HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1, trainer_stride=0)


def test_harli_launches_on_no_more_trainer_streams_than_the_memory_holds(monkeypatch):
    # Each trainer stream caches its own working set: prepare measures one (a rung's, after the whole GPU's)
    # and has harli keep as many rungs as the memory left beside the KV cache the load wants holds: those
    # beside the decode shares the objective calls for most (by the predictor), and the last rung.
    from harli_train.colocate import colocation as colocation_mod
    from harli_train.colocate.colocation import Colocation

    ladder = SMLadder.cpu_standin(132, 16)
    policy = HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1)
    weights = policy.share_weights()
    # 20 ms at 10 % margin: one sequence fits on 16 SMs; the more sequences, the more SMs (the predictor's
    # profiled batches run to 256, at 256, 1024 and 4096 cached tokens a sequence).
    assert weights[16] > weights[32] > weights[48] > weights.get(96, 0.0) == 0.0
    assert len(policy.trainer_rungs) == 8
    assert policy.limit_trainer_streams(8) is False  # they fit: nothing dropped
    assert policy.limit_trainer_streams(3) is True
    assert [p.infer_sms for p in policy.trainer_rungs] == [16, 32, 128]  # the two heaviest, the last kept
    assert policy.limit_trainer_streams(0) is True and [p.train_sms for p in policy.trainer_rungs] == [4]
    slow = synthetic_predictor(ladder.shares)  # decode on fewer than 64 SMs misses the objective
    slow.share_params.update({s: [0.03, 0.0, 0.25] for s in ladder.shares if s < 64})
    slow.__post_init__()
    tight = HarliPolicy(ladder, slow, 0.02, 0.1)
    assert max(tight.share_weights().items(), key=lambda kv: kv[1])[0] == 64
    tight.limit_trainer_streams(3)  # the rungs follow the shares decode needs
    assert [p.infer_sms for p in tight.trainer_rungs] == [64, 80, 128]
    spread = HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1)
    assert spread.rungs.limit(3) is True  # no weights: evenly spread
    assert [p.train_sms for p in spread.trainer_rungs] == [100, 52, 4]  # every third, the last one kept
    assert StaticPolicy(ladder, 64, 0.02, 0.1).limit_trainer_streams(1) is False  # one stream already

    class Hook:
        """The pool's trainer tenant: the first stream warmed maps 17 GiB every stream shares (stashes,
        optimizer state) plus its own 4 GiB cache, each later stream 4 GiB; a step holds 2 GiB more; the room
        left beside the KV cache is ``free`` less what the trainer holds."""

        def __init__(self, free_gib):
            self.held, self.free = 0, free_gib * 2**30

        def trainer_bytes(self):
            return self.held

        def trainer_peak_bytes(self):
            return self.held + 2 * 2**30 if self.held else 0

        def trainer_room_bytes(self):
            return self.free - self.held

    def colocation(hook, warmed):
        def warm(trainer, partitions, total_sms, release=True, scope=None):
            for _ in partitions:
                hook.held += (4 if hook.held else 21) * 2**30
            warmed.append(partitions)
            return set()

        monkeypatch.setattr(colocation_mod, "warm_up_trainer", warm)
        col = Colocation.__new__(Colocation)
        col.ladder, col.memory, col._stream_bytes = ladder, hook, None
        col.trainer = types.SimpleNamespace(step_graphs=None)  # eager: warm-ups keep their caches
        col._step_extra_bytes = 0
        return col

    # Roomy: the second stream is the one measured (4 GiB, not the first's 21), so every rung fits.
    hook, warmed = Hook(90), []
    col = colocation(hook, warmed)
    fresh = HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1)
    col._fit_trainer_streams(fresh, contextlib.nullcontext)
    assert warmed == [[ladder.full], [fresh.trainer_rungs[-1]]]  # the rung every limit keeps
    assert col._stream_bytes == 4 * 2**30 and col._step_extra_bytes == 2 * 2**30
    assert len(fresh.trainer_rungs) == 8
    # Tight: 36 GiB leave 11 after the two streams, 9 past a step's extra: two more streams, three rungs.
    hook, warmed = Hook(36), []
    col = colocation(hook, warmed)
    fresh = HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1)
    col._fit_trainer_streams(fresh, contextlib.nullcontext)
    assert len(fresh.trainer_rungs) == 3 and len(warmed) == 2
    assert (
        warmed[1][0] in fresh.trainer_rungs
    )  # the stream measured (and warm) is one the trainer launches on
    again = HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1)
    col._fit_trainer_streams(again, contextlib.nullcontext)  # measured once: the next policy fits the same
    assert len(warmed) == 2 and len(again.trainer_rungs) == 2  # the room now left: 9 // 4


@pytest.mark.parametrize("fused", [False, True], ids=["torch-step", "adapter-update"])
def test_warming_a_steps_end_leaves_the_gradients_and_the_optimizer_state_as_they_were(
    tmp_path, fused, monkeypatch
):
    # The clip and the AdamW update of a step's end, run on scratch tensors, load the kernels that end a step
    # on the stream current; the trainer's gradients, moments and step counts are untouched. The fused path
    # (`AdapterUpdate`, a GPU trainer's) warms over one scratch element per adapter tensor: the stack of the
    # per-tensor norms and the norm over them pick their kernels by the count.
    from harli_train.colocate.colocation import warm_step_end
    from harli_train.train.adapter_update import AdapterUpdate

    trainer = Trainer(recipe(tmp_path / "run"), model=load_model("tiny", torch.float32, "cpu"), quiet=True)
    trainer.setup()
    trainer.optimizer.param_groups[0]["fused"] = fused  # the scratch optimizer follows the trainer's
    counts = []
    update = AdapterUpdate.__call__
    monkeypatch.setattr(
        AdapterUpdate,
        "__call__",
        lambda self, *a, **k: (counts.append(len(self.params)), update(self, *a, **k))[1],
    )
    gen = torch.Generator().manual_seed(0)
    for p in trainer.params:
        p.grad = torch.randn(p.shape, generator=gen)
    grads = [p.grad.clone() for p in trainer.params]
    state = {id(p): {k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.params}
    values = [p.detach().clone() for p in trainer.params]
    warm_step_end(trainer)
    for p, g, v in zip(trainer.params, grads, values, strict=True):
        assert torch.equal(p.grad, g) and torch.equal(p.detach(), v)
        for k, t in trainer.optimizer.state[p].items():
            assert torch.equal(t, state[id(p)][k]), k
    assert counts == ([len(trainer.params)] if fused else [])
    trainer.metrics.close()


def test_the_kv_cache_the_load_wants_is_kept_clear_of_the_trainers_streams():
    # The reserve: the batch limit of the load's mean request (the recipe's lengths without a load, as with
    # HTTP clients alone); the trainer's room is the free pages less the groups that reserve still needs.
    from types import SimpleNamespace

    from harli_train.colocate.assembly import kv_reserve_blocks
    from harli_train.colocate.pool_memory import PoolMemory

    col = SimpleNamespace(max_batch=4, prompt_len=100, output_len=28)
    assert kv_reserve_blocks([], col, 16) == 32  # 4 x 128 tokens
    load = [TraceRequest(0.0, prompt_len=40, output_len=24), TraceRequest(0.1, prompt_len=8, output_len=24)]
    assert kv_reserve_blocks(load, col, 16) == 12  # 4 x 48 tokens
    kv = SimpleNamespace(max_blocks=640, blocks_per_page=64, pages_per_group=8, num_blocks=64)
    mem = SimpleNamespace(kv=kv, pool=SimpleNamespace(free_pages=100, page_bytes=1), kv_reserve_blocks=None)
    assert PoolMemory.trainer_room_bytes(mem) == 100 - 9 * 8  # the whole cache: 9 more groups
    mem.kv_reserve_blocks = 200
    assert PoolMemory.trainer_room_bytes(mem) == 100 - 3 * 8  # 4 groups wanted, 1 mapped
    mem.kv_reserve_blocks = 10
    assert PoolMemory.trainer_room_bytes(mem) == 100  # what is mapped holds it


def test_a_served_engine_takes_requests_as_long_as_the_models_context():
    # HTTP clients send prompts of any length: with --serve the engine is sized for the model's context,
    # not for the recipe's synthetic load (which may be none).
    model = load_model("tiny", torch.float32, "cpu")
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    short = [TraceRequest(0.0, prompt_len=8, output_len=8)]
    tok = load_tokenizer("tiny", True)
    assert build_engine(model, tok, ladder, short, 4).max_model_len == 256  # the floor
    served = build_engine(model, tok, ladder, short, 4, whole_context=True)
    assert served.max_model_len == model.config.max_position_embeddings > 256


def test_grow_headroom_moves_the_trainer_off_the_next_share_while_decode_is_near_its_budget():
    # harli:grow=H (default 0.05): while decode's predicted step is within H of the budget, the trainer's next micro-steps go
    # to a rung clear of the share decode would grow to; the trailing window keeps decode's real shares only.
    ladder = SMLadder.cpu_standin(132, 16)
    pred = synthetic_predictor(ladder.shares)

    tpot = 0.03

    def settle(policy, batch, kv=100):
        """Plan decode steps of `batch` until the controller has left the whole GPU; the last plan (None if it
        never does: no share fits with the margin to resume the trainer)."""
        for _ in range(20):
            plan = policy.plan(preview("decode", batch, kv))
            if plan.partition.infer_sms < 132:
                return plan
        return None

    near = None
    for batch in range(1, 40):  # a batch whose least share is predicted within 5 % of the budget
        plain = HarliPolicy(ladder, pred, tpot, 0.1, hysteresis_steps=1, grow_headroom=0.0)
        plan = settle(plain, batch)
        if plan is None:
            continue
        budget = plain.controller.budget_s
        larger = [p.infer_sms for p in ladder.spatial if p.infer_sms > plan.partition.infer_sms]
        if plan.predicted_s > 0.95 * budget and larger and plan.train_from_sm < larger[0] <= 112:
            near = batch, plan, larger[0]
            break
    assert near, "no batch put decode near its budget with the trainer next to it"
    batch, plain_plan, next_share = near
    policy = make_policy("harli", ladder, pred, tpot, 0.1, hysteresis_steps=1)  # grow=0.05 is harli's default
    assert policy.name == "harli" and policy.grow_headroom == 0.05
    off = make_policy("harli:grow=0", ladder, pred, tpot, 0.1, hysteresis_steps=1)
    assert off.name == "harli:grow=0" and off.grow_headroom == 0.0
    assert settle(off, batch).train_from_sm == plain_plan.train_from_sm
    plan = settle(policy, batch)
    assert plan.partition.infer_sms == plain_plan.partition.infer_sms  # decode's own share is unchanged
    assert plan.train_from_sm >= next_share and plan.train_sms < plain_plan.train_sms  # the trainer moved
    assert all(
        sms == plan.partition.infer_sms for _, sms in policy.rungs.recent
    )  # the window saw decode's shares
    # Far from the budget (a small batch) the trainer goes back next to decode's recent peak share.
    relaxed = policy.plan(preview("decode", 1, 10))
    assert relaxed.predicted_s < 0.95 * policy.controller.budget_s
    assert relaxed.train_from_sm == plain_plan.train_from_sm
    with pytest.raises(ValueError, match="grow_headroom"):
        HarliPolicy(ladder, pred, 0.02, 0.1, grow_headroom=0.5)


def test_prefill_ahead_keeps_the_trainer_clear_of_the_decode_after_the_prefill():
    # harli:ahead=on: a prefill's plan sees the decode step after it (its batch grows by the prompts it
    # finishes); when that step needs more SMs than the prefill's rung leaves, the trainer moves to a rung
    # clear of that share (the prefill takes the rest), or pauses when decode will need the whole GPU.
    ladder = SMLadder.cpu_standin(132, 16)
    pred = synthetic_predictor(ladder.shares)
    tpot = 0.03
    ahead = make_policy("harli:ahead=on", ladder, pred, tpot, 0.1, hysteresis_steps=1)
    plain = make_policy("harli", ladder, pred, tpot, 0.1, hysteresis_steps=1)
    assert ahead.name == "harli:ahead=on" and ahead.prefill.ahead and not plain.prefill.ahead
    for policy in (ahead, plain):
        while policy.plan(preview("decode", 1, 10)).partition.infer_sms == 132:
            pass  # decode leaves the whole GPU: prefills go on their rung, the trainer beside
    rung, top = ahead.prefill.rung, ahead.trainer_rungs[-1].infer_sms  # top: the most a trainer rung leaves

    def need(batch):  # the share the decode after a prefill needs (grow headroom included), 132 for none
        part, t = ahead.controller.target(batch, 10 * batch)
        if part is None:
            return 132
        larger = [p.infer_sms for p in ladder.spatial if p.infer_sms > part.infer_sms]
        near = t > (1 - ahead.grow_headroom) * ahead.controller.budget_s
        return (larger[0] if larger else 132) if near else part.infer_sms

    small = next(b for b in range(1, 200) if need(b) <= rung.infer_sms)
    mid = next(b for b in range(1, 200) if rung.infer_sms < need(b) <= top)
    whole = next(b for b in range(1, 400) if need(b) > top)
    plan = ahead.plan(preview("prefill", 2, 32, (small, 10 * small)))
    assert plan.partition is rung and plan.train_stream is rung.train_stream and not plan.paused
    plan = ahead.plan(preview("prefill", 2, 32, (mid, 10 * mid)))
    assert not plan.paused and plan.transient and plan.train_from_sm >= need(mid)
    assert plan.partition.infer_sms == plan.train_from_sm  # the prefill takes every SM the trainer left
    assert f"needs {need(mid)}" in plan.reason
    plan = ahead.plan(preview("prefill", 2, 32, (whole, 10 * whole)))
    assert plan.paused and plan.partition.infer_sms == 132
    # Without the option (the default) the prefill's rung does not look ahead.
    for batch in (small, mid, whole):
        plan = plain.plan(preview("prefill", 2, 32, (batch, 10 * batch)))
        assert plan.partition is plain.prefill.rung and not plan.paused


@pytest.mark.parametrize("prefill", ["rung", "paused", "beside"])
def test_harli_hands_shares_to_the_right_streams_and_pauses_on_a_spike(tmp_path, prefill):
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    seen_budgets = []

    def spy(trainer, gen):
        for ms in gen:
            seen_budgets.append(kernels.num_sms())
            yield ms

    # 20 ms objective: up to 4 sequences fit beside the trainer, 8 fit nowhere (the trainer must pause).
    make = lambda ladder: HarliPolicy(
        ladder, synthetic_predictor(ladder.shares), 0.02, 0.1, hysteresis_steps=2, prefill=prefill
    )
    load = requests([(0.15, 2, 20), (0.5, 8, 10), (1.2, 1, 25)])
    rt = runtime(
        tmp_path,
        ladder,
        make,
        load,
        RuntimeOptions(until="load", window_s=2.0, quiet=True, finish=False, plots=False),
        spy,
        None,
        "train.steps=200",
        "colocation.mixed_prefill=false",  # the prefill modes act on prefill steps of their own
    )
    summary = rt.run()
    decode = [r for r in rows(tmp_path) if r["kind"] in ("decode", "mixed")]
    paused = [r for r in decode if r["paused"]]
    running = [r for r in decode if not r["paused"]]
    assert paused and running and summary["trainer_paused_fraction"] > 0
    assert all(r["batch"] >= 5 or r["reason"].startswith(("hysteresis", "hold")) for r in paused)
    assert any(r["batch"] >= 8 for r in paused) and not any(r["batch"] >= 8 for r in running)
    assert all(r["micro_steps"] == 0 and r["train_sms"] == 0 for r in paused)
    assert all(0 < r["train_sms"] <= TOTAL - r["infer_sms"] for r in running)  # disjoint SMs
    # Resumed after the spike: the late request's steps run beside the trainer again.
    late = [r for r in decode if r["t"] > 1.2 and r["batch"] == 1]
    assert any(not r["paused"] and r["micro_steps"] > 0 for r in late)
    # Micro-steps ran on the trainer's stream of the chosen rung, under that rung's SM budget.
    launches = list(rt.worker.side.launches)
    assert launches and all(stream == f"train{sms}" for _, stream, sms in launches)
    trainer_streams = {p.train_sms for p in rt.policy.trainer_rungs} | {TOTAL}
    assert {sms for _, _, sms in launches} <= trainer_streams
    assert seen_budgets[: len(launches)] == [sms for _, _, sms in launches][: len(seen_budgets)]
    assert {sms for _, _, sms in launches} - {TOTAL}, "some micro-steps ran beside decode on a partial share"
    # Rung (the default): prefill steps ran on half the GPU, the trainer on the other half.
    # Paused: on the whole GPU, and the trainer launched nothing for them.
    # Beside: on the whole GPU; once decode had a share, the trainer went on beside them on the complement of
    # that share (before, with no share to trail, it was held back).
    steps = [r for r in rows(tmp_path) if r["kind"] == "prefill"]
    assert steps
    if prefill == "rung":
        # While decode holds the whole GPU (from the start, and over the spike) a prefill keeps the trainer
        # paused; otherwise it runs on (about) half the GPU, the trainer on the rest.
        half = rt.policy.prefill.rung
        assert half.infer_sms >= TOTAL // 2 and half in rt.policy.trainer_rungs
        every = rows(tmp_path)
        for i, r in enumerate(every):
            if r["kind"] != "prefill":
                continue
            before = [x for x in every[:i] if x["kind"] in ("decode", "mixed")]
            if not before or before[-1]["infer_sms"] == TOTAL:
                assert r["infer_sms"] == TOTAL and r["train"] == "none" and r["micro_steps"] == 0
            else:
                assert (r["infer_sms"], r["train_sms"], r["train"]) == (
                    half.infer_sms,
                    half.train_sms,
                    "beside",
                )
        assert any(r["train"] == "beside" for r in steps)
        return
    assert all(r["infer_sms"] == TOTAL for r in steps)
    if prefill == "paused":
        assert all(r["train"] == "none" and r["micro_steps"] == 0 for r in steps)
    else:
        beside = [r for r in steps if r["train"] == "beside"]
        assert beside and all(
            TOTAL - r["train_sms"] in {p.infer_sms for p in ladder.partitions} for r in beside
        )
        assert steps[0]["train"] == "none"
    # Each decode step ran on the engine partition of the rung the controller chose.
    engine_steps = [s for s in rt.engine.metrics.steps if s.kind in ("decode", "mixed")]
    keys = {p.infer_sms: rt.engine.key(p) for p in ladder.partitions}
    assert [s.partition for s in engine_steps] == [keys[r["infer_sms"]] for r in decode]


class ScriptedPolicy(Policy):
    """Decode on a scripted share per decision; one trainer micro-step per decision."""

    name = "scripted"

    def __init__(self, ladder, script, transient=lambda: False):
        super().__init__(ladder, 0.05, 0.1)
        self.script, self.transient = script, transient

    def partitions(self):
        return list(self.ladder.partitions)

    def plan(self, preview):
        part = self.ladder.select(self.script())
        return StepPlan(
            part,
            BESIDE,
            part.train_stream,
            part.train_sms,
            1e-9,
            None,
            "scripted",
            isolated=True,
            train_from_sm=part.infer_sms,
            strict=False,
            transient=self.transient(),
        )


def graphed_runtime(out: Path, script, arena: bool = True) -> ColocatedRuntime:
    """A runtime on ``train.cuda_graphs`` under ScriptedPolicy(``script``): decode's share per decision;
    ``arena=False``: its graphs without the saved-tensor arena."""
    rt = runtime(
        out,
        SMLadder.cpu_standin(TOTAL, 8),
        lambda ladder: ScriptedPolicy(ladder, script),
        requests([(0.0, 4, 400)]),
        RuntimeOptions(quiet=True, plots=False),
        None,
        None,
        "train.cuda_graphs=true",
    )
    assert not rt.trainer.graphs.shapes  # no graphs made yet: the arena is still to choose
    rt.trainer.graphs.arena = arena
    return rt


def test_the_runtime_shows_a_prefill_the_decode_step_after_it(tmp_path):
    # A prefill's preview tells the batch and KV tokens of the decode step after it (harli:ahead sizes the
    # trainer's rung from them).
    seen = []

    class Recording(ScriptedPolicy):
        def plan(self, preview):
            seen.append((preview.kind, preview.prefill_tokens, preview.decode_after()))
            return super().plan(preview)

    ladder = SMLadder.cpu_standin(TOTAL, 8)
    load = requests([(0.0, 3, 4)])
    runtime(
        tmp_path,
        ladder,
        lambda ladder: Recording(ladder, lambda: 16),
        load,
        RuntimeOptions(quiet=True, plots=False),
    ).run()
    prefills = [(tokens, after) for kind, tokens, after in seen if kind == "prefill"]
    assert prefills
    # The 16-token prompts each finish in their prefill: the decode after it holds them, a token each.
    tokens, after = prefills[0]
    assert tokens % 16 == 0 and after == (tokens // 16, 17 * (tokens // 16))


def test_a_stranded_backward_is_rebuilt_on_the_new_split_and_the_result_is_unchanged(tmp_path, standalone):
    # Decode takes more SMs between a step's forward and its backward (twice): the backward would run on
    # SMs decode now holds, so its chunk is rebuilt on the trainer's new rung (its forward again, then its
    # backward), never held and never redone as a step; the result is unchanged.
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    holder = {"grows": 0, "grown": False}

    def script():
        feeder = holder["rt"].worker.side
        grow = feeder.last_phase in ("loss", "bwd") and (holder["grown"] or holder["grows"] < 2)
        holder["grows"] += grow and not holder["grown"]
        holder["grown"] = grow
        return 96 if grow else 16

    load = requests([(0.0, 4, 400)])
    rt = holder["rt"] = runtime(
        tmp_path,
        ladder,
        lambda ladder: ScriptedPolicy(ladder, script),
        load,
        RuntimeOptions(quiet=True, plots=False),
    )
    summary = rt.run()
    fin = summary["finetune"]
    assert holder["grows"] == 2 and fin["rebuilt_backward_chunks"] >= 2 and fin["abandoned_steps"] == 0
    assert fin["feed"]["rebuilt_chunks"] == fin["rebuilt_backward_chunks"]
    # Every backward ran on the rung of its time: the stranded ones on the trainer's 36 SMs beside decode's 96.
    bwd = [sms for phase, _, sms in rt.worker.side.launches if phase == "bwd"]
    assert TOTAL - 96 in bwd and TOTAL - 16 in bwd
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


def test_every_micro_step_kind_runs_on_any_rung_and_the_result_equals_standalone(tmp_path, standalone):
    # Decode's share jumps to a random rung at every decision, so the trainer's forwards, losses, backwards
    # (rebuilt where their forward's SMs were taken) and optimizer steps each run on several rungs, switched
    # at any micro-step boundary: the result is bit-identical to training alone.
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    rng = random.Random(0)
    shares = [p.infer_sms for p in ladder.spatial]
    load = requests([(0.0, 4, 400)])
    rt = runtime(
        tmp_path,
        ladder,
        lambda ladder: ScriptedPolicy(ladder, lambda: rng.choice(shares)),
        load,
        RuntimeOptions(quiet=True, plots=False),
    )
    summary = rt.run()
    rungs: dict[str, set[int]] = {}
    for phase, _, sms in rt.worker.side.launches:
        rungs.setdefault(phase, set()).add(sms)
    assert set(rungs) == {"fwd", "loss", "bwd", "optim"}
    assert all(len(sms) >= 2 for sms in rungs.values()), rungs
    assert summary["finetune"]["rebuilt_backward_chunks"] > 0 and summary["finetune"]["abandoned_steps"] == 0
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "no-arena"])
def test_captured_micro_steps_run_on_any_rung_and_equal_standalone(tmp_path, standalone, arena):
    # train.cuda_graphs: one set of graphs per rung; a share that jumps to a random rung at every decision
    # runs backwards on other rungs' sets than their forwards. With the saved-tensor arena they read what
    # the forwards saved there; without it they rebuild their chunk's forward on their own rung's set
    # (counted with the eager rebuilds). The result is bit-identical to training alone either way.
    rng = random.Random(0)
    shares = [p.infer_sms for p in SMLadder.cpu_standin(TOTAL, 8).spatial]
    rt = graphed_runtime(tmp_path, lambda: rng.choice(shares), arena)
    summary = rt.run()
    bwd = {sms for phase, _, sms in rt.worker.side.launches if phase == "bwd"}
    graphs = rt.trainer.graphs
    assert graphs is not None and graphs.captures >= 2 and len(bwd) >= 2
    assert summary["finetune"]["rebuilt_backward_chunks"] == graphs.rebuilds
    assert (graphs.rebuilds == 0) == arena
    assert summary["finetune"]["abandoned_steps"] == 0
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "no-arena"])
def test_captured_steps_move_with_decode_or_stay_on_their_rung_until_the_micro_batch_ends(
    tmp_path, standalone, arena
):
    # Decode holds 96 SMs for the first two micro-steps, then drops to 16. On the saved-tensor arena the
    # trainer moves to 116 SMs at once (a backward reads its forward's tensors on any set). Without it the
    # trainer finishes the micro-batch under way on its 36-SM rung (still clear of decode; moving would
    # replay its forwards on the larger rung's graphs), then moves. Nothing is rebuilt either way and the
    # result is unchanged.
    holder = {}
    script = lambda: 96 if holder["rt"].worker.side.launched_total < 2 else 16  # noqa: E731
    rt = holder["rt"] = graphed_runtime(tmp_path, script, arena)
    summary = rt.run()
    side = rt.worker.side
    first = [(phase, sms) for phase, _, sms in side.launches][: side.tracker.micro_per_step + 1]
    per_step = side.tracker.micro_per_step
    if arena:
        assert [sms for _, sms in first[:2]] == [TOTAL - 96] * 2, first
        assert [sms for _, sms in first[2:]] == [TOTAL - 16] * (len(first) - 2), first
        assert side.stayed == 0
    else:
        assert [sms for _, sms in first[:-2]] == [TOTAL - 96] * (per_step - 1), first  # the first micro-batch
        assert first[-1][1] == TOTAL - 16  # the next step starts on the larger rung
        assert side.stayed > 0
    assert summary["finetune"]["rebuilt_backward_chunks"] == 0
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


def test_a_transient_detour_neither_rebuilds_a_backward_nor_redoes_the_step(tmp_path, standalone):
    # Prefill-like detours (transient plans) cover the SMs of a step's forward for longer than the stale
    # limit: the backward goes on there (the detour shares those SMs on purpose), never rebuilt or redone.
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    holder, state = {"detours": 0}, {"detour": False}

    def script():  # called first in each plan; transient() then reports the same decision
        feeder = holder["rt"].worker.side
        state["detour"] = feeder.last_phase in ("loss", "bwd") and holder["detours"] < 12
        holder["detours"] += state["detour"]
        return 96 if state["detour"] else 16

    load = requests([(0.0, 4, 200)])
    rt = holder["rt"] = runtime(
        tmp_path,
        ladder,
        lambda ladder: ScriptedPolicy(ladder, script, lambda: state["detour"]),
        load,
        RuntimeOptions(quiet=True, plots=False),
    )
    summary = rt.run()
    assert holder["detours"] == 12
    assert summary["finetune"]["rebuilt_backward_chunks"] == 0 and summary["finetune"]["abandoned_steps"] == 0
    # Backwards went on during the detours (launched with the detour's trainer share).
    assert any(phase == "bwd" and sms == TOTAL - 96 for phase, _, sms in rt.worker.side.launches)
    assert losses(tmp_path) == losses(standalone)


def test_trainer_thread_launches_off_the_decode_thread_and_equals_standalone(tmp_path, standalone):
    # The trainer's micro-steps are launched from a thread of their own, gated by the decode thread's plans
    # (shares change, pauses come and go): the same micro-steps in the same order, so the same result.
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    threads, budgets = set(), []

    def spy(trainer, gen):
        for ms in gen:
            threads.add(threading.current_thread().name)
            budgets.append(kernels.num_sms())
            yield ms

    make = lambda ladder: HarliPolicy(
        ladder, synthetic_predictor(ladder.shares), 0.02, 0.1, hysteresis_steps=2
    )
    load = requests([(0.0, 2, 60), (0.2, 8, 10), (0.4, 1, 80)])
    interval = sys.getswitchinterval()
    rt = runtime(
        tmp_path, ladder, make, load, RuntimeOptions(quiet=True, plots=False, trainer_thread=True), spy
    )
    summary = rt.run()
    assert summary["stop_reason"] == "trained" and summary["finetune"]["steps_run"] == 6
    assert threads == {"harli-train"} and not rt.worker.threaded and sys.getswitchinterval() == interval
    decode = [r for r in rows(tmp_path) if r["kind"] in ("decode", "mixed")]
    assert decode and all(r["micro_steps"] == 0 for r in decode if r["paused"])
    launches = list(rt.worker.side.launches)
    assert all(stream == f"train{sms}" for _, stream, sms in launches)  # the budget went with the stream
    assert budgets[: len(launches)] == [sms for _, _, sms in launches][: len(budgets)]
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


def test_the_decode_thread_holds_the_host_while_it_launches_and_opens_it_while_it_waits(tmp_path):
    # With the trainer thread, the runtime installs its host-priority gate in every launcher: decode steps launch
    # with it held, wait for the GPU with it open, and the trainer's launcher calls pass through it.
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    seen = {"launch": [], "prefill": [], "read": [], "trainer": 0}

    def spy(trainer, gen):
        for ms in gen:
            launch_config.launch_gate()  # where a Triton launcher asks (on the CPU the ops may be torch's)
            seen["trainer"] += 1
            yield ms

    make = lambda ladder: HarliPolicy(
        ladder, synthetic_predictor(ladder.shares), 0.02, 0.1, hysteresis_steps=2
    )
    load = requests([(0.0, 2, 40), (0.1, 4, 10)])
    rt = runtime(
        tmp_path, ladder, make, load, RuntimeOptions(quiet=True, plots=False, trainer_thread=True), spy
    )
    engine, gate = rt.engine.engine, rt.worker.priority
    launch, read = engine.runner.launch, LaunchedStep.read

    def spy_launch(batch, *args, **kwargs):
        seen["prefill" if batch.is_prefill else "launch"].append(gate.held)
        return launch(batch, *args, **kwargs)

    def spy_read(step):
        seen["read"].append(gate.held)
        return read(step)

    engine.runner.launch = spy_launch
    LaunchedStep.read = spy_read
    try:
        summary = rt.run()
    finally:
        LaunchedStep.read = read
    assert summary["stop_reason"] == "trained" and seen["trainer"] > 0
    assert seen["launch"] and all(seen["launch"])  # every decode step launched with the host held ...
    assert seen["prefill"] and not any(seen["prefill"])  # (prefills do not hold it)
    assert seen["read"] and not any(seen["read"])  # ... and waited for with it open
    assert launch_config._launch_gate is None and engine.host_yield is contextlib.nullcontext  # uninstalled
    assert not gate.held and gate.timeouts == 0
    assert summary["finetune"]["feed"]["host_priority"]["waits"] == gate.waits


# ---- the other policies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["static:48", "streams", "temporal", "exclusive", "exclusive:48"])
def test_baseline_policies_honour_their_rules(tmp_path, name):
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    make = lambda ladder: make_policy(name, ladder, synthetic_predictor(ladder.shares, 1e-4), 0.05)
    # The first request leaves the trainer time to run (and time) a few micro-steps: temporal slices nothing
    # before one has been timed, nor one whose median (a cold first one alone: large) exceeds the slack.
    load = requests([(0.3, 3, 12), (0.6, 2, 12)])
    opts = RuntimeOptions(until="load", window_s=0.9, solo_s=0.3, quiet=True, finish=False, plots=False)
    summary = runtime(tmp_path, ladder, make, load, opts, None, None, "train.steps=200").run()
    decode = [r for r in rows(tmp_path) if r["kind"] in ("decode", "mixed")]
    assert decode and summary["serving"]["decode_steps"] == len(decode)
    if name == "static:48":
        assert all(
            r["infer_sms"] == 48 and r["train_sms"] == TOTAL - 48 and r["train"] == "beside" for r in decode
        )
    elif name == "streams":
        assert all(
            r["infer_sms"] == TOTAL and r["train_sms"] == TOTAL and r["train"] == "beside" for r in decode
        )
    elif name == "temporal":
        assert all(r["infer_sms"] == TOTAL and r["train"] in ("after", "none") for r in decode)
        assert any(r["train"] == "after" and r["micro_steps"] > 0 for r in decode), [
            (round(r["t"], 3), r["train"], r["micro_steps"]) for r in rows(tmp_path)
        ]
    else:  # exclusive: decode alone while serving, then the trainer alone
        assert all(
            r["micro_steps"] == 0 for r in rows(tmp_path) if r["t"] < summary["phases"]["serve"]["seconds"]
        )
        assert summary["finetune"]["tokens_per_s"] == 0 and summary["finetune"]["solo_tokens_per_s"] > 0
        # Alone, the trainer holds the whole GPU, or exclusive:48's trainer side of the 48-SM split.
        alone = TOTAL if name == "exclusive" else TOTAL - 48
        assert set(summary["trainer_sm_seconds"]) - {"0"} == {str(alone)}, summary["trainer_sm_seconds"]
    if not name.startswith("exclusive"):
        assert summary["finetune"]["tokens_per_s"] > 0


# ---- robustness ------------------------------------------------------------------------------------------


class CountingHook:
    def __init__(self):
        self.ooms = self.decodes = 0

    def before_decode(self, engine):
        self.decodes += 1

    def on_trainer_oom(self):
        self.ooms += 1
        return 0


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "trainer-thread"])
def test_trainer_oom_triggers_a_reclaim_and_training_continues(tmp_path, standalone, threaded):
    state = {"n": 0, "raised": False}

    def spy(trainer, gen):
        for ms in gen:
            state["n"] += 1
            if state["n"] == 15 and not state["raised"]:
                state["raised"] = True
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            yield ms

    hook = CountingHook()
    ladder = TimeSliceLadder.cpu_standin(TOTAL)
    make = lambda ladder: HarliPolicy(ladder, synthetic_predictor(ladder.shares, 1e-4), 0.05, 0.1, 2)
    load = requests([(0.0, 3, 300)])
    opts = RuntimeOptions(quiet=True, plots=False, trainer_thread=threaded)
    summary = runtime(tmp_path, ladder, make, load, opts, spy, hook).run()
    assert state["raised"] and hook.ooms == 1 and hook.decodes > 0
    assert summary["finetune"]["oom_recoveries"] == 1 and summary["serving"]["decode_steps"] > 0
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "trainer-thread"])
def test_a_trainer_that_cannot_fit_with_decode_idle_stops_with_its_steps_checkpointed(tmp_path, threaded):
    def spy(trainer, gen):  # from step 3 on, every micro-step runs out of memory
        for ms in gen:
            if trainer.step >= 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            yield ms

    hook = CountingHook()
    ladder = TimeSliceLadder.cpu_standin(TOTAL)
    make = lambda ladder: HarliPolicy(ladder, synthetic_predictor(ladder.shares, 1e-4), 0.05, 0.1, 2)
    opts = RuntimeOptions(quiet=True, plots=False, trainer_thread=threaded)
    t0 = time.monotonic()
    summary = runtime(tmp_path, ladder, make, requests([(0.0, 1, 8)]), opts, spy, hook).run()
    assert time.monotonic() - t0 < 60  # it ends: no endless retries
    assert summary["stop_reason"] == "out_of_memory" and summary["trainer"]["steps"] == 2
    assert hook.ooms >= opts.max_solo_ooms  # the hook freed what it could after every one
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()
    message = out_of_memory_message(summary)
    assert "does not fit in the GPU memory left beside" in message and "steps 1-2 are checkpointed" in message
    pooled = summary | {
        "memory": {
            "pool": {
                "enabled": True,
                "page_bytes": 2 << 20,
                "budget_pages": 97,
                "budget_source": "colocation.memory_gib",
                "tenants": {"kv": {"now": 8}},
            }
        }
    }
    message = out_of_memory_message(pooled)
    assert (
        "page pool's 0.19 GiB (colocation.memory_gib)" in message and "raise colocation.memory_gib" in message
    )


def test_the_memory_hook_sizes_the_idle_cache_once_before_the_trainer_is_alone(tmp_path):
    class IdleSeen(CountingHook):
        def __init__(self):
            super().__init__()
            self.idle = []  # per call: the engine had nothing to run

        def before_decode(self, engine):
            super().before_decode(engine)
            self.idle.append(not engine.engine.has_unfinished())

    hook = IdleSeen()
    ladder = TimeSliceLadder.cpu_standin(TOTAL)
    make = lambda ladder: HarliPolicy(ladder, synthetic_predictor(ladder.shares, 1e-4), 0.05, 0.1, 2)
    opts = RuntimeOptions(quiet=True, plots=False, trainer_thread=False)
    # 40 steps outlast one request of 4 tokens on any host: the trainer then runs alone.
    load = requests([(0.0, 1, 4)])
    summary = runtime(tmp_path, ladder, make, load, opts, None, hook, "train.steps=40").run()
    assert summary["stop_reason"] == "trained" and summary["phases"]["solo"]["seconds"] > 0
    # The load's last decision ran its last step; the solo phase's one saw the engine idle (a page pool's
    # cache then gives back the groups it holds idle, rather than keep them while the trainer runs alone).
    assert hook.idle[-1] and not hook.idle[-2]


def test_ctrl_c_checkpoints_and_a_resumed_run_continues(tmp_path, standalone):
    def spy(trainer, gen):
        for ms in gen:
            yield ms
            if ms.phase == "optim" and trainer.step == 2:  # the 3rd optimizer step ran but is not yet counted
                os.kill(os.getpid(), signal.SIGINT)

    ladder = TimeSliceLadder.cpu_standin(TOTAL)
    make = lambda ladder: HarliPolicy(ladder, synthetic_predictor(ladder.shares, 1e-4), 0.05, 0.1, 2)
    load = requests([(0.0, 3, 300)])
    summary = runtime(tmp_path, ladder, make, load, RuntimeOptions(quiet=True, plots=False), spy).run()
    assert summary["stop_reason"] == "interrupted" and summary["trainer"]["interrupted"]
    assert summary["trainer"]["steps"] == 3 and (tmp_path / "checkpoints" / "step_000003").is_dir()
    resumed = run_colocated(recipe(tmp_path), "tiny", "harli", resume=tmp_path, quiet=True)
    assert resumed["finetune"]["steps_run"] == 3 and resumed["stop_reason"] == "trained"
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


def test_a_resumed_colocated_run_writes_its_records_beside_the_first_parts(tmp_path):
    first = run_colocated(recipe(tmp_path), "tiny", "harli", quiet=True)
    col = tmp_path / "colocate"
    steps_before = (col / "steps.jsonl").read_bytes()
    summary_before = (col / "summary.json").read_bytes()
    assert first["records"] == {"dir": str(col), "part": 1}
    for part in (2, 3):  # resuming the finished run: nothing left to train, the records still kept apart
        again = run_colocated(recipe(tmp_path), "tiny", "harli", resume=tmp_path, quiet=True)
        assert again["records"] == {"dir": str(col / f"part-{part}"), "part": part}
        assert (col / f"part-{part}" / "summary.json").is_file()
        assert (col / f"part-{part}" / "steps.jsonl").is_file()
    assert (col / "steps.jsonl").read_bytes() == steps_before
    assert (col / "summary.json").read_bytes() == summary_before
    # A new run replacing this one starts over at part 1 and leaves no parts of the old run beside it.
    fresh = run_colocated(recipe(tmp_path, "output.overwrite=true"), "tiny", "harli", quiet=True)
    assert fresh["records"]["part"] == 1 and not list(col.glob("part-*"))


def test_gc_pauses_freeze_setup_objects_and_time_collections():
    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the cyclic collector frees it

    before = len(gc.callbacks)
    with GcPauses() as pauses:
        assert gc.get_freeze_count() > 0  # what existed at the start is out of every collection
        for _ in range(3):
            Node()
            gc.collect()
    summary = pauses.summary()
    assert summary["collections_by_generation"][2] >= 3 and summary["max_ms"] > 0
    assert summary["total_ms"] >= summary["max_ms"]
    assert gc.get_freeze_count() == 0 and len(gc.callbacks) == before


def _cycles(n: int) -> None:
    for _ in range(n):
        node: dict = {}
        node["me"] = node  # a reference cycle: only the cyclic collector frees it


def test_gc_pauses_leave_collection_to_the_decode_threads_waits():
    """Serving: no automatic collection; the young generations run in a GPU wait, the full one when idle."""
    assert gc.isenabled()
    with GcPauses() as pauses:
        assert not gc.isenabled()
        pauses.thresholds = (50, 2, 2)
        pauses.young_if_due()  # nothing due yet: nothing runs
        assert pauses.count == [0, 0, 0]
        _cycles(400)  # far past the threshold: CPython would have collected several times
        # get_count()[0] is allocations less deallocations of tracked objects: the interpreter's own frees
        # take a few off the 400 cycles, so the check is "several thresholds past", not an exact count
        assert pauses.count == [0, 0, 0] and gc.get_count()[0] >= 4 * pauses.thresholds[0]
        for _ in range(40):
            _cycles(60)
            pauses.young_if_due()
        assert pauses.count[0] > 0 and pauses.count[1] > 0 and pauses.count[2] == 0  # a due full one waits
        assert pauses.forced_full == 0
        _cycles(60)
        pauses.full_if_due()  # nothing decoding: the full collection runs
        assert pauses.count[2] == 1
        pauses.full_if_due()  # and only when due
        assert pauses.count[2] == 1
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert pauses.summary()["scheduled"] and pauses.summary()["collections_by_generation"] == pauses.count


def test_gc_pauses_force_a_full_collection_deferred_too_long_and_hand_back_to_cpython():
    with GcPauses(max_defer_s=0.0) as pauses:
        pauses.thresholds = (50, 1, 1)
        for _ in range(40):
            _cycles(60)
            pauses.young_if_due()
        assert pauses.count[2] >= 1 and pauses.forced_full == pauses.count[2]
        pauses.automatic()  # the trainer alone: CPython's own collections
        assert gc.isenabled()
        pauses.young_if_due()  # no longer the decode thread's to run
    assert gc.isenabled()
    with GcPauses(scheduled=False):
        assert gc.isenabled()  # CPython's own all along (--gc automatic)


def test_cuda_env_gives_streams_their_own_hardware_queues_unless_the_user_chose():
    from harli_train.cuda_env import prefer_cuda_env

    env: dict[str, str] = {}
    assert (
        prefer_cuda_env(env) == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
        and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    )
    mine = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert prefer_cuda_env(mine) == {} and mine["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_colocation_closes_the_engine_before_the_ladder():
    """The engine's pinned buffers record events on the ladder's streams when freed: the engine goes first
    (the other order aborted the process at exit on the H200 with 'context is destroyed')."""
    from types import SimpleNamespace

    from harli_train.colocate.assembly import Colocation

    order: list[str] = []
    engine = SimpleNamespace(close=lambda: order.append("engine"))
    ladder = SimpleNamespace(close=lambda: order.append("ladder"))
    Colocation(None, trainer=None, engine=engine, ladder=ladder, requests=[]).close()
    assert order == ["engine", "ladder"]


def test_host_profiles_of_the_trainer_thread_and_the_decode_loop(tmp_path, monkeypatch):
    # $HARLI_HOST_PROFILE: where the co-located threads' Python host time goes (the trainer is host-bound on
    # the GPU), sampled per thread, written as a table and as folded stacks; without it nothing is sampled.
    where = tmp_path / "profiles"
    monkeypatch.setenv("HARLI_HOST_PROFILE", str(where))
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    make = lambda ladder: HarliPolicy(ladder, synthetic_predictor(ladder.shares), 0.02, 0.1)
    load = requests([(0.0, 2, 20)])
    opts = RuntimeOptions(quiet=True, plots=False, trainer_thread=True)
    assert runtime(tmp_path / "run", ladder, make, load, opts).run()["stop_reason"] == "trained"
    for name in ("trainer-thread", "decode-loop"):
        folded = (where / f"{name}.folded").read_text().splitlines()
        assert folded and all(line.rsplit(" ", 1)[1].isdigit() for line in folded)
    trainer = (where / "trainer-thread.txt").read_text()
    assert trainer.startswith("trainer-thread: ") and "by inclusive" in trainer
    assert "launch_round (trainer_side.py" in trainer.split("=== by inclusive")[1]
    decode = (where / "decode-loop.txt").read_text().split("=== by inclusive")[1]
    assert "_serve (runtime.py" in decode and "launch_round" not in decode  # each thread its own stacks


def test_prepared_synthetic_prompts_are_the_ones_submit_would_make():
    """The runtime makes a load's synthetic prompts before serving (EngineAdapter.prepare); a prepared
    request and an unprepared one get the same token ids, and a prepared prompt is used once."""
    model = load_model("tiny", torch.float32, "cpu")
    ladder = TimeSliceLadder.cpu_standin(132)
    load = [TraceRequest(0.0, 4, prompt_len=n, request_id=f"r{i}") for i, n in enumerate((17, 300, 5))]
    prompts = {}
    for prepared in (False, True):
        engine = build_engine(model, load_tokenizer("tiny", True), ladder, load, 8)
        if prepared:
            engine.prepare(load)
        for r in load:
            assert engine.submit(r, 0.0)
        prompts[prepared] = [s.token_ids for s in engine.engine.scheduler.waiting]
        assert not engine._prompts  # each prepared prompt went to its request
    assert prompts[True] == prompts[False] and [len(p) for p in prompts[True]] == [17, 300, 5]


def test_a_step_row_lists_only_the_trainer_micro_steps_still_on_the_gpu_as_the_step_started():
    # The snapshot is as of the trainer's last launch: while it launches nothing (a paused step) its queue
    # still names micro-steps that have ended since. A step row names those whose end event is not reached.
    from harli_train.colocate.trainer_worker import TrainerSnapshot

    class End:
        def __init__(self, reached: bool) -> None:
            self.reached = reached

        def query(self) -> bool:
            return self.reached

    queue = ("fwd", "bwd", "bwd")
    snap = TrainerSnapshot(
        False, 3, 10, 1.0, 0.0, queue, None, None, False, 5, 0, (End(True), End(False), End(False))
    )
    assert snap.on_gpu() == ("bwd", "bwd")
    snap.queue_ends[1].reached = snap.queue_ends[2].reached = True
    assert snap.on_gpu() == ()
    # A CPU stand-in records no events (its micro-steps run as they launch): the queue as it was.
    assert TrainerSnapshot(False, 3, 10, 1.0, 0.0, ("fwd",), None, None, False, 5, 0).on_gpu() == ("fwd",)


def test_time_slicing_sizes_its_first_launch_by_the_micro_step_times_measured_at_set_up(tmp_path):
    # Under an objective, time slicing launches a micro-step only into slack its estimate fits. Before the
    # run has timed one, the estimates come from `Colocation.time_micro_steps` (the whole GPU at set-up);
    # without them none fits, and a load that never leaves the engine idle never trains.
    from harli_train.colocate.host_priority import HostPriority
    from harli_train.colocate.policy import AFTER
    from harli_train.colocate.trainer_side import TrainerSide

    trainer = Trainer(recipe(tmp_path), model=load_model("tiny", torch.float32, "cpu"), quiet=True)
    trainer.setup()
    full = SMLadder.cpu_standin(TOTAL, 16).full
    plan = StepPlan(full, AFTER, full.train_stream, TOTAL, 3e-3, None, "slack", strict=True)
    measured = {"fwd": 2e-3, "next": 2e-3, "loss": 1e-3, "bwd": 4e-3}
    seeded = TrainerSide(trainer, lambda: None, HostPriority(), estimates=measured)
    assert seeded.expected_s("next") == 2e-3 and seeded.expected_s("optim") == 4e-3  # unknown: the largest
    assert seeded._may_launch(plan, False, 3e-3, seeded.expected_s("next"), 0, "next")
    assert not seeded._may_launch(plan, False, 3e-3, seeded.expected_s("bwd"), 0, "bwd")  # 4 ms > 3 ms
    blind = TrainerSide(trainer, lambda: None, HostPriority())
    assert not blind._may_launch(plan, False, 3e-3, blind.expected_s("next"), 0, "next")
    # The run's own timings take over: one of 6 ms outweighs the set-up's 2 ms (a median of the two).
    seeded._observe(6e-3, "fwd")
    assert seeded.expected_s("fwd") == 6e-3


def test_the_warm_up_step_runs_the_recipes_micro_steps_on_a_synthetic_batch(tmp_path):
    # The synthetic step that warms the trainer's kernels and times its micro-steps on a GPU
    # (`warm_up_trainer`, `time_micro_steps`) is the run's own: the recipe's shape, chunking and stashes.
    from harli_train.colocate.colocation import synthetic_batch, synthetic_step

    trainer = Trainer(recipe(tmp_path), model=load_model("tiny", torch.float32, "cpu"), quiet=True)
    trainer.setup()
    cfg = trainer.cfg
    batch = synthetic_batch(trainer)
    assert batch["input_ids"].shape == (cfg.train.batch_size, cfg.data.seq_len)
    assert torch.equal(batch["input_ids"], synthetic_batch(trainer)["input_ids"])  # seeded
    phases = [ms.phase for ms in synthetic_step(trainer, batch)]
    assert {"fwd", "loss", "bwd"} <= set(phases)
    assert all(p.grad is not None for p in trainer.model.lora_parameters())
