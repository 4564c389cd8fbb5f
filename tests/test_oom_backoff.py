"""The trainer's hold after running out of memory doubles while no step completes, up to its cap."""

import pytest

from harli_train.colocate.oom_backoff import OomBackoff


def test_pauses_double_while_no_step_completes_and_start_over_after_one():
    b = OomBackoff(retries=3, base=64, max_doublings=2)
    holds = [b.failed() for _ in range(12)]
    assert holds == [0, 0, 64, 0, 0, 128, 0, 0, 256, 0, 0, 256]  # capped at 2 doublings
    assert b.pauses == 4
    b.failed()  # one failure of a new streak
    b.completed()
    assert [b.failed() for _ in range(3)] == [0, 0, 64]  # the streak and the doubling both start over


def test_one_retry_pauses_at_every_failure():
    b = OomBackoff(retries=1, base=8)
    assert [b.failed() for _ in range(6)] == [8, 16, 32, 64, 128, 128]


@pytest.mark.parametrize("kwargs", [{"retries": 0}, {"base": -1}, {"max_doublings": -1}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="OomBackoff"):
        OomBackoff(**kwargs)
