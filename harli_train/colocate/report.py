"""What a co-located run reports: the summary JSON and two PNG plots (matplotlib, Agg backend).

The objective figures (``serving``) are the clients': every token interval of every request and each
request's own TPOT, counted by ``accounting.objective_stats`` with nothing left out. The step rows' interval
(one step's token-producing end to the next) is what the plots show and the policy learns from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

MAX_PLOT_POINTS = 20_000


def objective_text(stats: dict[str, Any]) -> str:
    """How the console shows ``accounting.objective_stats`` (the live line and the run's last line alike): the
    statistic, its window and the figures, e.g. "TPOT p50/p99 over 12 requests so far 10.2/18.9 ms, 3 of 940
    token intervals over 20 ms"."""
    tpot, n = stats["tpot_ms"], stats["requests_judged"]
    figures = "-" if not n else f"{tpot['p50']:.1f}/{tpot['p99']:.1f} ms"
    return (
        f"TPOT p50/p99 over {n} request{'' if n == 1 else 's'} so far {figures}, {stats['violations']} of "
        f"{stats['intervals']} token intervals over {stats['objective_tpot_ms']:g} ms"
    )


def build_summary(
    rt: Any, serving: dict[str, Any], trained: dict[str, Any], aborted: int, end_tokens: float
) -> dict[str, Any]:
    """The run's summary from the runtime's streaming statistics and the engine's request records."""
    tally = rt.tally
    phases = tally.phases(end_tokens)
    tpot_ms = rt.tpot_s * 1e3
    objective = rt.objective()  # every request recorded by now (those cut off at the end included)
    duration = tally.duration_s
    feed = rt.worker.stats()
    total_tokens = end_tokens - rt.start_tokens
    serve = phases.get("serve", {"seconds": 0.0, "finetune_tokens": 0.0, "finetune_tokens_per_s": 0.0})
    ladder = rt.policy.ladder
    memory = dict(rt.info.get("memory", {}))
    pool = rt.hook.summary() if rt.hook is not None and hasattr(rt.hook, "summary") else None
    if pool is not None:
        memory["pool"] = pool
    memory.setdefault("pool", {"enabled": False, "reason": "this run was given no page pool"})
    return {
        "policy": rt.policy.name,
        "objective": {
            "tpot_ms": tpot_ms,
            "margin": rt.policy.margin,  # as configured: a learnt margin's start (policy_detail: its range)
            "margin_learned": rt.policy.margin_learned,
            "budget_ms": rt.policy.budget_s * 1e3,  # in force at the end
            "ttft_ms": None if rt.policy.ttft_s is None else rt.policy.ttft_s * 1e3,
            "violation": "a token interval of a request (one of its tokens to its next) > tpot_ms",
        },
        "stop_reason": rt.stop_reason,
        "duration_s": duration,
        "ladder": {"kind": ladder.kind, "total_sms": ladder.total_sms, "shares": ladder.shares},
        **rt.info,
        **live_adapter_figures(rt),
        "finetune": {
            "tokens_per_s": serve["finetune_tokens_per_s"],  # while serving the load: the co-location figure
            "tokens_per_s_overall": total_tokens / duration if duration > 0 else 0.0,
            "solo_tokens_per_s": phases.get("solo", {}).get("finetune_tokens_per_s"),
            "tokens": total_tokens,
            "steps_run": trained.get("steps", 0) - rt.start_step,
            "micro_steps": feed["micro_steps"],
            "oom_recoveries": feed["oom_recoveries"],
            "abandoned_steps": feed["abandoned_steps"],
            "rebuilt_backward_chunks": feed["rebuilt_chunks"],
            "micro_step_ms": feed["ewma_micro_step_ms"],
            "feed": feed,
        },
        "serving": {
            "requests": serving.get("requests"),
            "refused": serving.get("refused"),
            "aborted_at_end": aborted,
            "output_tokens": serving.get("output_tokens"),
            "output_tokens_per_s": serving.get("output_tokens_per_s"),
            **{
                k: objective[k]
                for k in ("violations", "violation_rate", "tpot_attainment", "tpot_clean", "clean")
            },
            "intervals": objective["intervals"],
            "requests_judged": objective["requests_judged"],
            "requests_missing_tpot": objective["requests_missing_tpot"],
            "ttft_ms": objective["ttft_ms"],
            "requests_without_first_token": objective["requests_without_first_token"],
            **{k: objective[k] for k in ("objective_ttft_ms", "ttft_attainment") if k in objective},
            "tpot_ms": objective["tpot_ms"],
            "token_interval_ms": objective["token_interval_ms"],
            "preemptions": objective["preemptions"],
            # Steps that ran out of memory and ran again once the trainer had released its memory.
            "decode_oom_recoveries": rt.decode_oom_recoveries,
            "decode_oom_s": rt.decode_oom_s,
            "longest_wait": objective["longest_wait"],
            "decode_step_ms": serving.get("decode_step_ms"),
            "mixed_step_ms": serving.get("mixed_step_ms"),
            "prefill_step_ms": serving.get("prefill_step_ms"),
            "decode_batch": serving.get("decode_batch"),
            **tally.step_counts(),
        },
        "memory": memory,
        "objective_stats": objective,
        "gc_pauses": rt.gc_pauses.summary(),  # Python's collector holds the GIL: it stalls decode steps
        **tally.share_figures(),
        "phases": phases,
        "policy_detail": rt.policy.summary(),
        "trainer": trained,
        "files": {
            "steps": str(rt.out_dir / "steps.jsonl"),
            "requests": str(rt.out_dir / "serve" / "requests.jsonl"),
        },
    }


def read_steps(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _thin(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stride = max(1, len(rows) // MAX_PLOT_POINTS)
    return rows[::stride]


def _pool_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Pages each tenant of the page pool holds over time, and when the trainer gave pages back."""
    t = [r["t"] for r in rows]
    ax.step(t, [r["kv_pages"] for r in rows], where="post", color="tab:blue", label="KV cache pages")
    ax.step(t, [r["trainer_pages"] for r in rows], where="post", color="tab:green", label="trainer pages")
    marks = [b["t"] for a, b in zip(rows, rows[1:], strict=False) if b["reclaims"] > a["reclaims"]]
    if marks:
        ax.plot(marks, [0] * len(marks), "^", color="tab:red", ms=5, label=f"reclaims ({len(marks)} steps)")
    ax.set_ylabel("pool pages")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper right", fontsize=8, ncol=3)


def write_plots(out_dir: str | Path, tpot_s: float, budget_s: float, title: str = "") -> dict[str, str]:
    """timeline.png (SM share, batch, step latency against the objective and, with the page pool, pages per
    tenant) and throughput.png; paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    rows = read_steps(out_dir / "steps.jsonl")
    decode = _thin([r for r in rows if r["kind"] in ("decode", "mixed")])
    files = {"timeline": str(out_dir / "timeline.png"), "throughput": str(out_dir / "throughput.png")}

    pooled = [r for r in _thin(rows) if "kv_pages" in r]
    panels = 4 if pooled else 3
    fig, axes = plt.subplots(panels, 1, figsize=(11, 8 + 2.5 * (panels - 3)), sharex=True)
    ax_share, ax_batch, ax_lat = axes[:3]
    t = [r["t"] for r in decode]
    ax_share.step(t, [r["infer_sms"] for r in decode], where="post", label="decode SMs", color="tab:blue")
    ax_share.step(t, [r["train_sms"] for r in decode], where="post", label="trainer SMs", color="tab:green")
    paused = [r["t"] for r in decode if r.get("paused")]
    if paused:
        ax_share.plot(paused, [0] * len(paused), "|", color="tab:red", label="trainer paused")
    ax_share.set_ylabel("SMs")
    ax_share.legend(loc="upper right", fontsize=8)
    ax_batch.plot(t, [r["batch"] for r in decode], color="tab:purple", lw=1, label="batch")
    ax_batch.set_ylabel("decode batch")
    ax_kv = ax_batch.twinx()
    ax_kv.plot(t, [r["kv_tokens"] / 1e3 for r in decode], color="tab:gray", lw=0.8, alpha=0.6)
    ax_kv.set_ylabel("KV tokens (k)", color="tab:gray")
    ms = lambda v: None if v is None else v * 1e3
    lat = [ms(r.get("interval_s") or r["measured_s"]) for r in decode]
    ax_lat.plot(t, lat, lw=0.8, color="tab:blue", label="token interval")
    ax_lat.plot(t, [ms(r["measured_s"]) for r in decode], lw=0.6, color="tab:cyan", alpha=0.7, label="step")
    pred = [(r["t"], ms(r["predicted_s"])) for r in decode if r.get("predicted_s") is not None]
    if pred:
        ax_lat.plot(*zip(*pred, strict=True), lw=0.6, ls="--", color="tab:orange", label="predicted")
    ax_lat.axhline(tpot_s * 1e3, color="tab:red", lw=1.2, label=f"objective {tpot_s * 1e3:g} ms")
    ax_lat.axhline(budget_s * 1e3, color="tab:red", lw=0.8, ls=":", label="budget (margin)")
    bad = [(r["t"], ms(r.get("interval_s") or r["measured_s"])) for r in decode if r.get("violated")]
    if bad:
        ax_lat.plot(*zip(*bad, strict=True), "x", color="tab:red", ms=4, label=f"violations ({len(bad)})")
    ax_lat.set_ylabel("ms")
    ax_lat.legend(loc="upper right", fontsize=8, ncol=3)
    if pooled:
        _pool_panel(axes[3], pooled)
    axes[-1].set_xlabel("seconds")
    fig.suptitle(f"co-location timeline {title}".strip())
    fig.tight_layout()
    fig.savefig(files["timeline"], dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 3.5))
    if rows:
        span = rows[-1]["t"]
        edges = np.linspace(0.0, max(span, 1e-3), num=min(max(int(span / 0.5), 2), 400) + 1)
        times = np.array([r["t"] for r in rows])
        tokens = np.maximum.accumulate(np.array([r["tokens"] for r in rows], dtype=float))
        at_edges = np.interp(edges, times, tokens, left=0.0)
        width = np.diff(edges)
        ax.step(
            edges[1:], np.diff(at_edges) / width, where="pre", color="tab:green", label="finetune tokens/s"
        )
        dec_t = np.array([r["t"] for r in rows if r["kind"] in ("decode", "mixed")])
        dec_b = np.array([r["batch"] for r in rows if r["kind"] in ("decode", "mixed")], dtype=float)
        out_tok, _ = np.histogram(dec_t, bins=edges, weights=dec_b)
        ax2 = ax.twinx()
        ax2.step(
            edges[1:], out_tok / width, where="pre", color="tab:blue", alpha=0.6, label="decode tokens/s"
        )
        ax2.set_ylabel("decode tokens/s", color="tab:blue")
        ax2.set_ylim(bottom=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds")
    ax.set_ylabel("finetune tokens/s", color="tab:green")
    ax.set_title(f"throughput over time {title}".strip())
    fig.tight_layout()
    fig.savefig(files["throughput"], dpi=90)
    plt.close(fig)
    return files


def live_adapter_figures(rt: Any) -> dict[str, Any]:
    """The live adapter's part of a run's summary: its model id, refresh interval, the refreshes this run made
    and the optimizer step it served last ({} without one)."""
    if rt.live is None:
        return {}
    info = dict(rt.info.get("live_adapter") or {})
    return {
        "live_adapter": {**info, "refreshes": rt.live.refreshes - rt.live_refreshes0, "step": rt.live.step}
    }
