"""bench_colocate.py's command line: its flags, the policies ``--policies`` may name, and what the flags
decide for every window (``runtime_options``, ``harli_name``, ``harli_variants``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from colocate_load import TRACES

from harli_train import policy_names
from harli_train.colocate.runtime_options import RuntimeOptions
from harli_train.policy_names import is_policy

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POLICIES = ("harli", "static", "streams", "temporal")
# What --policies chooses from: exclusive runs by default only where nothing is clean (run_objective).
POLICIES = (*DEFAULT_POLICIES, "exclusive")


def runtime_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``RuntimeOptions`` fields the flags set, the same for every window. The trainer thread is on by
    default (a GPU's default; on the dry run's CPU the trainer then runs on the second core beside decode,
    where run between decode steps each of its micro-steps would count in the token intervals)."""
    return {
        "trainer_thread": args.trainer_thread != "off",
        "max_in_flight": args.max_in_flight,
        "refill": args.refill,
        "host_priority": not args.no_host_priority,
        "decode_core": args.decode_core,
        "scheduled_gc": args.gc == "scheduled",
    }


def trace_list(text: str) -> str:
    """``--trace``: one or more of TRACES, comma-separated, each once."""
    names = text.split(",")
    unknown = [n for n in names if n not in TRACES]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: name each of {', '.join(TRACES)} at most once")
    return text


def harli_name(args: argparse.Namespace) -> str:
    return f"harli:{args.harli_options}" if args.harli_options else "harli"


def policy_list(text: str) -> list[str]:
    """``--policies``' entries: comma-separated names, where an item ``key=value`` after a ``harli:`` entry
    is one more option of that variant (``harli,harli:window=0.1,launch=ahead,static``: three entries)."""
    out: list[str] = []
    for item in filter(None, text.split(",")):
        if "=" in item and ":" not in item and out and out[-1].startswith("harli:"):
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def harli_variants(args: argparse.Namespace) -> list[str]:
    """The ``harli:OPTIONS`` entries of ``--policies`` (canonical names), less the one ``--harli-options``
    names (that one runs as ``harli``): run in every cell right after ``harli``, each keyed by its name."""
    main = canonical_harli(harli_name(args))
    out = []
    for name in args.policies:
        if name.startswith("harli:") and canonical_harli(name) != main and canonical_harli(name) not in out:
            out.append(canonical_harli(name))
    return out


def canonical_harli(name: str) -> str:
    """A harli policy's name with its options in their canonical order and defaults left out."""
    return policy_names.harli_name(**policy_names.parse_harli_options(name.partition(":")[2]))


def parse_args(description: str = "") -> argparse.Namespace:
    """The flags of ``sys.argv``, checked (a bad one exits with a message that names it)."""
    ap = argparse.ArgumentParser(description=description)
    add = ap.add_argument
    add(
        "--dry-run",
        action="store_true",
        help="CPU: the quickstart's tiny model, stand-in ladder, ~1 s windows",
    )
    add("--recipe", default=None, help="default: recipes/llama-8b-lora.yaml (quickstart with --dry-run)")
    add(
        "--trace",
        default="steady",
        type=trace_list,
        help="steady, bursty or varying; several, comma-separated, share one set-up (their cells in turn)",
    )
    add(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override, as the command line takes them (e.g. train.cuda_graphs=true); repeatable",
    )
    add("--loads", default="light,medium,heavy", help="of steady and bursty (varying runs whole, at 1x)")
    add(
        "--objectives",
        "--tpot-ms",
        dest="objectives",
        default="auto:1.5,auto:2",
        help="comma-separated: TPOT objectives in ms, or auto:K (K x the whole GPU's step at the peak batch)",
    )
    add(
        "--ttft-ms",
        default="1000",
        help="the TTFT objective every policy is held to (colocation.ttft_ms: backlogs of prompts drained on "
        "the whole GPU in time) and judged by (clean needs 99%% of requests' TTFT, or wait so far, within it); "
        "'none': TPOT alone",
    )
    add(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"among {', '.join(POLICIES)} (exclusive: the engine alone, in every cell), harli:OPTIONS (a variant "
        "of harli run right after it in every cell, keyed by its own name: an A/B on one set-up; its options "
        "continue it: harli,harli:window=0.1,launch=ahead), or 'none' (standalone only)",
    )
    add("--harli-options", default="", help="harli's options (e.g. prefill=paused,grow=0.1); keyed 'harli'")
    add("--min-window-s", type=float, default=15.0, help="a GPU window's least length")
    add("--min-requests", type=int, default=50, help="the least arrivals in a GPU window")
    add("--min-rungs", type=int, default=3, help="static splits run per cell at least")
    add("--max-rungs", type=int, default=6, help="static splits run per cell at most")
    add("--solo-s", type=float, default=None, help="seconds per standalone rate (default 5; 0.5 dry)")
    add(
        "--profile",
        default=None,
        help="decode profile file: reused when it matches, else measured and written",
    )
    add(
        "--standalone",
        default=None,
        help="standalone rates file: reused when it exists, else measured and written",
    )
    add("--keep-steps", type=int, default=0, help="step records kept per window in the JSON")
    add(
        "--repeats",
        type=int,
        default=1,
        help="windows per policy and cell: the row is the median one by finetune tokens/s when all are clean, "
        "else the one that violated most (its row lists every window's figures)",
    )
    add(
        "--whole-gpu-now",
        action="store_true",
        help="measure the trainer alone on the whole GPU in this call too (--repeats times, the median): the "
        "light bar divides by it, not by the --standalone file's",
    )
    add(
        "--live-fraction",
        type=float,
        default=0.0,
        help="this share of the requests on the adapter being trained (served live, refreshed every step)",
    )
    add("--time-budget-s", type=float, default=570.0, help="no window starts that would end past this")
    add(
        "--sweep-start",
        type=int,
        default=None,
        help="static without harli: the sweep starts at the least split giving decode at least this many SMs "
        "(a matrix's sweep_start); with harli it starts where harli's peak needs",
    )
    add(
        "--memory-pool",
        choices=("on", "off"),
        default="off",
        help="the page pool (the recipe's default) or torch's allocator with a fixed KV cache: a sweep warms "
        "the trainer on most rungs' streams, and the pool's MemPool keeps each stream's cache for the "
        "process's life (torch's cache is emptied between windows)",
    )
    add("--ladder-step", type=int, default=None, help="SMs between splits (default: the recipe's)")
    add(
        "--trainer-thread",
        choices=("on", "off"),
        default="on",
        help="the trainer's launches off decode's thread",
    )
    add("--max-in-flight", type=int, default=RuntimeOptions().max_in_flight)
    add(
        "--refill",
        action="store_true",
        help="A/B: the trainer thread launches the next micro-step as a queued one ends, between plans",
    )
    add(
        "--no-host-priority",
        action="store_true",
        help="diagnosis: the trainer's launches never wait for decode's",
    )
    add(
        "--decode-core",
        action="store_true",
        help="A/B: while serving, the decode thread alone on a CPU core, the other threads on the rest",
    )
    add(
        "--gc",
        choices=("scheduled", "automatic"),
        default="scheduled",
        help="Python's collector: run by the decode thread where it waits (default), or CPython's own (A/B)",
    )
    add("--sample-stalls", action="store_true", help="diagnosis: thread stacks inside decode's host stalls")
    args = ap.parse_args()
    args.recipe = Path(
        args.recipe or ROOT / "recipes" / ("quickstart.yaml" if args.dry_run else "llama-8b-lora.yaml")
    )
    args.policies = [] if args.policies == "none" else policy_list(args.policies)
    args.objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    args.solo_s = args.solo_s or (0.5 if args.dry_run else 5.0)
    bad = [p for p in args.policies if p not in POLICIES and not (p.startswith("harli:") and is_policy(p))]
    if bad:
        ap.error(
            f"--policies: among {', '.join(POLICIES)}, harli:OPTIONS (a variant run beside harli) or 'none', "
            f"got {','.join(bad)}"
        )
    if "static" in args.policies and "harli" not in args.policies and args.sweep_start is None:
        ap.error(
            "--policies: static needs harli (the sweep starts at the split harli's peak needs) or --sweep-start"
        )
    if args.repeats < 1:
        ap.error(f"--repeats: want at least 1 window, got {args.repeats}")
    if args.sweep_start is not None and args.sweep_start < 1:
        ap.error(f"--sweep-start: want decode SMs >= 1, got {args.sweep_start}")
    if not 0 <= args.live_fraction <= 1:
        ap.error(f"--live-fraction: want a share in [0, 1], got {args.live_fraction}")
    for text in args.objectives:
        if not _objective_ok(text):
            ap.error(f"--objectives {text!r}: want milliseconds > 0 or auto:K with K > 1")
    if args.ttft_ms.strip().lower() == "none":
        args.ttft_ms = None
    elif not _objective_ok(args.ttft_ms):
        ap.error(f"--ttft-ms {args.ttft_ms!r}: want milliseconds > 0 or 'none'")
    else:
        args.ttft_ms = float(args.ttft_ms)
    return args


def _objective_ok(text: str) -> bool:
    try:
        return float(text[5:]) > 1 if text.startswith("auto:") else float(text) > 0
    except ValueError:
        return False
