"""What a co-location window's slow launches and sampled stalls say, in lines (no GPU needed).

- ``slow_launches``: engine steps whose launch took over ``min_s`` on the host (``launch_s``), with the part
  until the model's forward was queued (``forward_launch_s``). Launched ahead, such a launch delays the
  tokens of the step before it, so every row of that step may violate.
- ``sampled_stalls``: for each span ``bench/stall_sampler.py`` sampled (``--sample-stalls``), the frame the
  decode thread was caught in most, how late the sampler woke at most (a late wake-up: the GIL held, or the
  process descheduled; on time with the decode thread in one frame: a call that released the GIL blocked),
  and the other threads' most common frames.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

DECODE_THREAD = "MainThread"


def slow_launches(rows: list[dict[str, Any]], min_s: float = 3e-3) -> list[str]:
    def ms(row: dict, key: str) -> str:
        return "-" if row.get(key) is None else f"{1e3 * row[key]:.1f}"

    return [
        f"t={r['t']:.3f} {r['kind']} batch {r.get('batch')} on {r.get('infer_sms')} SMs: launch {ms(r, 'launch_s')} ms"
        f" (forward {ms(r, 'forward_launch_s')}), GPU {ms(r, 'gpu_s')}, prefill tokens {r.get('prefill_tokens')}"
        for r in rows
        if r.get("kind") != "prefill" and (r.get("launch_s") or 0.0) > min_s
    ]


def sampled_stalls(spans: list[dict[str, Any]], min_span_s: float = 5e-3) -> list[str]:
    """One line per sampled span of at least ``min_span_s``."""
    lines = []
    for span in spans:
        start, end = span["span"]
        samples = span.get("samples") or []
        if end - start < min_span_s:
            continue
        if not samples:
            after = span.get("after") or {}
            lines.append(
                f"{start:.3f}-{end:.3f} s: no sample inside; the next woke {after.get('late_ms', '-')} ms late "
                "(the GIL held, or the process descheduled)"
            )
            continue
        decode = Counter(_top(s, DECODE_THREAD) for s in samples)
        others = Counter(
            f"{name}: {stack[0]}"
            for s in samples
            for name, stack in s["stacks"].items()
            if name != DECODE_THREAD and stack
        )
        frame, count = decode.most_common(1)[0]
        late = max(s["late_ms"] for s in samples)
        other = "; ".join(f"{f} ({n})" for f, n in others.most_common(2))
        lines.append(
            f"{start:.3f}-{end:.3f} s: decode thread in {frame} ({count} of {len(samples)} samples), sampler "
            f"late by {late:.1f} ms at most; others: {other or '-'}"
        )
    return lines


def _top(sample: dict[str, Any], thread: str) -> str:
    stack = sample["stacks"].get(thread) or ["-"]
    return stack[0]
