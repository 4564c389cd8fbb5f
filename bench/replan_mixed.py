"""Where harli's mixed steps on the whole GPU would have run with another prefill floor (no GPU needed).

    python bench/replan_mixed.py RESULT.json[.gz] --profile PROFILE.json[.gz] [--floors 32,64,128]

Reads a bench_colocate result written with ``--keep-steps`` and the decode profile its run used, fits the
latency predictor, and replays every mixed step harli ran on the whole GPU (the trainer paused) through
harli's rule for a mixed step beside the trainer (``policy.base.chunk_fits``, ``largest_chunk``): for each
floor (``harli:floor=N``), the smallest spatial share at least the step's decode share where N prefill tokens
fit the budget beside the trainer, and the chunk that share fits. The budget is the objective less the margin
the window decided under (``harli_defaults.decided_margin``: a learnt margin's median, else the run's). The
steps' pending prompts are not in the records: each replayed step has one prompt of ``--pending`` tokens (no
cached context) waiting. The predictions are corrected as a fresh policy's are (the predictor's fitted
correction, before any step has been measured); ``--corun-correction`` scales those beside the trainer
further (e.g. by the measured / predicted ratio the run's rows show). So the replay says where a floor could
move the steps, not what they would measure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from colocate_matrix import load  # noqa: E402
from harli_defaults import decided_margin  # noqa: E402
from step_measures import rows_of, windows  # noqa: E402

from harli_train.colocate.policy.base import chunk_fits, largest_chunk  # noqa: E402
from harli_train.colocate.predictor import LatencyPredictor, fit_options  # noqa: E402
from harli_train.engine.step_work import PrefillPiece, StepPreview  # noqa: E402


def replan(
    rows: list[dict],
    predictor: LatencyPredictor,
    shares: list[int],
    budget_s: float,
    floors: list[int],
    pending: int,
    corun_correction: float = 1.0,
) -> dict[str, dict]:
    """``moves``: per floor, how many of the whole-GPU mixed steps in ``rows`` would have gone to each
    spatial share (``None``: still the whole GPU); ``chunks``: per (floor, share), the prefill tokens each
    such step would have taken there."""
    total = max(shares) if shares else 0
    out: dict[int, Counter] = {f: Counter() for f in floors}
    chunks: dict[tuple[int, int | None], list[int]] = defaultdict(list)
    for row in rows:
        if row["kind"] != "mixed" or row["infer_sms"] < total:
            continue
        preview = StepPreview(
            row["batch"],
            row.get("kv_tokens") or 0,
            (PrefillPiece(max(pending, row.get("prefill_tokens") or 0), 0, 0),),
            mixed=True,
        )
        for floor in floors:
            where = None
            for sms in shares:
                if sms >= total:
                    continue
                if not chunk_fits(predictor, preview, floor, sms, True, budget_s / corun_correction):
                    continue
                n, _, _ = largest_chunk(predictor, preview, sms, True, budget_s / corun_correction)
                where = sms
                chunks[(floor, sms)].append(n)
                break
            out[floor][where] += 1
    return {"moves": out, "chunks": chunks}


def fitted(profile: dict) -> LatencyPredictor:
    """The latency predictor fitted to a decode profile's document (as ``colocate_matrix.load`` reads it)."""
    meta = profile.get("meta", {})
    return LatencyPredictor.fit(
        profile["samples"],
        int(profile["key"]["sm_count"]),
        float(meta["kv_bytes_per_token"]),
        **fit_options(meta),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a bench_colocate result written with --keep-steps")
    ap.add_argument("--profile", required=True, help="the decode profile the run used (.json or .json.gz)")
    ap.add_argument("--floors", default="32,64,128", help="prefill floors to replay (comma-separated)")
    ap.add_argument("--pending", type=int, default=256, help="prompt tokens each replayed step has waiting")
    ap.add_argument(
        "--corun-correction", type=float, default=1.0, help="scales predictions beside the trainer"
    )
    args = ap.parse_args()
    result, predictor = load(Path(args.result)), fitted(load(Path(args.profile)))
    shares = sorted(r["infer_sms"] for r in result["setup"]["ladder"]["rungs"])
    margin = result["setup"]["margin"]
    floors = [int(f) for f in args.floors.split(",") if f]
    lines = []
    for objective, tpot_s, cells in windows(result):
        for cell, policies in cells.items():
            entry = policies.get("harli")
            if not isinstance(entry, dict) or "steps" not in entry:
                continue
            got = replan(
                rows_of(entry),
                predictor,
                shares,
                tpot_s * (1 - decided_margin(entry, margin)),
                floors,
                args.pending,
                args.corun_correction,
            )
            for floor in floors:
                for sms, steps in sorted(got["moves"][floor].items(), key=lambda kv: kv[0] or 10**6):
                    n = got["chunks"].get((floor, sms)) if sms else None
                    lines.append(
                        [
                            f"{objective} {cell}",
                            floor,
                            sms or "whole GPU",
                            steps,
                            statistics.median(n) if n else "-",
                        ]
                    )
    print(common.table(lines, ["cell", "floor", "share", "mixed steps", "median chunk"]))


if __name__ == "__main__":
    main()
