"""The small parts a co-located run counts and shows with: StepTally, RunView/Progress, RecentQuantile."""

import pytest

from harli_train.colocate.gauges import GaugeBoard
from harli_train.colocate.progress import Progress, RunView
from harli_train.colocate.recent_quantile import RecentQuantile
from harli_train.colocate.step_tally import StepTally


def test_tally_counts_steps_shares_and_the_trainers_sm_seconds():
    tally = StepTally(total_sms=132)
    tally.mark("serve", 0.0, 0.0)
    tally.start_holding(0.0)
    tally.hold(1.0, 100, decode_sms=16)  # 0-1 s: the trainer held nothing; then 100 SMs beside decode's 16
    tally.count("decode", 4, 32, paused=False)
    tally.count("mixed", 4, 32, paused=False)
    tally.count("prefill", 0, 132, paused=True)  # no decode rows: no share counted
    tally.hold(3.0, 0)
    tally.count("decode", 2, 132, paused=True)
    tally.mark("drain", 4.0, 800.0)
    tally.mark("end", 5.0, 900.0)
    assert tally.step_counts() == {
        "decode_steps": 3,
        "mixed_steps": 1,
        "prefill_steps": 1,
        "launched_ahead_steps": 0,
    }
    figures = tally.share_figures()
    assert figures["share_histogram"] == {"32": 2, "132": 1}
    assert figures["trainer_sm_seconds"] == {"0": 1.0, "100": 2.0}
    assert figures["trainer_paused_fraction"] == pytest.approx(1 / 3)
    assert figures["mean_infer_sms"] == pytest.approx((32 * 2 + 132) / 3)
    # 1-3 s: 16 SMs neither side held (the trainer's rung below what decode's share left it).
    assert figures["unused_sm_fraction"] == pytest.approx(16 * 2.0 / (132 * 5.0))
    phases = tally.phases(end_tokens=1000.0)  # the last mark is closed with the tokens at the very end
    assert phases["serve"] == {"seconds": 4.0, "finetune_tokens": 800.0, "finetune_tokens_per_s": 200.0}
    assert phases["drain"]["finetune_tokens"] == 200.0 and tally.duration_s == 5.0


def test_the_console_line_and_the_gauges_show_one_view():
    objective = {"tpot_ms": {"p50": 10.0, "p99": 20.0}, "requests_judged": 3, "violations": 2,
                 "intervals": 400, "objective_tpot_ms": 25.0, "violation_rate": 0.005}  # fmt: skip
    view = RunView(12.0, 5, 10, 1.25, 1234.0, 3, 48, 84, 132, 0.1, objective)
    line = view.line("harli")
    assert line.startswith("[harli] train 5/10 loss 1.250, 1,234 tok/s | serve 3 seqs, TPOT p50/p99 over 3")
    assert "2 of 400 token intervals over 25 ms" in line and "decode on 48/132 SMs" in line
    assert view.line("harli", width=len(line)) == line
    narrow = view.line("harli", width=79)  # an 80-column terminal: the same figures, shorter
    assert narrow == "5/10 loss 1.250 1.2k tok/s | 3 seqs, TPOT p99 20.0 ms, 2/400 over | 48/132 SMs"
    g = view.gauges()
    assert (g.decode_sms, g.trainer_sms, g.objective_violations, g.token_intervals) == (48, 84, 2, 400)
    assert g.violation_rate == 0.005 and g.trainer_paused_fraction == 0.1
    board, views = GaugeBoard(every_s=0.5), []
    progress = Progress("harli", every_s=2.0, quiet=True, board=board, start=0.0)
    progress.update(0.1, lambda: views.append(1) or view)  # nothing due: the view is not even built
    assert not views and board.latest() is None
    progress.update(0.6, lambda: views.append(1) or view)
    assert views == [1] and board.latest() == g


def test_recent_quantile_is_over_the_last_window_once_enough_are_in():
    q = RecentQuantile(0.95, window=20, min_samples=5)
    for x in range(4):
        q.add(float(x))
    assert q.value is None and len(q) == 4
    q.add(4.0)
    assert q.value == 4.0
    for x in range(100, 140):  # only the last 20 count
        q.add(float(x))
    assert len(q) == 20 and q.value == 139.0
    q.clear()
    assert q.value is None and len(q) == 0
    with pytest.raises(ValueError):
        RecentQuantile(0.95, window=4, min_samples=8)
