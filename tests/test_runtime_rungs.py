"""Every micro-step on any rung: moved, rebuilt, captured or detoured, the co-located result equals the
standalone one; and the decode and trainer threads share the host as their contract says."""

import contextlib
import random
import sys
import threading

import pytest

from harli_train import kernels
from harli_train.colocate.policy import HarliPolicy
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.sm import SMLadder
from harli_train.engine.launched_step import LaunchedStep
from harli_train.kernels import launch_config

from .runtime_support import (
    TOTAL,
    ScriptedPolicy,
    adapter,
    assert_same_adapter,
    graphed_runtime,
    losses,
    requests,
    rows,
    runtime,
    synthetic_predictor,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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
