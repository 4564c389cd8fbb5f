"""Decode steps launched one ahead in the co-located loop (``RuntimeOptions.launch_ahead``,
``colocation.launch_ahead``): the same tokens served and the same training as without, every step recorded
under the plan it was launched with, and no successor launched where a plan forbids it."""

import itertools

import pytest

from harli_train.colocate.policy import AFTER, BESIDE, StepPlan
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.sm import SMLadder, TimeSliceLadder
from harli_train.colocate.steps_ahead import may_launch_ahead

from .runtime_support import (
    TOTAL,
    ScriptedPolicy,
    adapter,
    assert_same_adapter,
    losses,
    recipe,
    requests,
    rows,
    runtime,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def scripted_runtime(out, load, ahead: bool):
    """A runtime serving ``load`` whose decode share cycles over three rungs (16, 64, 40 SMs), one per plan."""
    shares = itertools.cycle([16, 64, 40])
    return runtime(
        out,
        SMLadder.cpu_standin(TOTAL, 8),
        lambda ladder: ScriptedPolicy(ladder, lambda: next(shares)),
        load,
        RuntimeOptions(quiet=True, plots=False, launch_ahead=ahead),
    )


def scripted_run(out, ahead: bool):
    """Decode's share cycles over three rungs, one per plan, while 20 requests of four output lengths decode
    beside the trainer (16 at a time: the last 4 are admitted, and prefilled in mixed steps, as the first to
    end leave); returns the runtime after its run and the sequences it served."""
    load = requests([(0.0, 5, 8), (0.0, 5, 12), (0.0, 5, 16), (0.0, 5, 20)])
    rt = scripted_runtime(out, load, ahead)
    served = []
    engine = rt.engine.engine
    add = engine.add_request

    def keep(*args, **kwargs):
        seq = add(*args, **kwargs)
        served.append(seq)
        return seq

    engine.add_request = keep
    rt.launches = []  # (kind, launched ahead of a step in flight) of every step the engine launched
    launch = engine.runner.launch

    def record(batch, partition, after=None):
        rt.launches.append((batch.kind, after is not None))
        return launch(batch, partition, after)

    engine.runner.launch = record
    rt.summary = rt.run()
    return rt, served


def test_steps_launched_ahead_serve_the_same_tokens_and_train_the_same(tmp_path):
    off_rt, off = scripted_run(tmp_path / "off", ahead=False)
    on_rt, on = scripted_run(tmp_path / "on", ahead=True)
    assert off_rt.summary["serving"]["launched_ahead_steps"] == 0
    launched = on_rt.summary["serving"]["launched_ahead_steps"]
    assert launched > 10 and launched == on_rt.engine.engine.num_launched_ahead
    # The last 4 prompts were admitted in mixed steps launched ahead of the decode step before them.
    assert ("mixed", True) in on_rt.launches and not any(ahead for _, ahead in off_rt.launches)
    # Greedy decoding of the same prompts: each request gets the same tokens, whichever step computed them.
    assert len(on) == len(off) == 20
    assert [s.completion_token_ids for s in on] == [s.completion_token_ids for s in off]
    assert all(s.num_completion_tokens == s.params.max_tokens for s in on)
    # The trainer's work is placed differently, never computed differently.
    assert losses(tmp_path / "on") == losses(tmp_path / "off")
    assert_same_adapter(adapter(tmp_path / "on"), adapter(tmp_path / "off"))


def test_a_step_launched_ahead_is_recorded_under_the_plan_that_placed_it(tmp_path):
    rt, _ = scripted_run(tmp_path, ahead=True)
    sms_of = {rt.engine.key(p): p.infer_sms for p in rt.policy.ladder.partitions}
    ran = [sms_of[s.partition] for s in rt.engine.metrics.steps]  # where the engine ran each step
    records = [r for r in rows(tmp_path) if r["kind"] != "idle"]
    assert [r["infer_sms"] for r in records] == ran
    # A step launched ahead is a decode step of every sequence it continues (its rows are counted).
    assert all(r["batch"] > 0 for r in records if r["kind"] == "decode")
    assert rt.summary["serving"]["decode_steps"] == sum(r["kind"] != "prefill" for r in records)
    # The script moves decode every plan, and a plan places the step after the one its call completes: the
    # shares do not repeat the script's order step for step, yet every step ran on a scripted share.
    assert set(ran) <= {16, 40, 64} and len(set(ran)) == 3


def test_the_trainer_waits_for_a_step_in_flight_on_the_sms_it_is_given(tmp_path):
    """Launched ahead, a step is still running when the next plan hands the trainer its SMs: when that
    plan's decode share is smaller than the step's (the trainer grows into the step's SMs), the trainer's
    work under it waits on the GPU for the engine's last step (its stream waits for that event) so the step
    runs alone as planned; when decode keeps or grows its share, nothing waits."""
    from harli_train.colocate.sm import StandInEvent

    rt = scripted_runtime(tmp_path, requests([(0.0, 3, 10)]), ahead=True)
    engine, sms_of = rt.engine, {rt.engine.key(p): p.infer_sms for p in rt.policy.ladder.partitions}
    engine.last_step_event = StandInEvent  # a new event per call (a CPU runner has none)
    feeds = []  # (decode's share in flight, the plan's share, the event its trainer work waits for)
    feed = rt.worker.feed

    def record(plan, after=None):
        flying = engine.engine._inflight
        feeds.append((flying and sms_of[flying.partition], plan.partition.infer_sms, after))
        launched = feed(plan, after)
        assert after is None or after in plan.train_stream.waits  # the round's first launch waited
        return launched

    rt.worker.feed = record
    rt.run()
    gated = [(was, now) for was, now, after in feeds if after is not None]
    assert all(was is not None and now < was for was, now in gated)
    assert all(after is not None for was, now, after in feeds if was is not None and now < was)
    assert gated and any(was is not None and now >= was for was, now, _ in feeds)  # both cases ran


def test_a_successor_not_launched_ahead_is_planned_once(tmp_path):
    """A successor the engine does not launch ahead (here: any step with prefill tokens, as a prompt too long
    for the mixed graphs is on a GPU) is launched after the step in flight completes; the plan made for it
    then (its trainer work fed, decode's share switched) is the one it runs under, not a second plan that
    would count the controller's hysteresis twice: every plan is followed by a launch before the next."""
    rt = scripted_runtime(tmp_path, requests([(0.0, 5, 8), (0.0, 5, 12), (0.0, 5, 16), (0.0, 5, 20)]), True)
    runner = rt.engine.engine.runner
    runner.replays_varlen = lambda tokens, rows: tokens <= rows  # no step with prefill tokens launches ahead
    events = []
    plan, launch = rt.policy.plan, runner.launch

    def planned(preview):
        events.append(("plan", preview.kind))
        return plan(preview)

    def launched(batch, partition, after=None):
        events.append(("launch", batch.kind, after is not None))
        return launch(batch, partition, after)

    rt.policy.plan, runner.launch = planned, launched
    rt.run()
    assert ("launch", "mixed", False) in events and ("launch", "mixed", True) not in events
    assert ("plan", "mixed") in events and events.count(("plan", "mixed")) == sum(
        e[:2] == ("launch", "mixed") for e in events
    )
    assert all(a[0] != "plan" or b[0] == "launch" for a, b in itertools.pairwise(events))


def test_the_recipe_turns_launching_ahead_on(tmp_path):
    from harli_train.colocate.commands import run_colocated

    cfg = recipe(tmp_path, "colocation.launch_ahead=true", "colocation.policy=static:40")
    summary = run_colocated(cfg, "tiny", quiet=True)
    sv = summary["serving"]
    assert 0 < sv["launched_ahead_steps"] <= sv["decode_steps"] + sv["prefill_steps"]


def _plan(part, train=BESIDE, transient=False):
    return StepPlan(part, train, part.train_stream, part.train_sms, 1e-3, None, "t", transient=transient)


def test_no_successor_is_launched_after_a_time_slice_or_a_one_step_detour():
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    part = ladder.select(40)
    assert may_launch_ahead(_plan(part), False) and may_launch_ahead(_plan(part), True)
    for itself in (False, True):
        assert not may_launch_ahead(_plan(part, train=AFTER), itself)  # the trainer runs after it on its SMs
        assert not may_launch_ahead(_plan(TimeSliceLadder.cpu_standin(TOTAL).full), itself)  # one stream
    # A one-step detour, launched ahead as the step it was made for, but not repeated by its successor.
    assert may_launch_ahead(_plan(part, transient=True), True)
    assert not may_launch_ahead(_plan(part, transient=True), False)


def test_a_harli_variant_launches_ahead_or_waits_whatever_the_run_says(tmp_path):
    from harli_train.colocate.policy import make_policy

    from .runtime_support import synthetic_predictor

    ladder = SMLadder.cpu_standin(TOTAL, 8)
    pred = synthetic_predictor(ladder.shares)
    ahead = make_policy("harli:launch=ahead", ladder, pred, 0.05)
    assert ahead.name == "harli:launch=ahead" and ahead.launch_ahead is True
    assert make_policy("harli:launch=wait", ladder, pred, 0.05).launch_ahead is False
    assert make_policy("harli", ladder, pred, 0.05).launch_ahead is None  # the run's option decides
    wait = make_policy("harli:launch=wait", ladder, pred, 0.05)
    for policy, opt, launched in ((ahead, False, True), (wait, True, False)):
        rt = runtime(
            tmp_path / policy.name.replace(":", "-"),
            ladder,
            lambda ladder, policy=policy: policy,
            requests([(0.0, 3, 16)]),
            RuntimeOptions(quiet=True, plots=False, launch_ahead=opt),
        )
        assert (rt.run()["serving"]["launched_ahead_steps"] > 0) is launched, policy.name
