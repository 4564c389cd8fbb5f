"""Tensor-parallel decode TPOT and co-located finetune tokens/s at TP=2/4 against TP=1, in one run.

    python bench/bench_tensor_parallel.py --tp 1,2,4          # on a multi-GPU host; $OUT/bench_tensor_parallel.json
    python bench/bench_tensor_parallel.py --model llama-70b --tp 4,8 --skip-colocate
    python bench/bench_tensor_parallel.py --dry-run           # on the CPU: tiny model, gloo, TP=1,2, a few steps

Decode: for each TP size, a job of that many ranks (``harli_train.parallel.command.serving_engine``, rank 0's
engine publishing every step) times ``synthetic_decode`` steps (batch B, every sequence at ``--kv-len`` cached
tokens; the step is the whole engine step of decode rows, graph replay on a GPU) after a warm-up; the figure
is the median. The roofline per rank is (weights / N + KV read / N) / copy bandwidth measured in the same run
(the all-reduces are not in it: what TPOT costs over the roofline at N > 1 is the collectives' share).
Co-location: ``harli-train RECIPE --colocate-with MODEL --tensor-parallel N`` (the program users run), per
policy (harli and the fixed splits of ``--statics``), each in a fresh process; finetune tokens/s and the
serving objective from its summary. TP=1 is the same command without the flag.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _bandwidth(device) -> float:
    import torch

    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for i in range(13):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * x.numel() / common.median(times)


def decode_rank(tp, model: str, batches: list[int], kv_len: int, steps: int, out: str) -> None:
    """One rank of a decode-timing job (``harli_train.parallel.group.spawn``)."""
    import torch

    from harli_train.engine import EngineConfig
    from harli_train.parallel.command import serving_engine
    from harli_train.parallel.tp_engine import follow_engine, lead_engine, stop_followers

    max_b = max(batches)
    blocks = max_b * (-(-(kv_len + 1) // 16))
    cfg = EngineConfig(max_num_seqs=max_b, max_model_len=kv_len + 16, num_kv_blocks=blocks)
    if tp is None:  # TP=1: the one-GPU engine users run without the flag (GEMV kernels, graphs)
        from harli_train.engine import DecodeEngine
        from harli_train.model import load_model, resolve_dtype

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        engine, channel = DecodeEngine(load_model(model, resolve_dtype("auto", device), device), cfg), None
    else:
        engine = serving_engine(model, cfg, tp, tokenizer=False)
        if not tp.is_leader:
            follow_engine(engine, tp)
            engine.close()
            return
        channel = lead_engine(engine, tp)
    device = engine.device
    rows = []
    for b in batches:
        times = []
        for i in range(steps + 3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.synthetic_decode(b, kv_len)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        rows.append({"batch": b, "tpot_ms": 1e3 * common.median(times)})
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in engine.model.named_parameters() if "embed" not in n
    )
    kv_per_token = engine.storage.spec.bytes_per_token
    bandwidth = _bandwidth(device)
    for row in rows:
        read = weight_bytes + row["batch"] * kv_len * kv_per_token  # this rank's slice of both
        row["roofline_ms"] = 1e3 * read / bandwidth
        row["vs_roofline"] = row["tpot_ms"] / row["roofline_ms"]
    if channel is not None:
        stop_followers(channel)
    engine.close()
    Path(out).write_text(
        json.dumps({"rows": rows, "bandwidth_gbs": bandwidth / 1e9, "weight_bytes_per_rank": weight_bytes})
    )


def bench_decode(model: str, n: int, batches: list[int], kv_len: int, steps: int, on_gpu: bool) -> dict:
    from harli_train.parallel.group import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "decode.json"
        if n == 1:
            decode_rank(None, model, batches, kv_len, steps, str(out))
        else:
            spawn(decode_rank, n, on_gpu, (model, batches, kv_len, steps, str(out)))
        return json.loads(out.read_text())


def bench_colocate(
    recipe: str, model: str, n: int, policy: str, overrides: list[str], timeout: float
) -> dict:
    """One co-located run through the command line, in a fresh process; its summary's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            recipe,
            "--colocate-with",
            model,
            "--policy",
            policy,
            "--quiet",
            f"output.dir={tmp}/run",
            *overrides,
        ]
        if n > 1:
            args += ["--tensor-parallel", str(n)]
        code = "from harli_train.cli import main; main()"
        proc = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
        )
        summary_path = Path(tmp) / "run" / "colocate" / "summary.json"
        if proc.returncode != 0 or not summary_path.is_file():
            return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
        s = json.loads(summary_path.read_text())
    sv = s["serving"]
    return {
        "finetune_tokens_per_s": s["finetune"]["tokens_per_s"],
        "violation_rate": sv.get("violation_rate"),
        "tpot_attainment": sv.get("tpot_attainment"),
        "clean": sv.get("clean"),
        "tpot_p50_ms": (sv.get("tpot_ms") or {}).get("p50"),
        "shares_raised": s.get("tensor_parallel", {}).get("shares_raised"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--tp", default="1,2,4", help="TP sizes, comma-separated (TP=1 is the baseline)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--kv-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "llama-8b-lora.yaml"))
    ap.add_argument("--statics", default="48,64,80", help="fixed decode shares to run beside harli")
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--skip-colocate", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny model, gloo, TP=1,2")
    args = ap.parse_args()
    import torch

    on_gpu = torch.cuda.is_available() and not args.dry_run
    model, sizes = args.model, [int(n) for n in args.tp.split(",")]
    batches, kv_len, steps = [int(b) for b in args.batches.split(",")], args.kv_len, args.steps
    overrides = [f"train.steps={args.train_steps}"]
    statics = [f"static:{s}" for s in args.statics.split(",") if s]
    timeout = 3600.0
    if args.dry_run:
        model, sizes, batches, kv_len, steps = "tiny", [1, 2], [1, 4], 64, 3
        args.recipe, statics, timeout = str(REPO / "recipes" / "quickstart.yaml"), [], 600.0
        overrides = ["train.steps=2", "train.warmup_steps=1", "colocation.duration_s=2", "train.device=cpu"]
    if on_gpu:
        sizes = [n for n in sizes if n <= torch.cuda.device_count()]
    result = {"env": common.environment(), "model": model, "kv_len": kv_len, "decode": {}, "colocate": {}}
    for n in sizes:
        result["decode"][str(n)] = bench_decode(model, n, batches, kv_len, steps, on_gpu)
    if not args.skip_colocate:
        for n in sizes:
            result["colocate"][str(n)] = {
                p: bench_colocate(args.recipe, model, n, p, overrides, timeout) for p in ["harli", *statics]
            }
    path = common.write_json("bench_tensor_parallel.json", result)
    rows = []
    for n, d in result["decode"].items():
        rows += [[f"TP={n}", r["batch"], r["tpot_ms"], r["roofline_ms"], r["vs_roofline"]] for r in d["rows"]]
    print(common.table(rows, ["decode", "batch", "TPOT ms", "roofline/rank ms", "x roofline"]))
    base = result["colocate"].get("1", {})
    rows = []
    for n, runs in result["colocate"].items():
        for policy, r in runs.items():
            ref = base.get(policy, {}).get("finetune_tokens_per_s")
            tok = r.get("finetune_tokens_per_s")
            ratio = tok / ref if tok and ref else float("nan")
            rows.append(
                [
                    f"TP={n}",
                    policy,
                    tok if tok is not None else r.get("error", "")[:40],
                    ratio,
                    r.get("violation_rate"),
                    r.get("clean"),
                ]
            )
    if rows:
        print(
            common.table(rows, ["colocate", "policy", "finetune tok/s", "x TP=1", "violation rate", "clean"])
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
