"""NeighbourExcess and harli:neighbour=on: a decode step planned beside a kind of trainer micro-step that
slows decode more than the others is sized for that excess; nothing changes where no kind does."""

import pytest

from harli_train.colocate.controller import Controller
from harli_train.colocate.neighbours import NeighbourExcess
from harli_train.colocate.policy import make_policy
from harli_train.colocate.predictor import LatencyPredictor
from harli_train.colocate.sm import SMLadder
from harli_train.engine.step_work import StepPreview
from harli_train.policy_names import harli_name, parse_harli_options

TOTAL = 132


def spread(lo: float, hi: float, n: int) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def teach(excess: NeighbourExcess, rounds: int = 8) -> None:
    """Decode beside ``fwd`` runs at 0.90-1.00 of its prediction, beside ``loss`` at 0.95-1.11 (one step in
    21 beside ``loss``: its tail barely moves the quantile over every step)."""
    for _ in range(rounds):
        for i, r in enumerate(spread(0.90, 1.00, 100)):
            excess.observe(("fwd",), r)
            if i % 20 == 0:
                excess.observe(("loss",), 0.95 + 0.04 * (i // 20))


def test_no_factor_until_each_side_has_its_samples():
    ex = NeighbourExcess(min_samples=16)
    assert ex.factor(("loss",)) == 1.0 and ex.factor(()) == 1.0
    for _ in range(15):
        ex.observe(("loss",), 1.3)
    assert ex.factor(("loss",)) == 1.0  # 15 steps: neither quantile is in
    ex.observe(("loss",), 1.3)
    assert ex.factor(("loss",)) == 1.0  # every step so far was beside it: no excess over the rest
    assert ex.sized == 0


def test_the_factor_is_a_kinds_tail_over_every_steps_and_never_below_one():
    ex = NeighbourExcess()
    teach(ex)
    all_q, loss_q = ex.summary()["all"], ex.summary()["kinds"]["loss"]["value"]
    assert all_q == pytest.approx(1.0, abs=0.01) and loss_q == pytest.approx(1.11)
    assert ex.factor(("loss",)) == pytest.approx(loss_q / all_q)
    assert ex.factor(("fwd",)) == 1.0  # beside fwd decode runs as every step does: no factor
    assert ex.factor(("fwd", "loss")) == ex.factor(("loss", "fwd")) == ex.factor(("loss",))  # the largest
    assert ex.factor(("optim",)) == 1.0  # a kind never seen
    assert ex.sized == 0  # factor() counts nothing; size_step() counts the steps a factor above 1 sized
    assert ex.size_step(("fwd",)) == 1.0 and ex.sized == 0
    assert ex.size_step(("loss",)) == pytest.approx(loss_q / all_q) and ex.sized == 1
    summary = ex.summary()
    assert summary["kinds"]["loss"]["steps"] == 40 and summary["kinds"]["fwd"]["factor"] == 1.0
    assert summary["steps_sized"] == 1 and summary["quantile"] == 0.95


def test_bad_settings_are_refused():
    for kwargs in ({"quantile": 1.0}, {"min_samples": 0}, {"window": 8, "min_samples": 16}):
        with pytest.raises(ValueError, match="NeighbourExcess"):
            NeighbourExcess(**kwargs)


def predictor(shares):
    """Decode beside the trainer takes 1.25 ms * (1 + 64/s)."""
    params = {s: [1e-3 * (1 + 64 / s), 0.0, 0.25] for s in shares}
    return LatencyPredictor(TOTAL, 1.0, list(shares), params, [0.0] * 4, [0.0, 0.0], 256)


def test_a_step_planned_beside_a_slower_kind_takes_the_share_its_excess_needs():
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    pred = predictor(ladder.shares)
    ex = NeighbourExcess()
    ctl = Controller(pred, ladder, 4e-3, margin=0.1, hysteresis_steps=1, resume_margin=0.0, neighbours=ex)
    assert ctl.decide(1, 0, beside=("loss",)).partition.infer_sms == 40  # nothing learnt yet: as without
    teach(ex)
    factor = ex.factor(("loss",))
    d = ctl.decide(1, 0, beside=("loss",))
    budget = 4e-3 * 0.9
    want = min(p.infer_sms for p in ladder.spatial if 1.25e-3 * (1 + 64 / p.infer_sms) * factor <= budget)
    assert d.partition.infer_sms == want > 40 and d.reason.startswith("grow")
    assert d.excess == pytest.approx(factor) and d.beside == ("loss",)
    assert d.predicted_s == pytest.approx(1.25e-3 * (1 + 64 / want) * factor)
    assert f"x{factor:.3f}" in d.reason
    # Beside fwd (no excess) the least share that fits the plain budget again.
    assert ctl.decide(1, 0, beside=("fwd",)).partition.infer_sms == 40
    # What a step beside loss measured is learnt without the factor it was sized with.
    before = ex.summary()["kinds"]["loss"]["steps"]
    d = ctl.decide(1, 0, beside=("loss",))
    ctl.observe(d, d.predicted_s)  # ran as sized: its ratio without the factor is the factor
    assert ex.summary()["kinds"]["loss"]["steps"] == before + 1
    # The factor foresaw the miss: the online correction does not learn it (GPU-wide, it would size every
    # step after it for the loss micro-step too).
    assert pred.correction(d.partition.infer_sms, True) == pred.correction(40, True) == 1.0
    plain = Controller(pred, ladder, 4e-3, margin=0.1, hysteresis_steps=1, resume_margin=0.0)
    d = plain.decide(1, 0, beside=("loss",))
    plain.observe(d, d.predicted_s * factor)
    assert pred.correction(40, True) > 1.0
    assert ctl.summary()["neighbour_excess"]["kinds"]["loss"]["steps"] == before + 1


def test_without_neighbours_the_kinds_change_nothing():
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    ctl = Controller(predictor(ladder.shares), ladder, 4e-3, 0.1, hysteresis_steps=1, resume_margin=0.0)
    d = ctl.decide(1, 0, beside=("loss",))
    assert d.partition.infer_sms == 40 and d.excess == 1.0
    assert ctl.summary()["neighbour_excess"] is None


def test_harli_neighbour_on_plans_with_the_trainers_kinds_on_the_gpu():
    ladder = SMLadder.cpu_standin(TOTAL, 8)
    assert parse_harli_options("neighbour=on") == {"neighbour_aware": True}
    assert harli_name(neighbour_aware=True) == "harli:neighbour=on" and "neighbour" not in harli_name()
    with pytest.raises(ValueError, match="neighbour=on"):
        parse_harli_options("neighbour=maybe")
    plain = make_policy("harli", ladder, predictor(ladder.shares), 4e-3, 0.1, 1)
    aware = make_policy("harli:neighbour=on", ladder, predictor(ladder.shares), 4e-3, 0.1, 1)
    assert plain.controller.neighbours is None and aware.controller.neighbours is not None
    assert aware.name == "harli:neighbour=on"
    asked = []
    for policy in (plain, aware):
        policy.trainer_on_gpu = lambda: asked.append(1) or ("fwd", "loss")
    preview = StepPreview(decode_seqs=1, decode_kv_tokens=0)
    plain.plan(preview)
    assert not asked  # the plain policy does not query the trainer's queue
    teach(aware.controller.neighbours)
    plan = aware.plan(preview)
    assert asked and plan.decision.beside == ("fwd", "loss") and plan.decision.excess > 1.0
