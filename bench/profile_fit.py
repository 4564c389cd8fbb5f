"""How a decode profile's raw model fits the decode steps co-located runs measured (no GPU needed).

    python bench/profile_fit.py PROFILE.json[.gz] RESULT.json[.gz] [RESULT ...] [--policy harli]

For every decode step beside the trainer in the windows of ``--policy`` (``harli`` takes its
``harli:OPTIONS`` variants too) of each bench_colocate RESULT written with ``--keep-steps``: the measured
latency over the profile's raw model beside the trainer (``LatencyPredictor.predict(..., raw=True)``) and
over its model of the step alone, by decode SMs and batch range. The first is where the profile prices a
share wrong before the online correction has learnt it (the step after decode returns to a share it left:
the co-run model of a profile whose trainer queue ran dry is low there); near 1 at every share is a profile
that fits. The second is what the live trainer costs decode on that share. ``analyze_colocate.py``'s
"measured / predicted" is against the corrected predictions, which hide a wrong profile while decode stays
on a share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from colocate_matrix import load  # noqa: E402
from replan_mixed import fitted  # noqa: E402
from step_measures import BATCH_SIZES, batch_size, decode_beside, rows_of, windows  # noqa: E402

from harli_train.colocate.predictor import LatencyPredictor  # noqa: E402


def of_policy(name: str, family: str) -> bool:
    """Whether a window's policy ``name`` is ``family`` or, for ``harli``, one of its variants."""
    return name == family or (family == "harli" and name.startswith("harli:"))


def fit_by_share(predictor: LatencyPredictor, rows: list[dict]) -> dict[tuple[int, str], dict[str, Any]]:
    """{(decode SMs, batch range): steps, medians and p95 of measured / raw co-run and measured / solo} over
    the decode steps beside the trainer among ``rows`` (a window's records, ``step_measures.rows_of``)."""
    ratios: dict[tuple[int, str], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in decode_beside(rows):
        corun = predictor.predict(r["batch"], r["kv_tokens"], r["infer_sms"], corun=True, raw=True)
        solo = predictor.predict(r["batch"], r["kv_tokens"], r["infer_sms"], corun=False, raw=True)
        co, alone = ratios[(r["infer_sms"], batch_size(r["batch"]))]
        co.append(r["measured_s"] / corun)
        alone.append(r["measured_s"] / solo)
    order = [batch_size(lo) for lo, _ in BATCH_SIZES]
    out = {}
    for key in sorted(ratios, key=lambda k: (k[0], order.index(k[1]))):
        co, alone = ratios[key]
        out[key] = {
            "steps": len(co),
            "corun_median": statistics.median(co),
            "corun_p95": statistics.quantiles(co, n=20)[-1] if len(co) > 1 else co[0],
            "solo_median": statistics.median(alone),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="the decode profile (.json or .json.gz)")
    ap.add_argument("results", nargs="+", help="bench_colocate results written with --keep-steps")
    ap.add_argument("--policy", default="harli", help="the policy whose windows to read (default harli)")
    args = ap.parse_args()
    predictor = fitted(load(Path(args.profile)))
    rows = [
        row
        for path in args.results
        for _, _, cells in windows(load(Path(path)))
        for policies in cells.values()
        for name, entry in policies.items()
        if of_policy(name, args.policy)
        for row in rows_of(entry)
    ]
    fit = fit_by_share(predictor, rows)
    if not fit:
        sys.exit(f"no decode steps beside the trainer in the {args.policy} windows of {args.results}")
    print("decode steps beside the trainer: measured / the profile's raw model, beside the trainer and alone")
    table = [
        [sms, batch, f["steps"], f["corun_median"], f["corun_p95"], f["solo_median"]]
        for (sms, batch), f in fit.items()
    ]
    print(common.table(table, ["decode SMs", "batch", "steps", "/ co-run", "p95", "/ alone"]))


if __name__ == "__main__":
    main()
