"""The other policies' rules, and the co-located runtime's robustness: out of memory, Ctrl-C and resume,
collection pauses, the CUDA environment, host profiles and the step rows."""

import gc
import json
import logging
import os
import signal
import threading
import time

import pytest
import torch

from harli_train.colocate.assembly import build_engine
from harli_train.colocate.commands import decode_out_of_memory_message, out_of_memory_message, run_colocated
from harli_train.colocate.gc_pauses import GcPauses
from harli_train.colocate.policy import HarliPolicy, StepPlan, make_policy
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.colocate.sm import SMLadder, TimeSliceLadder
from harli_train.data.tokenizer import load_tokenizer
from harli_train.engine.load import TraceRequest
from harli_train.model import load_model
from harli_train.train.trainer import Trainer

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
    synthetic_predictor,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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
    """Counts decode decisions and trainer OOMs; records which thread ran each half of an OOM's recovery
    and the ticket the second half got."""

    def __init__(self):
        self.ooms = self.decodes = 0
        self.threads: list[tuple[str, str]] = []  # (half, thread name)
        self.tickets: list = []

    def before_decode(self, engine):
        self.decodes += 1

    def on_trainer_oom(self):
        self.ooms += 1
        self.threads.append(("serving", threading.current_thread().name))
        return f"ticket-{self.ooms}"

    def after_trainer_oom(self, ticket):
        self.threads.append(("trainer", threading.current_thread().name))
        self.tickets.append(ticket)


def _oom_run(tmp_path, failures: int, threaded: bool) -> tuple[dict, CountingHook]:
    """A co-located run whose trainer runs out of memory at its 15th micro-step and at the next
    ``failures - 1`` launches after it (each a retry of the abandoned step): (summary, hook). The run stops
    only after more failures in a row with nothing else running than that."""
    state = {"n": 0, "raised": 0}

    def spy(trainer, gen):
        for ms in gen:
            state["n"] += 1
            if state["n"] >= 15 and state["raised"] < failures:
                state["raised"] += 1
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            yield ms

    hook = CountingHook()
    ladder = TimeSliceLadder.cpu_standin(TOTAL)
    make = lambda ladder: HarliPolicy(ladder, synthetic_predictor(ladder.shares, 1e-4), 0.05, 0.1, 2)
    load = requests([(0.0, 3, 300)])
    opts = RuntimeOptions(quiet=True, plots=False, trainer_thread=threaded, max_solo_ooms=failures + 1)
    summary = runtime(tmp_path, ladder, make, load, opts, spy, hook).run()
    assert state["raised"] == failures
    return summary, hook


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "trainer-thread"])
def test_trainer_oom_triggers_a_reclaim_and_training_continues(tmp_path, standalone, threaded):
    summary, hook = _oom_run(tmp_path, 1, threaded)
    assert hook.ooms == 1 and hook.decodes > 0
    # The serving side's half on the decode thread, then the trainer's half (with its ticket) on the
    # trainer's thread: a recovery's waits are never the decode thread's.
    main = threading.main_thread().name
    assert hook.threads == [("serving", main), ("trainer", "harli-train" if threaded else main)]
    assert hook.tickets == ["ticket-1"]
    assert summary["finetune"]["oom_recoveries"] == 1 and summary["serving"]["decode_steps"] > 0
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


def test_a_trainer_that_keeps_running_out_of_memory_is_held_back_longer_each_time(
    tmp_path, standalone, caplog
):
    """Six failures in a row (a pool that stays full): two pauses, the second twice the first, then the
    step completes and the run trains what standalone training trains."""
    with caplog.at_level(logging.WARNING, logger="harli_train.colocate.trainer_side"):
        summary, hook = _oom_run(tmp_path, 6, threaded=False)
    pauses = [r.message for r in caplog.records if "paused for" in r.message]
    assert len(pauses) == 2 and "paused for 64 decode steps" in pauses[0], pauses
    assert "paused for 128 decode steps" in pauses[1], pauses
    feed = summary["finetune"]["feed"]
    assert hook.ooms == 6 and summary["finetune"]["oom_recoveries"] == 6 and feed["oom_pauses"] == 2
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


@pytest.mark.parametrize("ahead", [False, True], ids=["wait", "launch-ahead"])
def test_a_failed_run_leaves_its_engine_without_its_requests(tmp_path, ahead):
    """The engine outlives a run that fails mid-serve (a benchmark's next window runs on it): it keeps none
    of the failed run's requests, whose next tokens would put the pause between the runs in another run's
    token intervals (on the H200 a 12.25 s interval in the window after a failed one)."""
    calls = []

    def script():
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("a device error in the middle of the run")
        return 64

    load = requests([(0.0, 6, 24)])
    opts = RuntimeOptions(quiet=True, plots=False, launch_ahead=ahead)
    rt = runtime(
        tmp_path, SMLadder.cpu_standin(TOTAL, 8), lambda ladder: ScriptedPolicy(ladder, script), load, opts
    )
    with pytest.raises(RuntimeError, match="device error"):
        rt.run()
    engine = rt.engine.engine
    assert not engine.has_unfinished() and engine.in_flight is None
    assert not engine.block_manager.used_blocks


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
    # With nothing left to sample, the sampler's thread ends (its wake-ups would take the GIL for good).
    from harli_train.colocate import host_profile

    deadline = time.monotonic() + 2.0
    while any(t.name == "harli-host-sampler" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "harli-host-sampler" for t in threading.enumerate())
    with host_profile.host_profile("again"):  # and the next profiled block starts another
        assert any(t.name == "harli-host-sampler" for t in threading.enumerate())


def test_a_torn_stack_walk_drops_the_sample_and_the_sampler_lives_on(tmp_path, monkeypatch):
    """Another thread's frames are read while it runs, so a walk may meet something that is not a frame
    (CPython 3.11 gave a dict for an `f_back`): that sample is dropped and counted, the sampler goes on,
    and once its thread ends the next block starts another."""
    import sys

    from harli_train.colocate import host_profile

    assert host_profile._stack({}) is None
    assert host_profile._stack(sys._getframe())[-1].startswith("test_a_torn_stack_walk")
    sampler = host_profile.Sampler(interval_s=1e-3)
    real, me = sys._current_frames, threading.get_ident()
    monkeypatch.setattr(sys, "_current_frames", lambda: {**real(), me: {}})
    entry = sampler.add(me, "torn")
    deadline = time.monotonic() + 2.0
    while entry.torn < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert entry.torn >= 3 and entry.samples == 0 and sampler._thread.is_alive()
    sampler.remove(me)
    host_profile.write_profile(entry, tmp_path, 0.1)
    assert "torn and dropped" in (tmp_path / "torn.txt").read_text()
    while sampler._thread is not None and time.monotonic() < deadline + 2.0:
        time.sleep(0.005)
    assert sampler._thread is None
    monkeypatch.setattr(sys, "_current_frames", real)
    again = sampler.add(me, "again")
    while again.samples == 0 and time.monotonic() < deadline + 4.0:
        time.sleep(0.005)
    sampler.remove(me)
    assert again.samples > 0 and again.torn == 0


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
    # run has timed one, the estimates come from `trainer_warmup.time_micro_steps` (the whole GPU at set-up);
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
    assert seeded.gate.allows(plan, False, 3e-3, seeded.expected_s("next"), 0, "next", 0)
    assert not seeded.gate.allows(plan, False, 3e-3, seeded.expected_s("bwd"), 0, "bwd", 0)  # 4 ms > 3 ms
    blind = TrainerSide(trainer, lambda: None, HostPriority())
    assert not blind.gate.allows(plan, False, 3e-3, blind.expected_s("next"), 0, "next", 0)
    # The run's own timings take over: one of 6 ms outweighs the set-up's 2 ms (a median of the two).
    seeded._observe(6e-3, "fwd")
    assert seeded.expected_s("fwd") == 6e-3


def test_the_warm_up_step_runs_the_recipes_micro_steps_on_a_synthetic_batch(tmp_path):
    # The synthetic step that warms the trainer's kernels and times its micro-steps on a GPU
    # (`warm_up_trainer`, `time_micro_steps`) is the run's own: the recipe's shape, chunking and stashes.
    from harli_train.colocate.trainer_warmup import synthetic_batch, synthetic_step

    trainer = Trainer(recipe(tmp_path), model=load_model("tiny", torch.float32, "cpu"), quiet=True)
    trainer.setup()
    cfg = trainer.cfg
    batch = synthetic_batch(trainer)
    assert batch["input_ids"].shape == (cfg.train.batch_size, cfg.data.seq_len)
    assert torch.equal(batch["input_ids"], synthetic_batch(trainer)["input_ids"])  # seeded
    phases = [ms.phase for ms in synthetic_step(trainer, batch)]
    assert {"fwd", "loss", "bwd"} <= set(phases)
    assert all(p.grad is not None for p in trainer.model.lora_parameters())


def _decode_oom_run(tmp_path, failures: set[int], max_decode_ooms: int = 3):
    """A co-located run whose engine steps run out of memory at the launches numbered in ``failures``
    (counting from 1): (summary, runtime)."""
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    make = lambda ladder: ScriptedPolicy(ladder, lambda: 48)
    opts = RuntimeOptions(quiet=True, plots=False, trainer_thread=False, max_decode_ooms=max_decode_ooms)
    rt = runtime(tmp_path, ladder, make, requests([(0.0, 3, 40)]), opts)
    runner = rt.engine.engine.runner
    launch, calls = runner.launch, {"n": 0}

    def failing_launch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in failures:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated decode step)")
        return launch(*args, **kwargs)

    runner.launch = failing_launch
    return rt.run(), rt


def test_a_decode_step_out_of_memory_runs_again_and_is_counted(tmp_path, standalone):
    summary, _ = _decode_oom_run(tmp_path, {6})
    serving = summary["serving"]
    assert summary["stop_reason"] == "trained" and serving["decode_oom_recoveries"] == 1
    assert serving["decode_oom_s"] > 0 and serving["requests"] == 3 and serving["refused"] == 0
    oom = [r for r in rows(tmp_path) if r["kind"] == "oom"]
    assert len(oom) == 1 and "simulated decode step" in oom[0]["error"] and oom[0]["recovery_s"] > 0
    # Every request got all its tokens; the trainer's abandoned step ran again to the same result.
    records = [json.loads(line) for line in (tmp_path / "colocate" / "serve" / "requests.jsonl").open()]
    assert sorted(r["output_tokens"] for r in records) == [40, 40, 40]
    assert losses(tmp_path) == losses(standalone)
    assert_same_adapter(adapter(tmp_path), adapter(standalone))


def test_decode_steps_that_never_fit_stop_the_run_with_its_steps_checkpointed(tmp_path):
    summary, rt = _decode_oom_run(tmp_path, set(range(8, 10_000)), max_decode_ooms=2)
    assert summary["stop_reason"] == "decode_out_of_memory" and rt.decode_oom_recoveries == 3
    assert len([r for r in rows(tmp_path) if r["kind"] == "oom"]) == 2  # the third stopped the run
    steps = summary["trainer"]["steps"]
    assert (tmp_path / "checkpoints" / f"step_{steps:06d}").is_dir()
    message = decode_out_of_memory_message(summary)
    assert "decode engine's steps do not fit" in message and "colocation.max_batch" in message
    assert f"steps 1-{steps} are checkpointed" in message
