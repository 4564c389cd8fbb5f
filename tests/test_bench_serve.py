"""bench/bench_serve.py's dry run: both runs of the command users run (behind HTTP with loadgen, and in-process),
every request answered, the comparison's layout."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
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


def _start(args: list[str], env: dict[str, str], stderr: int) -> subprocess.Popen:
    """bench_serve.py ARGS started, its output piped (``stderr``: PIPE, or STDOUT to merge it)."""
    return subprocess.Popen([sys.executable, str(BENCH / "bench_serve.py"), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=stderr)  # fmt: skip


def _bench(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """bench_serve.py ARGS; past ``timeout_s`` it is sent SIGTERM, as an operator stops it, so that it stops
    its runs (each in a session of its own, out of reach of a signal to the bench's group) before the test
    fails."""
    proc = _start(args, env, subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
        pytest.fail(f"bench_serve.py ran past {timeout_s:.0f}s: {err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _runs_listening_on(port: int) -> list[int]:
    """The pids whose command line names ``127.0.0.1:<port>`` or the next port (a run of the bench's)."""
    wanted = (f"127.0.0.1:{port}".encode(), f"127.0.0.1:{port + 1}".encode())
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if any(w in cmdline for w in wanted):
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the runs through /proc")
def test_sigterm_to_the_bench_stops_its_run_and_writes_what_ran(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    port = _free_port_pair()
    proc = _start(["--dry-run", "--port", str(port), "--repeats", "1"], env, subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _runs_listening_on(port):  # the served run has started
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()  # its output is read once it has ended, not while it may still run
                pytest.fail(f"the served run did not start: {proc.communicate()[0][-3000:]}")
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=180)[0]
        # The bench reaps a stopped run before it exits; /proc may still show it for a moment.
        deadline = time.monotonic() + 10
        while _runs_listening_on(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _runs_listening_on(port)
    finally:  # what a failure above would otherwise leave running: the bench, then its runs
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _runs_listening_on(port):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"the bench left its runs behind: {left}"
    assert proc.returncode == 1, out[-3000:]
    result = json.loads((tmp_path / "bench_serve.json").read_text())
    assert result["error"] == "Stopped: stopped by SIGTERM"
    assert result["config"]["requests"] > 0 and result["pairs"] == []


@pytest.mark.slow
def test_bench_serve_dry_run_compares_the_served_run_with_the_same_load_in_process(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    port = str(_free_port_pair())  # not a fixed one: another run on this host may hold it
    proc = _bench(["--dry-run", "--port", port, "--repeats", "2"], env, timeout_s=600)
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
