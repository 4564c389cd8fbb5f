"""bench/colocate_matrix.py: share worth and efficiency, the best clean fixed split per cell and per trace,
the verdict's bars, and merging per-call results into one matrix; bench/colocate_tables.py: the tables."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import colocate_matrix as cm  # noqa: E402
import colocate_tables as ct  # noqa: E402

RATES = {20: 4000.0, 52: 9000.0, 84: 13000.0, 116: 15000.0}


def row(tok, clean=True, held=None):
    return {
        "finetune_tokens_per_s": tok,
        "clean": clean,
        "tpot_attainment": 1.0 if clean else 0.8,
        "violation_rate": 0.0 if clean else 0.01,
        "trainer_sm_seconds": held or {"84": 10.0},
    }


def cell(**policies):
    return {"policies": policies, "ideal_tokens_per_s": 14000.0}


def test_standalone_rate_interpolates_and_share_worth_weights_by_time():
    assert cm.standalone_rate(RATES, 84) == 13000.0
    assert cm.standalone_rate(RATES, 68) == pytest.approx(11000.0)
    assert cm.standalone_rate(RATES, 10) == pytest.approx(2000.0)  # toward 0 at 0 SMs
    assert cm.standalone_rate(RATES, 132) == 15000.0 and cm.standalone_rate(RATES, 0) == 0.0
    assert cm.share_worth({"84": 1.0, "52": 1.0, "0": 2.0}, RATES) == pytest.approx((13000 + 9000) / 4)
    assert cm.share_worth({}, RATES) is None


def test_best_fixed_splits_and_the_verdict():
    light = cell(
        harli=row(12000.0, held={"84": 5.0, "116": 5.0}),
        **{"static:48": row(11000.0), "static:32": row(12500.0, clean=False), "static:64": row(9000.0)},
    )
    heavy = cell(
        harli=row(9000.0, held={"52": 10.0}),
        **{"static:48": row(8000.0, clean=False), "static:64": row(8900.0), "static:80": row(7000.0)},
    )
    none_clean = cell(harli=row(9000.0), **{"static:48": row(9500.0, clean=False)})
    matrix = {
        "objectives": {
            "auto:1.5": {"cells": {"steady/light": light, "steady/heavy": heavy, "bursty/light": none_clean}}
        },
        "standalone": {
            "whole_gpu_tokens_per_s": 16000.0,
            "by_train_sms": {str(k): v for k, v in RATES.items()},
        },
    }
    cm.finish(matrix)
    obj = matrix["objectives"]["auto:1.5"]
    assert light["best_static"] == "static:48"  # static:32 trains more but is not clean
    assert heavy["best_static"] == "static:64" and none_clean["best_static"] is None
    # Clean in every steady load, the highest mean: static:64 (static:48 is not clean at heavy).
    assert obj["traces"]["steady"]["best_single_static"] == "static:64"
    assert obj["traces"]["bursty"]["best_single_static"] is None
    assert light["policies"]["harli"]["share_efficiency"] == pytest.approx(12000 / 14000)
    assert light["policies"]["harli"]["fraction_of_ideal"] == pytest.approx(12000 / 14000)
    v = matrix["verdict"]["cells"]
    assert v["auto:1.5 steady/light"]["pass"]  # 1.09x static:48, efficiency 0.86 vs 0.85, 0.75 of solo
    assert v["auto:1.5 steady/heavy"]["beats_best_static"]  # 9000 vs 8900: within the noise
    assert not v["auto:1.5 bursty/light"]["pass"]  # no fixed split to compare against: a failure
    assert not matrix["verdict"]["all_pass"]
    assert "none clean" in ct.table(matrix)


def test_merge_puts_calls_side_by_side_and_recomputes():
    a = {
        "setup": {"trace": "steady"},
        "standalone": {"whole_gpu_tokens_per_s": 16000.0, "by_train_sms": {"84": 13000.0}},
        "objectives": {"auto:2": {"tpot_ms": 18.0, "cells": {"steady/light": cell(harli=row(1.0))}}},
    }
    b = {
        "setup": {"trace": "bursty"},
        "objectives": {"auto:2": {"tpot_ms": 18.0, "cells": {"bursty/light": cell(harli=row(2.0))}}},
    }
    a["objectives"]["auto:2"]["cells"]["steady/light"]["policies"]["harli"]["steps"] = [[0.1, "decode"]]
    merged = cm.merge([a, b], ["a.json", "b.json.gz"])
    assert sorted(merged["objectives"]["auto:2"]["cells"]) == ["bursty/light", "steady/light"]
    assert merged["standalone"]["by_train_sms"] == {"84": 13000.0} and len(merged["calls"]) == 2
    assert "verdict" in merged and merged["objectives"]["auto:2"]["tpot_ms"] == 18.0
    assert [c["file"] for c in merged["calls"]] == ["a.json", "b.json.gz"]
    harli = lambda m: m["objectives"]["auto:2"]["cells"]["steady/light"]["policies"]["harli"]
    assert "steps" not in harli(merged) and harli(merged)["finetune_tokens_per_s"] == 1.0  # steps stay in a
    assert harli(cm.merge([a, b], keep_steps=True))["steps"] == [[0.1, "decode"]]


def test_the_ideal_gives_each_decode_step_the_sms_its_least_share_leaves():
    steps = [
        {"kind": "prefill", "batch": 0, "measured_s": 0.05},
        {
            "kind": "decode",
            "batch": 2,
            "measured_s": 0.01,
            "interval_s": None,
        },  # after a prefill: its latency
        {"kind": "decode", "batch": 8, "measured_s": 0.01, "interval_s": 0.012},
        {"kind": "idle", "batch": 0, "measured_s": None},
        {"kind": "mixed", "batch": 40, "measured_s": 0.02, "interval_s": 0.02},  # no share meets it
    ]
    least = lambda row: {2: 20, 8: 48}.get(row["batch"])
    spans = cm.decode_spans(steps, least, 132)
    assert spans == [(0.01, 112), (0.012, 84), (0.02, 0)]
    ideal = cm.ideal_tokens_per_s(spans, 1.0, RATES, 16000.0)
    rest = 1.0 - 0.042  # nothing decoding: the whole GPU's rate
    assert ideal == pytest.approx(0.01 * cm.standalone_rate(RATES, 112) + 0.012 * 13000.0 + rest * 16000.0)
    assert ideal < 16000.0 and cm.ideal_tokens_per_s(spans, 0.0, RATES, 16000.0) is None


def test_a_cell_run_over_two_calls_keeps_both_calls_rows(tmp_path):
    a = {"objectives": {"auto:2": {"tpot_ms": 18.0, "cells": {"varying/1x": cell(harli=row(5.0))}}}}
    b = {
        "objectives": {
            "auto:2": {
                "cells": {"varying/1x": {"policies": {"streams": row(3.0)}, "ideal_tokens_per_s": None}}
            }
        }
    }
    merged = cm.merge([a, b])
    assert merged["standalone_differs"] == []  # b measured none
    b["standalone"] = {"whole_gpu_tokens_per_s": 1.0, "by_train_sms": {}}
    assert cm.merge([{**a, "standalone": {"whole_gpu_tokens_per_s": 2.0}}, b])["standalone_differs"] == [1]
    (only,) = merged["objectives"]["auto:2"]["cells"].values()
    assert sorted(only["policies"]) == ["harli", "streams"] and only["ideal_tokens_per_s"] == 14000.0
    path = cm.write(tmp_path / "m.json.gz", merged)
    assert path.read_bytes()[:2] == b"\x1f\x8b" and cm.load(path) == json.loads(json.dumps(merged))


def test_a_cell_where_no_fixed_split_keeps_the_objective_is_judged_against_the_best_other_baseline():
    # The sweep ran up to static:112, the largest decode share that leaves the trainer SMs (the ladder's
    # last rung with a trainer), and none was clean: harli is judged against the best clean other baseline.
    rungs = [{"infer_sms": s, "train_sms": 132 - s} for s in (16, 80, 96, 112, 132)]
    statics = {"static:96": row(5000.0, clean=False), "static:112": row(3000.0, clean=False)}
    exhausted = cell(harli=row(8000.0), temporal=row(3500.0), streams=row(11000.0, clean=False), **statics)
    beaten = cell(harli=row(3000.0), temporal=row(3500.0), **statics)
    no_temporal = cell(harli=row(8000.0), **statics)  # the alternative was not measured: nothing to judge by
    short = cell(harli=row(8000.0), temporal=row(3500.0), **{"static:96": row(5000.0, clean=False)})
    nothing_trains = cell(harli=row(8000.0), temporal=row(3500.0, clean=False), **statics)
    never_fits = cell(harli=row(2000.0), temporal=row(0.0), **statics)  # temporal clean, trains nothing
    matrix = {
        "setup": {"ladder": {"rungs": rungs}},
        "objectives": {
            "auto:2": {
                "cells": {
                    "bursty/medium": exhausted,
                    "bursty/heavy": beaten,
                    "steady/medium": no_temporal,
                    "steady/heavy": short,
                    "varying/1x": nothing_trains,
                    "longctx/heavy": never_fits,
                }
            }
        },  # fmt: skip
        "standalone": {"by_train_sms": {str(k): v for k, v in RATES.items()}},
    }
    assert cm.top_split(matrix) == "static:112"
    v = cm.finish(matrix)["verdict"]["cells"]
    medium = v["auto:2 bursty/medium"]
    assert medium["no_fixed_split_clean"] and medium["best_baseline"] == "temporal"  # streams is not clean
    assert medium["vs_best_baseline"] == pytest.approx(8000 / 3500) and medium["pass"]
    assert not v["auto:2 bursty/heavy"]["pass"]  # harli trains less than training while idle
    assert not v["auto:2 steady/medium"]["pass"] and "best_baseline" not in v["auto:2 steady/medium"]
    assert not v["auto:2 steady/heavy"]["no_fixed_split_clean"] and not v["auto:2 steady/heavy"]["pass"]
    varying = v["auto:2 varying/1x"]  # only harli trains within the objective: no baseline, no verdict
    assert varying["best_baseline"] is None and varying["vs_best_baseline"] is None and not varying["pass"]
    fits = v["auto:2 longctx/heavy"]  # a clean harli that trains beats a clean baseline that trains nothing
    assert fits["best_baseline"] == "temporal" and fits["vs_best_baseline"] is None and fits["pass"]
    text = ct.table(matrix)
    assert "none clean; temporal" in text and "none clean; temporal not run" in text
    assert "none clean; no training" in text
    # A merged matrix finds the ladder in its calls' set-ups, and merged again (alone, or with more calls)
    # it keeps them: the verdict stands.
    assert cm.top_split({"calls": [{"setup": None}, {"setup": {"ladder": {"rungs": rungs}}}]}) == "static:112"
    once = cm.merge([matrix], ["call0.json"])
    again = cm.merge([json.loads(json.dumps(once))], ["matrix.json.gz"])
    assert again["calls"] == once["calls"] and again["calls"][0]["file"] == "call0.json"
    assert again["verdict"] == once["verdict"] and again["verdict"]["cells"]["auto:2 bursty/medium"]["pass"]


def test_where_the_engine_alone_breaks_the_objectives_clean_reads_as_clean_as_the_engine_alone():
    # bursty/heavy at auto:1.5 on the H200: the TTFT objective forces prompt tokens into steps past the TPOT
    # objective even with no trainer. Each policy is judged against what serving alone showed.
    rungs = [{"infer_sms": s, "train_sms": 132 - s} for s in (16, 80, 96, 112, 132)]

    def bad(tok, rate, attain=0.95):
        return {**row(tok, clean=False), "violation_rate": rate, "tpot_attainment": attain}

    alone = bad(0.0, 0.050)
    statics = {"static:96": bad(5000.0, 0.20), "static:112": bad(3000.0, 0.0505)}
    infeasible = cell(harli=bad(3200.0, 0.0508), temporal=bad(1100.0, 0.054), exclusive=alone, **statics)
    worse = cell(harli=bad(2900.0, 0.09), temporal=bad(1100.0, 0.054), exclusive=alone)
    feasible = cell(harli=bad(2900.0, 0.09), temporal=bad(1100.0, 0.054), exclusive=row(0.0))
    matrix = {
        "setup": {"ladder": {"rungs": rungs}},
        "objectives": {
            "auto:1.5": {"cells": {"bursty/heavy": infeasible, "steady/heavy": worse, "varying/1x": feasible}}
        },
        "standalone": {"by_train_sms": {str(k): v for k, v in RATES.items()}},
    }
    v = cm.finish(matrix)["verdict"]["cells"]
    first = v["auto:1.5 bursty/heavy"]
    assert first["infeasible"] and first["alone_violation_rate"] == 0.05 and first["harli_clean"]
    # static:112 is as clean as serving alone: it is the fixed split harli has to beat, and harli does.
    assert first["best_static"] == "static:112" and first["vs_best_static"] == pytest.approx(3200 / 3000)
    assert first["beats_best_static"] and first["pass"]
    second = v["auto:1.5 steady/heavy"]  # harli broke the objectives more often than serving alone
    assert second["infeasible"] and not second["harli_clean"] and not second["pass"]
    third = v["auto:1.5 varying/1x"]  # the engine alone kept them: nothing is excused
    assert "infeasible" not in third and not third["harli_clean"] and not third["pass"]
    assert cm.keeps(infeasible["policies"]["static:112"], infeasible)
    assert not cm.keeps(infeasible["policies"]["temporal"], infeasible)
    text = ct.table(matrix)
    assert "as alone" in text and "infeasible (alone 0.0500); none clean" in text


def test_a_policy_run_several_times_is_its_median_window_when_all_are_clean_else_its_worst():
    runs = [(row(tok), [{"t": tok}]) for tok in (9000.0, 11000.0, 10000.0)]
    got, steps = cm.repeated(runs)
    assert got["finetune_tokens_per_s"] == 10000.0 and steps == [{"t": 10000.0}]  # the window's own records
    assert [r["finetune_tokens_per_s"] for r in got["repeats"]] == [9000.0, 11000.0, 10000.0]
    assert got["tokens_per_s_spread"] == [9000.0, 11000.0] and "repeats" not in runs[2][0]
    assert cm.repeated(runs[:2])[0]["finetune_tokens_per_s"] == 9000.0  # the lower middle of an even count
    assert cm.repeated(runs[:1]) == runs[0]  # one window: as it ran
    worse = {**row(8000.0, clean=False), "violation_rate": 0.05}
    mixed = [*runs, (row(12000.0, clean=False), []), (worse, [])]
    got, _ = cm.repeated(mixed)
    assert not got["clean"] and got["violation_rate"] == 0.05  # clean only if clean in every window
    failed = {"policy": "harli", "error": "RuntimeError: boom"}
    got, _ = cm.repeated([*runs, (failed, [])])
    assert got["error"] == failed["error"] and got["repeats"][-1] == {"error": failed["error"]}
    assert got["tokens_per_s_spread"] == [9000.0, 11000.0]


def test_the_light_bar_divides_by_the_whole_gpu_rate_the_cells_own_call_measured():
    light = cell(harli=row(7500.0), **{"static:48": row(7000.0), "static:64": row(6000.0)})
    matrix = {
        "objectives": {"auto:1.5": {"cells": {"steady/light": light}}},
        "standalone": {
            "whole_gpu_tokens_per_s": 11000.0,
            "by_train_sms": {str(k): v for k, v in RATES.items()},
        },
    }
    cm.finish(matrix)
    assert matrix["verdict"]["cells"]["auto:1.5 steady/light"]["fraction_of_standalone"] == pytest.approx(
        7500 / 11000
    )
    light["whole_gpu_tokens_per_s"] = 10000.0  # measured in the call that ran the cell (--whole-gpu-now)
    cm.finish(matrix)
    v = matrix["verdict"]["cells"]["auto:1.5 steady/light"]
    assert v["fraction_of_standalone"] == pytest.approx(0.75)
    # The bar's two factors: what harli's shares are worth on the whole GPU's scale, times its efficiency.
    eff = light["policies"]["harli"]["share_efficiency"]
    assert 0 < eff < 1.5 and v["shares_worth_of_standalone"] * eff == pytest.approx(0.75)
    worth = cm.share_worth(light["policies"]["harli"]["trainer_sm_seconds"], RATES)
    assert v["shares_worth_of_standalone"] == pytest.approx(worth / 10000.0)
    assert light["policies"]["harli"]["share_worth_tokens_per_s"] == pytest.approx(worth)
    text = ct.light_bar_table(matrix)
    assert "steady/light" in text and "0.750" in text and f"{worth / 10000.0:.3f}" in text
    assert ct.light_bar_table({"verdict": {"cells": {}}}) == ""


def test_harli_variants_are_compared_with_harli_and_never_judged_as_baselines():
    # No fixed split is clean up to the top one: the best other baseline is judged, and a variant of harli
    # that trains more than it is not one.
    rungs = [{"infer_sms": s, "train_sms": 132 - s} for s in (16, 112, 132)]
    only = cell(
        harli=row(8000.0),
        temporal=row(3500.0),
        **{"harli:window=0.1": row(8800.0), "static:112": row(3000.0, clean=False)},
    )
    matrix = {
        "setup": {"ladder": {"rungs": rungs}},
        "objectives": {"auto:1.5": {"cells": {"steady/light": only}}},
        "standalone": {"by_train_sms": {str(k): v for k, v in RATES.items()}},
    }
    v = cm.finish(matrix)["verdict"]["cells"]["auto:1.5 steady/light"]
    assert v["best_baseline"] == "temporal" and v["vs_best_baseline"] == pytest.approx(8000 / 3500)
    lines = ct.variants_table(matrix).splitlines()
    assert lines[0].split()[:5] == ["objective", "cell", "policy", "tok/s", "/harli"]
    by_name = {line.split()[2]: line.split() for line in lines[1:]}
    assert by_name["harli:window=0.1"][3:6] == ["8800", "1.100", "yes"]
    assert by_name["harli"][3:5] == ["8000", "1.000"]
    joined = ct.tables(matrix)  # what the bench and --merge print: every table with rows, in order
    assert joined.startswith(ct.table(matrix)) and joined.endswith(ct.variants_table(matrix))
    assert (
        ct.variants_table({"objectives": {"auto:1.5": {"cells": {"steady/light": cell(harli=row(1.0))}}}})
        == ""
    )
