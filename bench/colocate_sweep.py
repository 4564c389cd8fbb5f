"""Which fixed splits the co-location bench runs: a sweep around each cell's predicted split that brackets
the best clean one, and the top-ups that give each trace its best single split.

Shares are the decode SM counts of the ladder's splits (``static:N``), ascending. A larger share leaves the
trainer fewer SMs: its tokens/s falls while decode's steps get faster. The sweep and the top-ups lean on
that order: below a split that was not clean in a cell, none is taken to be clean there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Row = dict[str, Any]


def clean(row: Row) -> bool:
    return "error" not in row and bool(row.get("clean"))


def peak_step(rows: list[Row]) -> Row | None:
    """The step row with the largest decode batch (the most KV tokens among those), None without one."""
    decode = [r for r in rows if r.get("kind") in ("decode", "mixed") and r.get("batch")]
    return max(decode, key=lambda r: (r["batch"], r.get("kv_tokens") or 0), default=None)


def start_share(
    rows: list[Row],
    shares: list[int],
    predict: Callable[[int, int, int, int], float],
    budget_s: float,
    prefill_tokens: int = 0,
) -> int:
    """The split the profile predicts for a window's observed peak: the least share whose predicted step beside
    the trainer (``predict(batch, kv_tokens, share, prefill_tokens)``) at the peak step of ``rows``, carrying
    ``prefill_tokens`` (what a step must compute for prefill to keep up with the load's prompts), is within
    ``budget_s``; the largest share when none is, the middle one when ``rows`` hold no decode step."""
    peak = peak_step(rows)
    if peak is None:
        return shares[len(shares) // 2]
    for share in shares:
        if predict(peak["batch"], peak.get("kv_tokens") or 0, share, prefill_tokens) <= budget_s:
            return share
    return shares[-1]


def prefill_per_step(arrivals: list[tuple[float, int]], step_s: float, span_s: float = 10.0) -> int:
    """The prompt tokens a step of ``step_s`` must compute for prefill to keep up with the busiest ``span_s``
    of ``arrivals`` ((seconds, prompt tokens) each; the whole of them when they span less): a fixed split
    must keep up with a load's peak, not its mean. 0 without arrivals."""
    if not arrivals:
        return 0
    times = sorted(arrivals)
    span = max(min(span_s, times[-1][0] - times[0][0]), step_s)
    busiest, lo, tokens = 0, 0, 0
    for t, n in times:
        tokens += n
        while times[lo][0] < t - span:
            tokens -= times[lo][1]
            lo += 1
        busiest = max(busiest, tokens)
    return round(busiest / span * step_s)


def sweep(
    shares: list[int],
    start: int,
    run: Callable[[int], Row],
    min_rungs: int = 3,
    max_rungs: int | None = None,
) -> dict[int, Row]:
    """Run fixed splits around ``start`` (``run(share)`` returns the window's row) and return them by share.

    Down one share at a time while the last one run is clean (until one is not, or the smallest); up one
    share at a time until a clean one trains no faster than the best clean one before it (one past the best;
    while none is clean, on up to the largest); then outward until ``min_rungs`` have run. ``max_rungs``
    caps the whole sweep. The best clean split then has its neighbours run, or is at an end of the ladder.
    """
    cap = len(shares) if max_rungs is None else min(max_rungs, len(shares))
    ran: dict[int, Row] = {}

    def go(i: int) -> Row:
        ran[shares[i]] = run(shares[i])
        return ran[shares[i]]

    first = shares.index(start)
    row, i = go(first), first
    while clean(row) and i > 0 and len(ran) < cap:
        i -= 1
        row = go(i)
    i = first
    while i + 1 < len(shares) and len(ran) < cap:
        before = max((r["finetune_tokens_per_s"] for r in ran.values() if clean(r)), default=None)
        i += 1
        row = go(i)
        if clean(row) and before is not None and row["finetune_tokens_per_s"] <= before:
            break
    while len(ran) < min(min_rungs, cap):
        lo, hi = shares.index(min(ran)), shares.index(max(ran))
        go(lo - 1 if lo > 0 and (clean(ran[shares[lo]]) or hi + 1 == len(shares)) else hi + 1)
    return ran


def no_split_clean(ran: dict[int, Row] | None, shares: list[int]) -> bool:
    """Whether a cell's sweep (``ran``: its rows by share) ran the largest split that leaves the trainer SMs
    (the last of ``shares``, the spatial splits) and found no clean split at all."""
    return bool(ran) and shares[-1] in ran and not any(clean(r) for r in ran.values())


def single_split(ran: dict[str, dict[int, Row]], shares: list[int]) -> int | None:
    """The split to run in every cell of a trace (``ran``: each cell's rows by share) for its best single
    split: the least share above the largest one that was not clean in any cell. None when that is past the
    largest share (no split can be clean everywhere)."""
    failed = [s for rows in ran.values() for s, row in rows.items() if not clean(row)]
    above = [s for s in shares if s > max(failed, default=0)]
    return above[0] if above else None


def top_up(ran: dict[str, dict[int, Row]], shares: list[int], run: Callable[[str, int], Row]) -> list[str]:
    """Run the single split (``single_split``) in every cell that has not run it (``run(cell, share)``), and
    again for the next one up while the one run fails somewhere. Returns what ran, as 'cell static:N'."""
    done = []
    while (share := single_split(ran, shares)) is not None:
        missing = [cell for cell, rows in ran.items() if share not in rows]
        if not missing:
            break
        for cell in missing:
            ran[cell][share] = run(cell, share)
            done.append(f"{cell} static:{share}")
    return done
