"""The trainer worker's refill: a queued micro-step that ends between decode's decisions makes room for the
next one at once, under the plan in force, and never while a decision is open (``TrainerWorker.refill``)."""

import time
from collections import deque
from types import SimpleNamespace

import torch

from harli_train.colocate.policy import BESIDE, StepPlan
from harli_train.colocate.sm import SMLadder
from harli_train.colocate.trainer_worker import TrainerWorker
from harli_train.model import load_model
from harli_train.train.trainer import Trainer
from tests.runtime_support import TOTAL, recipe


class End:
    """A micro-step's end event, reached ``after_s`` after it was made."""

    def __init__(self, after_s: float = 0.0) -> None:
        self.at = time.perf_counter() + after_s

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(self.at - time.perf_counter(), 0.0))


class FakeSide:
    """What the worker asks of its TrainerSide: a queue it retires as it ends, and rounds that queue micro-steps
    of ``micro_s`` each up to ``cap`` (recording each round's plan and whether it was preempted)."""

    def __init__(self, micro_s: float = 0.0, cap: int = 1) -> None:
        self.in_flight: deque = deque()
        self.micro_s, self.cap = micro_s, cap
        self.rounds: list[tuple[StepPlan, int]] = []
        self.launched_total = 0
        self.done = False

    def at_decision(self, decisions: int) -> None:
        pass

    def launch_round(self, plan, preempted=lambda: False, after=None) -> int:
        while self.in_flight and self.in_flight[0][1].query():
            self.in_flight.popleft()
        launched = 0
        while len(self.in_flight) < self.cap and not preempted():
            self.in_flight.append((None, End(self.micro_s), "fwd"))
            launched += 1
        self.launched_total += launched
        self.rounds.append((plan, launched))
        return launched


def worker_on(tmp_path, side: FakeSide, refill: bool = True) -> tuple[TrainerWorker, list]:
    """A TrainerWorker of the tiny trainer whose side is ``side``; the second value lists, per snapshot it
    published, (in a round, a decision open)."""
    trainer = Trainer(recipe(tmp_path), model=load_model("tiny", torch.float32, "cpu"), quiet=True)
    trainer.setup()
    worker = TrainerWorker(trainer, refill=refill)
    worker.side = side
    published: list[tuple[bool, bool]] = []

    def take():
        published.append((worker._in_round, worker._deciding))
        return SimpleNamespace(launched_total=side.launched_total, done=False)

    worker._take_snapshot = take
    return worker, published


def beside() -> StepPlan:
    part = SMLadder.cpu_standin(TOTAL, 16).spatial[0]
    return StepPlan(part, BESIDE, part.train_stream, part.train_sms, 1e-3, None, "test", isolated=True)


def test_a_refill_launches_under_the_plan_in_force_once_the_oldest_micro_step_ends(tmp_path):
    side = FakeSide()
    worker, published = worker_on(tmp_path, side)
    plan = beside()
    assert not worker._refill()  # no plan in force
    worker._plan = plan
    assert not worker._refill()  # nothing queued to wait for
    side.in_flight.append((None, End(), "fwd"))
    assert worker._refill()
    assert side.rounds == [(plan, 1)] and worker.refills == 1
    assert published[0] == (True, False)  # the round was published before it launched
    assert not worker._in_round


def test_no_refill_while_a_decision_is_open_or_a_message_waits(tmp_path):
    side = FakeSide()
    worker, _ = worker_on(tmp_path, side)
    worker._plan = beside()
    side.in_flight.append((None, End(), "fwd"))
    worker.tick()  # the decode thread opens a decision
    assert not worker._refill() and side.rounds == []
    worker.decided()
    worker._mailbox.put(("pause", None, 1))
    assert not worker._refill() and side.rounds == []
    worker._mailbox.get()
    assert worker._refill() and len(side.rounds) == 1


def test_a_decision_opened_while_the_refill_publishes_stops_it_before_it_launches(tmp_path):
    # The worker publishes its round, then checks for an open decision; the decode thread opens one, then
    # reads the snapshot. Whatever the interleaving, the decision sees the round or the round does not launch.
    side = FakeSide()
    worker, published = worker_on(tmp_path, side)
    worker._plan = beside()
    side.in_flight.append((None, End(), "fwd"))
    take = worker._take_snapshot

    def decision_opens_meanwhile():
        snap = take()
        worker._deciding = True
        return snap

    worker._take_snapshot = decision_opens_meanwhile
    assert not worker._refill()
    assert side.rounds == [] and worker.refills == 0
    assert published[0] == (True, False) and not worker._in_round


def test_with_refill_the_trainer_thread_keeps_its_queue_full_between_plans(tmp_path):
    # One plan, then no decision for a while: the queue of one micro-step (2 ms each) is refilled as each
    # ends. Without refill only the plan's own round launches. A decision (tick) stops the refills.
    for refill in (True, False):
        side = FakeSide(micro_s=2e-3)
        worker, _ = worker_on(tmp_path / str(refill), side, refill=refill)
        worker.start()
        worker.tick()
        worker.feed(beside())
        worker.decided()
        time.sleep(0.1)
        worker.tick()  # a decision opens: no refill from here on
        time.sleep(0.01)
        launched = side.launched_total
        time.sleep(0.05)
        assert side.launched_total == launched
        worker.decided()
        worker.pause()
        worker.stop()
        if refill:
            assert launched >= 10 and worker.refills >= 9
        else:
            assert launched == 1 and worker.refills == 0
