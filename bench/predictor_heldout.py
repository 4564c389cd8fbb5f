"""Held-out error of the latency predictor on a profile of real decode steps (no GPU needed).

    python bench/predictor_heldout.py PROFILE.json [--seeds 5]

The profile is what `harli-train profile` (or bench_colocate.py) measured on the GPU; this fits the two-stage
model on a seeded 70 % of its samples and reports the mean absolute percentage error on the other 30 %,
for solo and co-run steps, over several splits. Steps on adapters (a profile's ``adapter_steps``, fitted as
differences from the base steps and never evaluated) join every fit and stay out of the split, so the split
of the base steps does not depend on how many adapter steps there are. Target (docs/design.md): <= 5 %. A
profile whose co-run points carry ``corun_covered`` (made since the profile checks its trainer queue) also
gets the co-run error over the held-out points whose queue outlasted their decode steps, and the count of
those that ran dry.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
import common  # noqa: E402

from harli_train.colocate.predictor import LatencyPredictor, fit_options, split_samples  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    data = json.loads(Path(args.profile).read_text())
    samples, meta = data["samples"], data["meta"]
    total_sms = max(r["infer_sms"] for r in meta["ladder"])
    dry = sum(1 for r in samples if r.get("corun") and r.get("corun_covered") is False)
    rows, runs = [], []
    adapter = [r for r in samples if r.get("lora_slots")]
    base = [r for r in samples if not r.get("lora_slots")]
    for seed in range(args.seeds):
        fit_on, held_out = split_samples(base, 0.7, seed)
        fit_on += adapter
        pred = LatencyPredictor.fit(fit_on, total_sms, meta["kv_bytes_per_token"], **fit_options(meta))
        ev = pred.evaluate(held_out)
        if dry:
            covered = [r for r in held_out if not r.get("corun") or r.get("corun_covered") is not False]
            ev.update(pred.evaluate(covered, prefix="covered_"))
        runs.append(ev)
        row = [seed, len(fit_on), len(held_out), ev["solo_mape_pct"], ev["corun_mape_pct"]]
        rows.append(row + ([ev.get("covered_corun_mape_pct")] if dry else []))
    keys = ["solo_mape_pct", "corun_mape_pct"] + (["covered_corun_mape_pct"] if dry else [])
    summary = {k: statistics.mean(r[k] for r in runs if k in r) for k in keys}
    result = {
        "profile": args.profile,
        "key": data["key"],
        "grid": meta.get("grid"),
        "runs": runs,
        "corun_ran_dry": dry,
        "mean": summary,
        "target_pct": 5.0,
    }
    path = common.write_json("predictor_heldout.json", result)
    print(f"wrote {path}")
    print(
        common.table(
            rows + [["mean", "", "", *(summary[k] for k in keys)]],
            ["seed", "fit n", "held-out n", "solo MAPE % (<=5)", "co-run MAPE % (<=5)"]
            + (["co-run, queue covered"] if dry else []),
        )
    )
    if dry:
        print(f"{dry} co-run points of the profile ran their trainer queue dry (corun_covered false)")


if __name__ == "__main__":
    main()
