"""The co-located runtime's shares and streams: what the trainer side queues, on which rungs it launches,
where harli moves it around decode's share (grow headroom, prefill ahead, spikes), on the CPU stand-ins."""

import contextlib
import dataclasses
import types
from collections import deque

import pytest
import torch

from harli_train import kernels
from harli_train.colocate.assembly import build_engine
from harli_train.colocate.policy import HarliPolicy, StaticPolicy, make_policy
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.sm import SMLadder
from harli_train.data.tokenizer import load_tokenizer
from harli_train.engine.load import TraceRequest
from harli_train.model import load_model
from harli_train.train.trainer import Trainer

from .runtime_support import TOTAL, preview, recipe, requests, rows, runtime, synthetic_predictor

pytestmark = pytest.mark.usefixtures("one_thread")


def may_launch(feeder, plan, sync, budget, cost, launched, kind):
    """Whether the trainer side's gate lets one more micro-step launch, with its queue as it stands."""
    return feeder.gate.allows(plan, sync, budget, cost, launched, kind, len(feeder.in_flight))


# ---- shares, streams, pause and resume -----------------------------------------------------------------


def test_the_trainer_side_queues_at_most_max_in_flight_micro_steps_on_the_gpu(tmp_path):
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    make = lambda ladder: make_policy("static:64", ladder, None, 0.05)
    rt = runtime(tmp_path, ladder, make, requests([(0.0, 1, 4)]), RuntimeOptions(quiet=True, plots=False))
    feeder, plan = rt.worker.side, rt.policy.plan(preview("decode", 1, 10))
    assert plan.train == "beside" and feeder.gate.max_in_flight == 2
    may = lambda: may_launch(feeder, plan, False, 1.0, 1e-3, 0, "fwd")  # the GPU path, budget to spare
    assert may()
    feeder.in_flight.extend([(None, None, "fwd")] * 2)
    assert not may()  # a full queue waits, whatever the time budget says
    feeder.in_flight.pop()
    assert may()
    feeder.in_flight.clear()
    # The runtime hands its option down, and refuses a cap that would stop the trainer for good.
    opts = RuntimeOptions(quiet=True, plots=False, max_in_flight=3)
    assert runtime(tmp_path / "three", ladder, make, [], opts).worker.side.gate.max_in_flight == 3
    with pytest.raises(ValueError, match="max_in_flight"):
        RuntimeOptions(max_in_flight=0)


def test_temporal_keeps_one_micro_step_queued_while_idle(tmp_path):
    # Temporal's decode shares the trainer's stream: a request arriving while idle waits for what is queued,
    # so the idle plan caps the queue at one micro-step; its decode steps keep the runtime's cap.
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    make = lambda ladder: make_policy("temporal", ladder, synthetic_predictor(ladder.shares), 0.05)  # noqa: E731
    rt = runtime(tmp_path, ladder, make, requests([(0.0, 1, 4)]), RuntimeOptions(quiet=True, plots=False))
    feeder, idle = rt.worker.side, rt.policy.idle_plan()
    assert idle.max_queued == 1 and feeder.gate.max_in_flight == 2
    may = lambda plan: may_launch(feeder, plan, False, 1.0, 1e-3, 0, "fwd")  # noqa: E731
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
    feeder.times.by_kind.clear()
    # Before any micro-step has been timed nothing is known to fit: the first micro-step waits for a step
    # with no objective at stake (on the H200 a fresh trainer's first micro-step, estimated at 0, held the
    # next step 78 ms).
    assert not may_launch(feeder, plan, False, 0.005, feeder.expected_s("next"), 0, "next")
    assert may_launch(feeder, policy.idle_plan(), False, 0.005, feeder.expected_s("next"), 0, "next")
    feeder.times.by_kind["fwd"] = deque([0.020])  # one slow sample
    feeder.times.by_kind["optim"] = deque([0.001, 0.001, 0.001])
    # A kind never timed (the step boundary's) is estimated at the largest median, not the mean.
    assert feeder.expected_s("next") == 0.020
    for _ in range(50):
        assert not may_launch(feeder, plan, False, 0.005, feeder.expected_s("fwd"), 0, "fwd")
        assert not may_launch(feeder, plan, False, 0.005, feeder.expected_s("next"), 0, "next")
    assert may_launch(feeder, plan, False, 0.005, feeder.expected_s("optim"), 0, "optim")
    loose = dataclasses.replace(plan, strict=False)
    assert may_launch(feeder, loose, False, 0.005, 0.020, 0, "fwd")  # nothing launched yet: one goes
    assert not may_launch(feeder, loose, False, 0.005, 0.020, 1, "fwd")


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
    from harli_train.colocate.trainer_warmup import warm_step_end
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
