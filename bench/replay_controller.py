"""Replay a window's decode steps through harli's controller offline (no GPU): the shares it takes and the
steps that run over the budget and the objective, with the predictor's share-visit rule on and off.

    python bench/replay_controller.py RESULT.json[.gz] --profile PROFILE.json[.gz] \\
        [--policy harli:launch=ahead] [--cells steady/heavy] [--seeds 5]

Reads a bench_colocate result written with ``--keep-steps`` and the decode profile its run used. Each decode
step of the window, in order (its batch and KV tokens; mixed and prefill steps are left out), is decided
again by a fresh ``Controller`` held to the window's objective and the run's margin. A step on share s is
"measured" as its raw prediction there times a ratio drawn (seeded) from the ratios the window's own steps
on s showed (what the policy learnt from, max(step latency, token interval), over the raw prediction); a
share the window never ran on takes the ratios of the nearest share it did. A replay shows how the
correction's rules move decode over the ladder against the same load and the same per-share errors, not
what a GPU run would measure: a share's errors do not depend on what came before it here.

Variants: the share-visit rule on and off, and each ``--options`` entry (harli's controller options,
``settle=on``, ``margin=learn``, comma-joined for both) on top of the rule. A replay's clock is the sum of
its steps' "measured" times; ``settle`` weighs a shrink against ``--micro-step-ms`` of queued trainer work.

Printed last, per cell and variant (the medians over the seeds): steps on each share, visits to each (steps
on it after a step elsewhere), steps over the budget and over the objective, and the trainer's mean SMs over
the decode steps' time (what decode leaves it; the cost of a switch is not in it).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from colocate_matrix import load  # noqa: E402
from replan_mixed import fitted  # noqa: E402
from step_measures import rows_of, windows  # noqa: E402

from harli_train.colocate.controller import Controller  # noqa: E402
from harli_train.colocate.predictor import LatencyPredictor  # noqa: E402
from harli_train.colocate.sm import SMLadder  # noqa: E402
from harli_train.policy_names import parse_harli_options  # noqa: E402

# harli's options the replay honours: parse_harli_options' keys -> Controller's keywords.
CONTROLLER_OPTIONS = {"settle": "settle", "learn_margin": "learn_margin"}


def share_ratios(predictor: LatencyPredictor, rows: list[dict]) -> dict[int, list[float]]:
    """Per share, what the window's decode steps beside the trainer took over their raw prediction."""
    ratios: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r.get("kind") != "decode" or r.get("train") != "beside" or not r.get("measured_s"):
            continue
        seen = max(r["measured_s"], r.get("interval_s") or 0.0)
        raw = predictor.predict(r["batch"], r["kv_tokens"], r["infer_sms"], True, raw=True)
        ratios[r["infer_sms"]].append(seen / raw)
    return ratios


def replay(
    predictor: LatencyPredictor,
    ladder: SMLadder,
    steps: list[tuple[int, int]],
    ratios: dict[int, list[float]],
    tpot_s: float,
    margin: float,
    seed: int,
    options: dict[str, bool] | None = None,
    micro_step_s: float = 0.005,
) -> dict[str, object]:
    """One replay of ``steps`` ((batch, KV tokens) each): shares taken, visits, steps over budget / objective,
    and the trainer's time-weighted mean SMs; ``options`` are Controller keywords (``settle``, ``learn_margin``)."""
    predictor.reset_corrections()
    now = [0.0]
    ctl = Controller(predictor, ladder, tpot_s, margin, clock=lambda: now[0], **(options or {}))
    if ctl.settle:
        ctl.observe_train_slice(micro_step_s)
    rng = random.Random(seed)
    measured_shares = sorted(ratios)
    taken, visits, over_budget, over_tpot, prev = Counter(), Counter(), 0, 0, None
    trainer_sm_s = 0.0
    for batch, kv_tokens in steps:
        d = ctl.decide(batch, kv_tokens)
        sms = d.partition.infer_sms
        near = min(measured_shares, key=lambda s: abs(s - sms))
        seen = predictor.predict(batch, kv_tokens, sms, d.corun, raw=True) * rng.choice(ratios[near])
        ctl.observe(d, seen)
        now[0] += seen
        trainer_sm_s += 0.0 if d.pause_trainer else (ladder.total_sms - sms) * seen
        taken[sms] += 1
        visits[sms] += sms != prev
        over_budget += seen > ctl.budget_s
        over_tpot += seen > tpot_s
        prev = sms
    return {
        "taken": taken,
        "visits": visits,
        "over_budget": over_budget,
        "over_tpot": over_tpot,
        "trainer_sms": trainer_sm_s / now[0] if now[0] else 0.0,
    }


def variants(options: list[str]) -> list[tuple[str, float | None, dict[str, bool]]]:
    """(name, the predictor's share_confirm (None: its own), Controller keywords) of each replayed variant."""
    out: list[tuple[str, float | None, dict[str, bool]]] = [
        ("visits confirm", None, {}),
        ("rule off", math.inf, {}),
    ]
    for text in options:
        parsed = parse_harli_options(text)
        unknown = sorted(set(parsed) - set(CONTROLLER_OPTIONS))
        if unknown:
            raise SystemExit(f"--options {text!r}: the replay honours only settle and margin, not {unknown}")
        out.append((text, None, {CONTROLLER_OPTIONS[k]: v for k, v in parsed.items()}))
    return out


def _median(runs: list[dict], key: str, share: int | None = None) -> float:
    """The median over the replays of a count (of one share's, with ``share``)."""
    return statistics.median(run[key][share] if share is not None else run[key] for run in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a bench_colocate result written with --keep-steps")
    ap.add_argument("--profile", required=True, help="the decode profile the run used (.json or .json.gz)")
    ap.add_argument("--policy", default="harli", help="the policy whose windows are replayed")
    ap.add_argument("--cells", default="", help="cells to replay (comma-separated; default: every one)")
    ap.add_argument("--seeds", type=int, default=5, help="replays per variant (their medians are printed)")
    ap.add_argument(
        "--options",
        default="",
        help="more variants: harli controller options, ';'-separated (settle=on;margin=learn)",
    )
    ap.add_argument(
        "--micro-step-ms", type=float, default=5.0, help="the trainer's micro-step (settle's cost)"
    )
    args = ap.parse_args()
    try:
        chosen = variants([o for o in args.options.split(";") if o])
    except ValueError as err:
        ap.error(f"--options: {err}")
    result, predictor = load(Path(args.result)), fitted(load(Path(args.profile)))
    rungs = result["setup"]["ladder"]["rungs"]
    total = max(r["infer_sms"] for r in rungs)
    step = min(r["infer_sms"] for r in rungs)
    ladder = SMLadder.cpu_standin(total, step, group_sms=8)
    margin = result["setup"]["margin"]
    wanted = {c for c in args.cells.split(",") if c}
    lines = []
    for objective, tpot_s, cells in windows(result):
        for cell, policies in cells.items():
            entry = policies.get(args.policy)
            if (wanted and cell not in wanted) or not isinstance(entry, dict) or "steps" not in entry:
                continue
            rows = rows_of(entry)
            steps = [(r["batch"], r["kv_tokens"]) for r in rows if r.get("kind") == "decode" and r["batch"]]
            ratios = share_ratios(predictor, rows)
            if not ratios:
                continue
            for variant, confirm, options in chosen:
                confirm = predictor.share_confirm if confirm is None else confirm
                kept, predictor.share_confirm = predictor.share_confirm, confirm
                runs = [
                    replay(
                        predictor, ladder, steps, ratios, tpot_s, margin, s, options, args.micro_step_ms / 1e3
                    )
                    for s in range(args.seeds)
                ]
                predictor.share_confirm = kept
                shares = sorted({s for run in runs for s in run["taken"]})
                lines.append(
                    [
                        f"{objective} {cell}",
                        variant,
                        "  ".join(
                            f"{s}: {_median(runs, 'taken', s):.0f}/{_median(runs, 'visits', s):.0f}"
                            for s in shares
                        ),
                        f"{_median(runs, 'over_budget'):.0f}",
                        f"{_median(runs, 'over_tpot'):.0f}",
                        f"{_median(runs, 'trainer_sms'):.1f}",
                        len(steps),
                    ]
                )
    header = [
        "cell",
        "variant",
        "share: steps/visits",
        "over budget",
        "over objective",
        "trainer SMs",
        "decode steps",
    ]
    print(common.table(lines, header))


if __name__ == "__main__":
    main()
