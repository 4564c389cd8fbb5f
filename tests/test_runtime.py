"""The co-located runtime on the CPU stand-ins: the policies' names and shapes, and the main job's outputs,
refusals and the training result of a co-located run equal to a standalone run (co-location changes when,
never what)."""

import gc
import json
import logging

import pytest
import torch
from click.testing import CliRunner

from harli_train.cli import main
from harli_train.colocate import report
from harli_train.colocate.assembly import assemble
from harli_train.colocate.commands import run_colocated
from harli_train.colocate.policy import HarliPolicy, StaticPolicy, StreamsPolicy, TemporalPolicy, make_policy
from harli_train.colocate.predictor_setup import check_objective
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.shared_model import base_view, shares_weights
from harli_train.colocate.sm import SMLadder, TimeSliceLadder
from harli_train.config import RecipeError
from harli_train.model import load_model
from harli_train.train.divergence import TrainingDiverged

from .runtime_support import (
    LOAD,
    QUICKSTART,
    SMALL,
    TOTAL,
    adapter,
    assert_same_adapter,
    losses,
    preview,
    recipe,
    rows,
    synthetic_predictor,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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
    # The host's time before each step's launch, and of it the plan's (the stalls' first suspects).
    timed = [r for r in step_rows if r["kind"] in ("decode", "mixed")][1:]
    assert all(r["host_gap_s"] >= r["plan_s"] >= 0 for r in timed if r["host_gap_s"] is not None)
    assert any(r["host_gap_s"] is not None for r in timed)
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
