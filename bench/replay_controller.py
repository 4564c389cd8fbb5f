"""Replay a window's decode steps through harli offline (no GPU): the shares it takes, the rungs it puts the
trainer on, and the steps that run over the budget and the objective.

    python bench/replay_controller.py RESULT.json[.gz] --profile PROFILE.json[.gz] \\
        [--policy harli] [--as harli:grow=0.05] [--cells steady/heavy] [--seeds 5] [--draws ordered] \\
        [--options "grow=0;window=0.05"] [--margins 0.12,0.10]

Reads a bench_colocate result written with ``--keep-steps`` and the decode profile its run used (for a cell
with adapter rows, the profile with its adapter steps: the one the run returned). Each decode step of
``--policy``'s window, in order (its batch, KV tokens and adapters; mixed and prefill steps are left out), is
planned again by a fresh harli policy (``--as``, default the variant the run ran: the policy a run builds from
that name under the defaults of the run's day, ``harli_defaults.as_ran``, so its controller, grow headroom and
trainer rungs all apply) held to the window's objective and the run's margin (``--margins``: each listed margin
too, as a variant). A step on share s is "measured" as its raw prediction there times a ratio from those the
window's own steps on s showed (what the policy learnt from, max(step latency, token interval), over the raw
prediction): ``--draws ordered`` (the default) takes them in the window's order from a seeded starting point,
so runs of slow steps stay runs; ``iid`` draws each at random. A share the window never ran on takes the
ratios of the nearest share it did. Each step is replayed with the kinds of micro-step the trainer had on the
GPU as the run planned it (the ``trainer_queue`` of the record before it), which the policy sees
(``harli:neighbour=on`` sizes by them), and draws from the ratios the window's steps on that share showed
beside the same kinds, where there are ``KIND_MIN`` of them (else from the share's). A replay shows how the
policy's rules move decode and the trainer over the ladder against the same load and the same per-share
errors, not what a GPU run would measure: the errors do not depend on what came before them here, and no
mixed step restarts the hysteresis.

Variants: the share-visit rule on and off, each ``--options`` entry (harli's options, comma-joined) added to
the replayed policy, and the replayed policy held at each of ``--margins`` (``margin=fixed``). A replay's
clock is the sum of its steps' "measured" times (the trainer's window and ``settle``'s dwell run on it);
``settle`` weighs a shrink against ``--micro-step-ms`` of queued trainer work.

Printed last, per cell: the run's own steps on each share, then per variant (the medians over the seeds):
steps on each share, visits to each (steps on it after a step elsewhere), steps over the budget and over
the objective, the token intervals over the objective (each step's rows: the bar's unit) and their rate,
the trainer's mean SMs over the decode steps' time on the rungs harli launched it on, and the SMs decode
left it (the gap is the trainer's trail of decode's recent peak and the grow headroom; the cost of a
switch is not in either).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from colocate_matrix import load  # noqa: E402
from harli_defaults import as_ran  # noqa: E402
from replan_mixed import fitted  # noqa: E402
from step_measures import decode_beside, rows_of, windows  # noqa: E402

from harli_train.colocate.policy import BESIDE, HarliPolicy, make_policy  # noqa: E402
from harli_train.colocate.predictor import LatencyPredictor  # noqa: E402
from harli_train.colocate.sm import SMLadder  # noqa: E402
from harli_train.engine.step_work import StepPreview  # noqa: E402
from harli_train.policy_names import parse_harli_options  # noqa: E402

DRAWS = ("iid", "ordered")
KIND_MIN = 8  # a share's ratios beside one set of the trainer's kinds are drawn from once this many are in


def both_ratios(
    predictor: LatencyPredictor, rows: list[dict]
) -> tuple[dict[int, list[float]], dict[tuple, list[float]]]:
    """Per share, in the window's order, what its decode steps beside the trainer took over their raw
    prediction; and the same per (share, the trainer's kinds on the GPU as the step was planned:
    ``planned_kinds``), from one pass over the window."""
    by_share: dict[int, list[float]] = defaultdict(list)
    by_kinds: dict[tuple, list[float]] = defaultdict(list)
    for (sms, kinds), ratio in _ratios(predictor, rows):
        by_share[sms].append(ratio)
        by_kinds[(sms, kinds)].append(ratio)
    return by_share, by_kinds


def _ratios(predictor: LatencyPredictor, rows: list[dict]) -> list[tuple[tuple, float]]:
    """((share, planned kinds), seen / raw prediction) of each decode step beside the trainer, in order."""
    kinds = planned_kinds(rows)
    out = []
    for r in decode_beside(rows):
        seen = max(r["measured_s"], r.get("interval_s") or 0.0)
        raw = predictor.predict(
            r["batch"], r["kv_tokens"], r["infer_sms"], True, raw=True, lora_slots=adapter_slots(r)
        )
        out.append(((r["infer_sms"], kinds[id(r)]), seen / raw))
    return out


def planned_kinds(rows: list[dict]) -> dict[int, tuple[str, ...]]:
    """By ``id`` of each record: the kinds of micro-step the trainer had on the GPU as the step was planned,
    sorted and once each (the ``trainer_queue`` of the record before it: a step is planned while the one
    before it runs)."""
    out, before = {}, ""
    for r in rows:
        out[id(r)] = tuple(sorted({k for k in before.split("+") if k}))
        before = r.get("trainer_queue") or ""
    return out


def adapter_slots(row: dict) -> int:
    """The adapters a decode step's rows ran on, as the predictor counts them: 1 when any row ran on one
    (the column counts rows, not distinct adapters; a live-adapter cell has one), else 0."""
    return 1 if row.get("adapter_rows") else 0


class RatioDraws:
    """The ratio a replayed step on a share takes: drawn at random from that share's (``iid``), or the next
    of that share's in the window's order from a seeded starting point, wrapping round (``ordered``: runs
    of slow steps stay runs). A share the window never ran on takes the nearest share's. With ``by_kinds``
    (``both_ratios``), a step planned beside a set of kinds draws from that share's ratios beside the same
    set where there are ``KIND_MIN`` of them."""

    def __init__(
        self,
        ratios: dict[int, list[float]],
        seed: int,
        draws: str = "iid",
        by_kinds: dict[tuple, list[float]] | None = None,
    ) -> None:
        if draws not in DRAWS:
            raise ValueError(f"draws must be one of {DRAWS}, got {draws!r}")
        self.ratios, self.draws, self.rng = ratios, draws, random.Random(seed)
        self.by_kinds = {k: r for k, r in (by_kinds or {}).items() if len(r) >= KIND_MIN}
        self.next = {s: self.rng.randrange(len(r)) for s, r in [*ratios.items(), *self.by_kinds.items()]}

    def __call__(self, sms: int, kinds: tuple[str, ...] = ()) -> float:
        near = min(self.ratios, key=lambda s: abs(s - sms))
        key = (near, kinds) if (near, kinds) in self.by_kinds else near
        seq = self.by_kinds[key] if key != near else self.ratios[near]
        if self.draws == "iid":
            return self.rng.choice(seq)
        i = self.next[key]
        self.next[key] = (i + 1) % len(seq)
        return seq[i]


def replay(
    predictor: LatencyPredictor,
    ladder: SMLadder,
    steps: list[tuple[int, ...]],
    ratios: dict[int, list[float]],
    tpot_s: float,
    margin: float,
    seed: int,
    policy: str = "harli",
    micro_step_s: float = 0.005,
    draws: str = "iid",
    by_kinds: dict[tuple, list[float]] | None = None,
) -> dict[str, object]:
    """One replay of ``steps`` ((batch, KV tokens[, adapters[, the trainer's kinds on the GPU]]) each,
    ``adapter_slots``, ``planned_kinds``; ``by_kinds``: ``RatioDraws``') through a fresh
    ``policy`` (harli[:options], the policy a run builds, so every option of its decode steps applies: the
    controller's, the grow headroom, the trainer's rungs and their window): shares taken, visits, steps
    over budget / objective, the token intervals over the objective (a step's rows, each a running
    request's interval) and their share of all (the bar's ``violation_rate``), the trainer's time-weighted
    mean SMs on the rungs the policy launched it on, and the SMs decode left it."""
    predictor.reset_corrections()
    now = [0.0]
    pol = make_policy(policy, ladder, predictor, tpot_s, margin)
    if not isinstance(pol, HarliPolicy):
        raise ValueError(f"the replay runs harli's decode steps, not {policy!r}")
    pol.controller.clock = pol.rungs.clock = lambda: now[0]
    pol.observe_train_slice(micro_step_s)
    draw = RatioDraws(ratios, seed, draws, by_kinds)
    beside: list[tuple[str, ...]] = [()]
    pol.trainer_on_gpu = lambda: beside[0]
    taken, visits, over_budget, over_tpot, prev = Counter(), Counter(), 0, 0, None
    intervals = intervals_over = 0
    trainer_sm_s = left_sm_s = 0.0
    for batch, kv_tokens, *more in steps:
        lora = more[0] if more else 0
        beside[0] = more[1] if len(more) > 1 else ()
        preview = StepPreview(
            decode_seqs=batch, decode_kv_tokens=kv_tokens, decode_adapters=frozenset(range(1, lora + 1))
        )
        plan = pol.plan(preview)
        sms = plan.partition.infer_sms
        d = plan.decision
        corun = d is None or d.corun
        seen = predictor.predict(batch, kv_tokens, sms, corun, raw=True, lora_slots=lora) * draw(
            sms, beside[0]
        )
        pol.observe(plan, seen)
        now[0] += seen
        if plan.train == BESIDE:
            trainer_sm_s += plan.train_sms * seen
            left_sm_s += (ladder.total_sms - sms) * seen
        taken[sms] += 1
        visits[sms] += sms != prev
        over_budget += seen > pol.controller.budget_s
        over_tpot += seen > tpot_s
        intervals += batch  # one token interval per running request
        intervals_over += batch * (seen > tpot_s)
        prev = sms
    return {
        "taken": taken,
        "visits": visits,
        "over_budget": over_budget,
        "over_tpot": over_tpot,
        "intervals_over_tpot": intervals_over,
        "violation_rate": intervals_over / intervals if intervals else 0.0,
        "trainer_sms": trainer_sm_s / now[0] if now[0] else 0.0,
        "left_sms": left_sm_s / now[0] if now[0] else 0.0,
    }


def variants(
    base: str, options: list[str], margins: Sequence[float] = ()
) -> list[tuple[str, float | None, str, float | None]]:
    """(name, the predictor's share_confirm (None: its own), policy name, fixed margin (None: the run's)) of
    each replayed variant: ``base`` with the share-visit rule on and off, then ``base`` with each of
    ``options`` (harli's options, comma-joined) added, then ``base`` held at each of ``margins``
    (``margin=fixed``)."""
    parse_harli_options(base.partition(":")[2])  # a bad base fails here, by name
    out: list[tuple[str, float | None, str, float | None]] = [
        ("visits confirm", None, base, None),
        ("rule off", math.inf, base, None),
    ]
    for text in options:
        parse_harli_options(text)
        out.append((text, None, _with_options(base, text), None))
    fixed = _with_options(base, "margin=fixed")
    for margin in margins:
        if not 0 <= margin < 1:
            raise ValueError(f"a margin is in [0, 1), got {margin:g}")
        out.append((f"margin {margin:g}", None, fixed, margin))
    return out


def _with_options(base: str, text: str) -> str:
    """The harli variant ``base`` with the options ``text`` (comma-joined) added after its own."""
    return f"{base},{text}" if ":" in base else f"{base}:{text}"


def _median(runs: list[dict], key: str, share: int | None = None) -> float:
    """The median over the replays of a count (of one share's, with ``share``)."""
    return statistics.median(run[key][share] if share is not None else run[key] for run in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a bench_colocate result written with --keep-steps")
    ap.add_argument("--profile", required=True, help="the decode profile the run used (.json or .json.gz)")
    ap.add_argument("--policy", default="harli", help="the policy whose windows are replayed")
    ap.add_argument(
        "--as", dest="base", default="", help="the harli variant replayed (default: the one the run ran)"
    )
    ap.add_argument("--cells", default="", help="cells to replay (comma-separated; default: every one)")
    ap.add_argument("--seeds", type=int, default=5, help="replays per variant (their medians are printed)")
    ap.add_argument("--draws", choices=DRAWS, default="ordered", help="how a step's ratio is drawn")
    ap.add_argument(
        "--options",
        default="",
        help="more variants: harli options added to the replayed one, ';'-separated (grow=0;window=0.05)",
    )
    ap.add_argument(
        "--margins",
        default="",
        help="more variants: the replayed policy at each of these fixed margins (comma-separated)",
    )
    ap.add_argument(
        "--micro-step-ms", type=float, default=5.0, help="the trainer's micro-step (settle's cost)"
    )
    args = ap.parse_args()
    options = [o for o in args.options.split(";") if o]
    try:
        margins = [float(m) for m in args.margins.split(",") if m]
    except ValueError:
        ap.error(f"--margins: comma-separated numbers, got {args.margins!r}")
    try:
        variants("harli", options, margins)
    except ValueError as err:
        ap.error(f"--options / --margins: {err}")
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
            decode = [r for r in rows if r.get("kind") == "decode" and r["batch"]]
            kinds = planned_kinds(rows)
            steps = [(r["batch"], r["kv_tokens"], adapter_slots(r), kinds[id(r)]) for r in decode]
            ratios, by_kinds = both_ratios(predictor, rows)
            if not ratios:
                continue
            ran = Counter(r["infer_sms"] for r in decode)
            lines.append(
                [f"{objective} {cell}", "the run", "  ".join(f"{s}: {n}" for s, n in sorted(ran.items()))]
                + ["-"] * 5
                + [sum(ran.values())]
            )
            # the variant the run ran, restated under today's defaults (harli_defaults.as_ran)
            base = args.base or as_ran(entry.get("policy") or args.policy, result["setup"])
            if base.partition(":")[0] != "harli":
                ap.error(f"the replay runs harli's decode steps, not {base!r} (--as names a harli variant)")
            for variant, confirm, policy, at in variants(base, options, margins):
                confirm = predictor.share_confirm if confirm is None else confirm
                kept, predictor.share_confirm = predictor.share_confirm, confirm
                runs = [
                    replay(
                        predictor,
                        ladder,
                        steps,
                        ratios,
                        tpot_s,
                        margin if at is None else at,
                        s,
                        policy,
                        args.micro_step_ms / 1e3,
                        args.draws,
                        by_kinds,
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
                        f"{_median(runs, 'intervals_over_tpot'):.0f} ({_median(runs, 'violation_rate'):.4f})",
                        f"{_median(runs, 'trainer_sms'):.1f}",
                        f"{_median(runs, 'left_sms'):.1f}",
                        len(steps),
                    ]
                )
    header = [
        "cell",
        "variant",
        "share: steps/visits",
        "over budget",
        "over objective",
        "intervals over (rate)",
        "trainer SMs",
        "SMs decode left",
        "decode steps",
    ]
    print(common.table(lines, header))


if __name__ == "__main__":
    main()
