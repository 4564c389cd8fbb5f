"""bench/bench_serve.py's dry run: both runs of the command users run (behind HTTP with loadgen, and in-process),
every request answered, the comparison's layout."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _free_port_pair() -> int:
    """A port p with p and p + 1 free now (the served run listens on p, the in-process run on p + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
                    return port
            except OSError:
                continue
    raise RuntimeError("no two adjacent free ports")


@pytest.mark.slow
def test_bench_serve_dry_run_compares_the_served_run_with_the_same_load_in_process(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    port = str(_free_port_pair())  # not a fixed one: another run on this host may hold it
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_serve.py"), "--dry-run", "--port", port, "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_serve.json").read_text())
    n, pairs, combined = result["config"]["requests"], result["pairs"], result["comparison"]
    assert len(pairs) == 2 and combined["pairs"] == 2
    assert combined["all_served"] and combined["client_errors"] == 0
    for pair in pairs:
        served, inproc, comparison = pair["served"], pair["inproc"], pair["comparison"]
        assert comparison["all_served"] and comparison["client_errors"] == 0
        assert (
            served["client"]["completed"] == served["engine"]["requests"] == inproc["engine"]["requests"] == n
        )
        assert served["exit_code"] == 0 and inproc["exit_code"] in (0, 130)
        # One assembly: the in-process run listens too, so both engines and live adapters are alike.
        assert "--serve" in served["command"] and "--serve" in inproc["command"]
        for run in (served, inproc):
            window = run["trainer"]["window_s"]
            assert 0 < window[0] < window[1] and run["trainer"]["tokens_per_s"] is not None
        assert set(comparison["client_over_engine"]) == {
            f"{m}_{s}" for m in ("ttft_ms", "tpot_ms") for s in ("p50", "p99", "mean")
        }
        assert set(comparison["objective"]) == {"client", "served_engine", "inproc_engine"}
    # The verdict is the median of the pairs' ratios (two: their mean), each pair's beside it. A pair whose
    # in-process trainer was paused for its whole window (an overloaded host: every step over the objective)
    # has no ratio and is left out of the median.
    ratios = combined["trainer_served_over_inproc_pairs"]
    assert ratios == [p["comparison"]["trainer_served_over_inproc"] for p in pairs]
    known = [r for r in ratios if r is not None]
    assert known, f"no pair's trainer ran in both windows: {pairs}"
    assert combined["trainer_served_over_inproc"] == pytest.approx(statistics.median(known))
    assert combined["client_vs_engine_worst"] == max(p["comparison"]["client_vs_engine_worst"] for p in pairs)
    assert (tmp_path / "bench_serve-runs.tar.gz").stat().st_size > 0
