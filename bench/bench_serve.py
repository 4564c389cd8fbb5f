"""Serving real clients beside training: the co-located run behind HTTP against the same load fed in-process.

    python bench/bench_serve.py                 # H200: recipes/llama-8b-lora.yaml beside llama-8b, ~7 min
    python bench/bench_serve.py --dry-run       # CPU: the quickstart's tiny model, a thinned trace, ~1 min

Pairs of runs (``--repeats``, 2 by default) of the command users run, one after the other, on the same
recipe, policy and load (``--trace`` at ``--load``: the shipped trace's arrivals divided by colocate_load's
multiple, 2x for medium):

- ``served``: ``harli-train RECIPE --colocate-with MODEL --serve HOST:PORT colocation.trace=null
  colocation.rate=0``; once ``/health`` answers and the trainer has taken ``--warm-steps`` optimizer steps
  (the ``harli_train_step`` gauge of ``/metrics``), ``harli-train loadgen`` replays the load over HTTP,
  streaming, and measures TTFT and every token interval at the client; then SIGTERM (the run checkpoints,
  writes its adapter and exits 0).
- ``inproc``: the same command with the load as its trace (``colocation.trace``), its arrivals shifted by the
  served run's lead-in (when its first request arrived after the run's start), so both loads meet a trainer
  equally warm; stopped by SIGTERM ``--drain-s`` after its last arrival (a co-located run otherwise lasts
  until training is done). It listens too (on ``--port`` + 1; no client connects), so both runs are the
  one assembly ``--serve`` makes (an engine sized for the model's whole context, the live adapter served
  beside the base) and differ only in where requests come from: HTTP clients or the trace.

Compared (targets of the serving issue): the client's TTFT and TPOT (p50, p99, mean) against the served engine's
own records of the same requests (within 10 %); the objective's figures (violations, violation rate, TPOT
attainment) at the client, in the served engine and in-process; the trainer's tokens/s over the load window
(first arrival to last finish, from each run's ``colocate/steps.jsonl``) served against in-process (within 5 %).
The trainer's ratio is the median of the pairs' (one pair is one sample: two runs of the same command on the
H200 differed by 10 % in finetune tokens/s). One JSON ($OUT/bench_serve.json: each pair's runs and comparison
under ``pairs``, the verdicts over all of them under ``comparison``), every run's records and logs
($OUT/bench_serve-runs.tar.gz), a table last. Sent SIGTERM, the bench stops the run under way (its whole
process group, as above) and writes what ran, with the signal as its error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from colocate_load import LOADS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"client_vs_engine": 0.10, "trainer_served_vs_inproc": 0.05}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "harli_train", *args]


def write_load(
    src: Path, dst: Path, scale: float, shift_s: float, limit: int | None, clip: int | None
) -> int:
    """``src``'s requests with arrivals times ``scale`` plus ``shift_s`` (the first ``limit``; prompt and
    output lengths clipped to ``clip``) as a trace at ``dst``; returns how many."""
    from harli_train.engine.load import read_trace

    reqs = read_trace(src)[:limit]
    with dst.open("w") as f:
        for r in reqs:
            line = {"arrival_s": round(r.arrival_s * scale + shift_s, 6), "id": str(r.request_id),
                    "prompt_len": min(r.prompt_len, clip or r.prompt_len),
                    "output_len": min(r.output_len, clip or r.output_len)}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return len(reqs)


def _get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


class Stopped(Exception):
    """The bench was sent SIGTERM: the run under way is stopped as ``stop`` stops it, and what ran is written."""


def _stopped(signum: int, frame: Any) -> None:
    raise Stopped(f"stopped by {signal.Signals(signum).name}")


def stop(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM ``proc``'s process group (as an operator stops a run), SIGKILL past ``timeout_s``; its exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, warm_steps: int, timeout_s: float) -> float:
    """Seconds until ``/health`` answers and the trainer has taken ``warm_steps`` steps; RuntimeError when the
    server exits or the time runs out first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the served run exited with {proc.returncode} before it was ready")
        try:
            _get(f"{url}/health")
            step = _gauge(_get(f"{url}/metrics"), "harli_train_step")
            if step is not None and step >= warm_steps:
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(
        f"the served run was not ready (health, {warm_steps} trainer steps) in {timeout_s:.0f}s"
    )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trainer_rate(run_dir: Path) -> dict[str, Any]:
    """The trainer's tokens/s over the load window of a co-located run (first arrival to last finish, cut to
    the span its step records cover), from the records' cumulative finetune tokens interpolated linearly at
    the window's ends: a window between two records still gets the rate of the records around it."""
    reqs = [r for r in _jsonl(run_dir / "colocate" / "serve" / "requests.jsonl") if r.get("error") is None]
    rows = _jsonl(run_dir / "colocate" / "steps.jsonl")
    start = min(r["arrival_s"] for r in reqs)
    end = max(r["arrival_s"] + (r["latency_ms"] or 0.0) / 1e3 for r in reqs)
    points = sorted((row["t"], row["tokens"]) for row in rows)

    def tokens_at(x: float) -> float:
        """Cumulative tokens at time ``x``: between the records around it, or at the nearest end."""
        if x <= points[0][0]:
            return points[0][1]
        for (t0, k0), (t1, k1) in zip(points, points[1:], strict=False):
            if x <= t1:
                return k0 + (k1 - k0) * (x - t0) / (t1 - t0) if t1 > t0 else k1
        return points[-1][1]

    lo, hi = max(start, points[0][0]), min(end, points[-1][0])  # the part of the window with records
    tokens = tokens_at(hi) - tokens_at(lo)
    return {"window_s": [start, end], "tokens": tokens, "seconds": hi - lo,
            "tokens_per_s": tokens / (hi - lo) if hi > lo else None}  # fmt: skip


def _engine_figures(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "colocate" / "summary.json").read_text())
    s = summary["serving"]
    keys = ("requests", "refused", "aborted_at_end", "violations", "violation_rate", "tpot_attainment",
            "clean", "intervals", "ttft_ms", "tpot_ms", "token_interval_ms")  # fmt: skip
    return {"policy": summary["policy"], "stop_reason": summary["stop_reason"],
            "finetune_tokens_per_s_run": summary["finetune"]["tokens_per_s"],
            "oom_recoveries": summary["finetune"]["oom_recoveries"],
            **{k: s.get(k) for k in keys}}  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def served_run(args, recipe: str, load: Path, work: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    out = work / "served"
    cmd = _cli(recipe, "--colocate-with", args.model, "--serve", f"127.0.0.1:{args.port}",
               "colocation.trace=null", "colocation.rate=0", "train.steps=1000000", f"output.dir={out}",
               *args.set)  # fmt: skip
    print("served:", " ".join(cmd[2:]), flush=True)
    log = open(work / "served.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
    try:
        ready_s = wait_ready(url, proc, args.warm_steps, args.ready_timeout_s)
        t_load = time.monotonic()
        client = subprocess.run(
            _cli(
                "loadgen",
                "--url",
                url,
                "--trace",
                str(load),
                "--tpot-ms",
                str(args.tpot_ms),
                "--out",
                str(work / "client"),
            ),  # fmt: skip
            capture_output=True,
            text=True,
            timeout=args.load_timeout_s,
        )
        if client.returncode != 0:
            raise RuntimeError(f"loadgen exited with {client.returncode}: {client.stderr[-1500:]}")
        load_s = time.monotonic() - t_load
    finally:
        rc = stop(proc, args.stop_timeout_s)
        log.close()
    if rc != 0:
        raise RuntimeError(f"the served run exited with {rc}: {(work / 'served.log').read_text()[-1500:]}")
    return {
        "command": cmd[2:],
        "exit_code": rc,
        "ready_s": ready_s,
        "load_s": load_s,
        "client": json.loads((work / "client" / "client_summary.json").read_text()),
        "engine": _engine_figures(out),
        "trainer": trainer_rate(out),
        "lead_in_s": min(r["arrival_s"] for r in _jsonl(out / "colocate" / "serve" / "requests.jsonl")),
    }


def _run_seconds(log: Path) -> float:
    """The run time the last progress line of a co-located run's log gives (``... [12s]``; -1 before one)."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return -1.0
    found = re.findall(r"\[([\d,]+)s\]\s*$", tail, flags=re.MULTILINE)
    return float(found[-1].replace(",", "")) if found else -1.0


def inproc_run(args, recipe: str, load: Path, until_s: float, work: Path) -> dict[str, Any]:
    """The same command, listening but with ``load`` as its trace, stopped (SIGTERM, as an operator stops it)
    once its progress line passes ``until_s`` seconds of run time: a served run otherwise lasts until it is
    stopped."""
    out = work / "inproc"
    cmd = _cli(recipe, "--colocate-with", args.model, "--serve", f"127.0.0.1:{args.port + 1}",
               f"colocation.trace={load}", "train.steps=1000000", f"output.dir={out}", *args.set)  # fmt: skip
    print("inproc:", " ".join(cmd[2:]), flush=True)
    log = open(work / "inproc.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
    deadline = time.monotonic() + args.ready_timeout_s + until_s
    try:
        while proc.poll() is None and _run_seconds(work / "inproc.log") < until_s:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the in-process run did not reach {until_s:.0f}s of run time in time")
            time.sleep(0.5)
    finally:
        rc = stop(proc, args.stop_timeout_s)
        log.close()
    if rc not in (0, 130):  # 130: a training run stopped by a signal (its checkpoint and summary written)
        raise RuntimeError(
            f"the in-process run exited with {rc}: {(work / 'inproc.log').read_text()[-1500:]}"
        )
    return {"command": cmd[2:], "exit_code": rc, "engine": _engine_figures(out), "trainer": trainer_rate(out)}


def compare(served: dict[str, Any], inproc: dict[str, Any]) -> dict[str, Any]:
    """Ratios client / served engine (TTFT, TPOT) and served / in-process (trainer tokens/s), with verdicts."""
    client, engine = served["client"], served["engine"]
    lat = {
        f"{metric}_{stat}": _ratio(client[metric][stat], engine[metric][stat])
        for metric in ("ttft_ms", "tpot_ms")
        for stat in ("p50", "p99", "mean")
    }
    trainer = _ratio(served["trainer"]["tokens_per_s"], inproc["trainer"]["tokens_per_s"])
    worst = max((abs(r - 1) for r in lat.values() if r is not None), default=None)
    served_all = client["errors"] == 0 and engine["requests"] == client["requests"]
    return {
        "client_errors": client["errors"],
        "all_served": served_all,  # every request answered (a refusal makes the figures meaningless)
        "client_over_engine": lat,
        "client_vs_engine_worst": worst,
        "client_vs_engine_ok": served_all and worst is not None and worst <= TARGETS["client_vs_engine"],
        "trainer_served_over_inproc": trainer,
        "trainer_ok": served_all
        and trainer is not None
        and abs(trainer - 1) <= TARGETS["trainer_served_vs_inproc"],
        "objective": {
            where: {k: src.get(k) for k in ("violations", "violation_rate", "tpot_attainment", "intervals")}
            for where, src in (
                ("client", client),
                ("served_engine", engine),
                ("inproc_engine", inproc["engine"]),
            )
        },
    }


def combine(comparisons: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdicts over every pair of runs: every request answered in each; the client against the engine at
    its worst pair; the trainer's served / in-process ratio as the median of the pairs' (each pair is one
    sample of a figure whose run-to-run spread is a few percent), with every pair's ratio beside it."""
    ratios = [c["trainer_served_over_inproc"] for c in comparisons]
    known = [r for r in ratios if r is not None]
    median = statistics.median(known) if known else None
    worsts = [c["client_vs_engine_worst"] for c in comparisons]
    all_served = all(c["all_served"] for c in comparisons)
    worst = None if None in worsts else max(worsts)
    return {
        "pairs": len(comparisons),
        "all_served": all_served,
        "client_errors": sum(c["client_errors"] for c in comparisons),
        "client_vs_engine_worst": worst,
        "client_vs_engine_ok": all(c["client_vs_engine_ok"] for c in comparisons),
        "trainer_served_over_inproc": median,
        "trainer_served_over_inproc_pairs": ratios,
        "trainer_ok": all_served
        and median is not None
        and abs(median - 1) <= TARGETS["trainer_served_vs_inproc"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU: the quickstart's tiny model, a thinned trace"
    )
    ap.add_argument(
        "--recipe", default=None, help="default: recipes/llama-8b-lora.yaml (dry run: quickstart)"
    )
    ap.add_argument("--model", default=None, help="--colocate-with (default: llama-8b; dry run: tiny)")
    ap.add_argument("--trace", default="bursty", help="a shipped trace under recipes/traces")
    ap.add_argument("--load", default="medium", choices=sorted(LOADS))
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--tpot-ms", type=float, default=None, help="the objective (default: the recipe's)")
    ap.add_argument("--warm-steps", type=int, default=3)
    ap.add_argument("--ready-timeout-s", type=float, default=240.0)
    ap.add_argument("--load-timeout-s", type=float, default=240.0)
    ap.add_argument("--stop-timeout-s", type=float, default=120.0)
    ap.add_argument("--drain-s", type=float, default=20.0, help="the in-process run lasts this past the load")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides for both runs (key=value)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="pairs of runs, served then in-process (default 2; dry run 1)",
    )
    args = ap.parse_args()
    # The runs live in sessions of their own (so that ``stop`` signals each one's whole group): a SIGTERM to
    # the bench becomes an exception, whose way out stops the run under way and writes what ran.
    signal.signal(signal.SIGTERM, _stopped)
    from harli_train.config import load_recipe

    recipe = args.recipe or str(
        REPO / "recipes" / ("quickstart.yaml" if args.dry_run else "llama-8b-lora.yaml")
    )
    args.model = args.model or ("tiny" if args.dry_run else "llama-8b")
    args.repeats = args.repeats or (1 if args.dry_run else 2)
    if args.repeats < 1:
        ap.error(f"--repeats: want 1 or more, got {args.repeats}")
    if args.dry_run:
        args.set = ["colocation.tpot_ms=200", "train.batch_size=2", *args.set]
        args.warm_steps = min(args.warm_steps, 1)
    rc = load_recipe(recipe, args.set)
    args.tpot_ms = args.tpot_ms or rc.colocation.tpot_ms
    result: dict[str, Any] = {"env": common.environment(), "dry_run": args.dry_run, "targets": TARGETS,
                              "config": {"recipe": recipe, "model": args.model, "trace": args.trace,
                                         "load": args.load, "tpot_ms": args.tpot_ms, "set": args.set}}  # fmt: skip
    src = REPO / "recipes" / "traces" / f"{args.trace}.jsonl"
    scale = 1.0 / LOADS[args.load]
    limit, clip = (12, 48) if args.dry_run else (None, None)
    with tempfile.TemporaryDirectory(prefix="bench_serve-") as tmp:
        work = Path(tmp)
        try:
            n = write_load(src, work / "load.jsonl", scale, 0.0, limit, clip)
            result["config"]["requests"] = n
            result["config"]["repeats"] = args.repeats
            pairs = result["pairs"] = []
            for i in range(args.repeats):
                pw = work / f"pair-{i + 1}"
                pw.mkdir()
                served = served_run(args, recipe, work / "load.jsonl", pw)
                last = write_load(src, pw / "load-inproc.jsonl", scale, served["lead_in_s"], limit, clip)
                assert last == n
                end = max(r["arrival_s"] for r in _jsonl(pw / "load-inproc.jsonl"))
                inproc = inproc_run(args, recipe, pw / "load-inproc.jsonl", end + args.drain_s, pw)
                pairs.append({"served": served, "inproc": inproc, "comparison": compare(served, inproc)})
                common.write_json("bench_serve.json", result)  # each pair kept if a later one is cut short
            result["comparison"] = combine([p["comparison"] for p in pairs])
        except Exception as err:  # the JSON records what ran and why the rest did not
            result["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            for log in sorted(work.glob("pair-*/*.log")):
                sys.stderr.write(f"--- {log.relative_to(work)} (tail)\n{log.read_text()[-3000:]}\n")
        with tarfile.open(common.out_dir() / "bench_serve-runs.tar.gz", "w:gz") as tar:
            for pw in sorted(work.glob("pair-*")):
                for name in ("served.log", "inproc.log", "client", "served/colocate", "inproc/colocate",
                             "served/metrics.jsonl", "inproc/metrics.jsonl"):  # fmt: skip
                    if (pw / name).exists():
                        tar.add(pw / name, arcname=f"{pw.name}/{name}")
    path = common.write_json("bench_serve.json", result)
    print(f"\nwrote {path}")
    print(report(result))
    return 1 if "error" in result else 0


def report(result: dict[str, Any]) -> str:
    """The table of a result: per source, TTFT/TPOT and the objective; the trainer's rates; the verdicts."""
    if "comparison" not in result:
        return f"no comparison: {result.get('error')}"
    c, rows = result["comparison"], []
    for k, pair in enumerate(result["pairs"], 1):
        s, i = pair["served"], pair["inproc"]
        for name, src, trainer in (("client", s["client"], s["trainer"]), ("served_engine", s["engine"], None),
                                   ("inproc_engine", i["engine"], i["trainer"])):  # fmt: skip
            rows.append([f"{k}: {name}", src["ttft_ms"]["p50"], src["ttft_ms"]["p99"], src["tpot_ms"]["p50"],
                         src["tpot_ms"]["p99"], src.get("violations"), src.get("tpot_attainment"),
                         trainer["tokens_per_s"] if trainer else ""])  # fmt: skip
    head = [
        "source",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "violations",
        "attainment",
        "trainer tok/s",
    ]
    lines = [common.table(rows, head), ""]
    if not c["all_served"]:
        lines.append(f"NOT ALL SERVED: {c['client_errors']} requests failed at the client")
    worst = c["client_vs_engine_worst"]
    lines.append(f"client / engine (TTFT, TPOT p50/p99/mean): worst {worst:.3f} off "
                 f"(target <= {TARGETS['client_vs_engine']}): {'ok' if c['client_vs_engine_ok'] else 'MISS'}")  # fmt: skip
    tr = c["trainer_served_over_inproc"]
    tr_text = "-" if tr is None else f"{tr:.3f}"
    each = ", ".join("-" if r is None else f"{r:.3f}" for r in c["trainer_served_over_inproc_pairs"])
    lines.append(f"trainer tokens/s served / in-process: {tr_text}, the median of {c['pairs']} pair(s) ({each}) "
                 f"(target within {TARGETS['trainer_served_vs_inproc']}): {'ok' if c['trainer_ok'] else 'MISS'}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
