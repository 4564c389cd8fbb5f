"""bench/analyze_colocate.py on a hand-made co-location result: shares, transitions, violations, stalls."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import analyze_colocate  # noqa: E402
import bench_colocate  # noqa: E402

COLUMNS = bench_colocate.STEP_COLUMNS


def _row(t, kind, sms, train, predicted, measured, interval=None, launching=False):
    return [t, kind, 4, sms, 132 - sms if train else 0, "beside" if train else "none"] + [
        predicted,
        measured,
        measured,
        interval,
        1,
        launching,
        "bwd" if launching else None,
        "r",
    ]


def results():
    steps = [
        _row(0.00, "decode", 132, False, 0.005, 0.005),
        _row(0.01, "decode", 48, True, 0.008, 0.009, 0.009),  # exit from the whole GPU: 1.125
        _row(0.02, "decode", 48, True, 0.008, 0.008, 0.0095, True),  # same share: 1.0, 1.5 ms host gap
        _row(0.03, "decode", 64, True, 0.007, 0.0084, 0.0084),  # grow: 1.2
        _row(0.06, "prefill", 132, False, None, 0.03),
        _row(0.07, "decode", 64, True, 0.007, 0.0077, None),  # after a prefill: 1.1
        _row(0.08, "decode", 48, True, 0.008, 0.024, 0.024),  # shrink: 3.0, a stall and a violation
        _row(0.09, "decode", 48, True, 0.008, 0.008, 0.008),
    ]
    cell = {
        "harli": {
            "finetune_tokens_per_s": 1000.0,
            "violations": 1,
            "feed": {"rebuilt_chunks": 2, "gpu_busy_s": 0.08, "launch_host_s": 0.05},
            "step_columns": COLUMNS,
            "steps": steps,
        },
        "static:64": {"finetune_tokens_per_s": 800.0, "violations": 0},  # no per-step records: skipped
    }
    return {"env": {"sms": 132}, "setup": {"objective_tpot_ms": 10.0}, "cells": {"bursty/heavy": cell}}


def test_analysis_attributes_steps_and_shares():
    report = analyze_colocate.analyze(results())
    (cell,) = report["cells"].values()
    assert list(cell) == ["harli"]
    r = cell["harli"]
    # Trainer SMs per interval ending at each row: 84, 84, 68, 0 (prefill), 68, 84, 84 over 0.01 s each,
    # except the 0.03 s before the prefill.
    spans = [(0.01, 84), (0.01, 84), (0.01, 68), (0.03, 0), (0.01, 68), (0.01, 84), (0.01, 84)]
    assert r["trainer_sms"] == pytest.approx(sum(d * s for d, s in spans) / 0.09)
    assert r["no_trainer_s"] == pytest.approx(0.03)
    assert r["tokens_per_s_per_sm"] == pytest.approx(1000.0 / r["trainer_sms"])
    t = report["transitions"]["harli"]
    assert t["exit whole GPU"]["median"] == pytest.approx(1.125)
    assert t["grow"]["median"] == pytest.approx(1.2)
    assert t["after prefill"]["median"] == pytest.approx(1.1)
    assert t["shrink"]["max"] == pytest.approx(3.0) and t["shrink"]["over_1"] == 1
    assert t["same share"]["steps"] == 2 and t["same share"]["over_1"] == 0
    (violation,) = r["violating_steps"]
    assert len(violation) == 3 and "measured 24.0" in violation[-1]
    (stall,) = r["stalls"]
    assert "GPU 24.0" in stall and "t=0.080" in stall
    # Host time between decode steps (interval less latency), split by the trainer thread's launching.
    gaps = report["host_gaps_ms"]["harli"]
    assert gaps["trainer launching"]["steps"] == 1 and gaps["trainer launching"]["max"] == pytest.approx(1.5)
    assert gaps["trainer launching bwd"]["steps"] == 1  # and by what it was launching
    assert gaps["trainer idle"]["steps"] == 4 and gaps["trainer idle"]["max"] == pytest.approx(0.0)


@pytest.mark.slow
def test_analysis_reads_plain_and_gzipped_results(tmp_path):
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(json.dumps(results()))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert analyze_colocate.load(plain) == analyze_colocate.load(packed) == json.loads(json.dumps(results()))


def test_bench_colocate_dry_run_writes_every_window(tmp_path):
    """The bench's own set-up (its parser's defaults into RuntimeOptions, the windows, the JSON) on the CPU
    stand-ins: a default that only the GPU run reached once cost a device run (every window failed)."""
    import json
    import os
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_colocate.py"
    env = {**os.environ, "OUT": str(tmp_path)}
    args = ["--dry-run", "--policies", "harli,static", "--traces", "bursty", "--loads", "light"]
    proc = subprocess.run(
        [sys.executable, str(bench), *args, "--keep-steps", "40", "--window-s", "0.8", "--solo-s", "0.5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "bench_colocate.json").read_text())
    assert "error" not in out["standalone"], out["standalone"]
    (cell,) = out["cells"].values()
    names = [k for k in cell if k == "harli" or k.startswith("static:")]
    assert len(names) == 2, sorted(cell)
    for name in names:
        entry = cell[name]
        assert isinstance(entry, dict), entry  # a failed window is stored as its error message
        assert entry["decode_steps"] > 0 and entry["finetune_tokens_per_s"] > 0
        rows = analyze_colocate.rows_of(entry)
        decode = [r for r in rows if r["kind"] == "decode"]
        assert decode and all("launch_s" in r and "trainer_queue" in r for r in decode)


def test_policies_flag_keeps_a_harli_variants_options_together():
    split = bench_colocate.split_policies("harli,harli:prefill=paused,grow=0.05,static,temporal")
    assert split == ["harli", "harli:prefill=paused,grow=0.05", "static", "temporal"]
    cell = {
        "harli": {"finetune_tokens_per_s": 300.0, "violations": 0},
        "harli:grow=0.05": {"finetune_tokens_per_s": 250.0, "violations": 0},
        "static:112": {"finetune_tokens_per_s": 100.0, "violations": 0},
    }
    v = bench_colocate.verdict(cell, 1000.0)
    assert v["best_baseline"] == "static:112" and v["ratio_vs_best_baseline"] == pytest.approx(3.0)
    assert v["variants"] == {
        "harli:grow=0.05": {"violations": 0, "ratio_vs_best_baseline": pytest.approx(2.5)}
    }
