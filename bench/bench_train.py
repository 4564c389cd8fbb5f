"""Standalone LoRA training on Llama-3-8B shapes: harli-train against transformers+peft, in one run.

    python bench/bench_train.py            # on the GPU; writes $OUT/bench_train.json, prints a table last
    python bench/bench_train.py --dry-run  # on the CPU: the same code paths on the tiny model

Each configuration runs in its own process so that peak-memory figures are clean. Throughput is the median
step time after warm-up; target (docs/design.md): >= 1.5x peft's tokens/s at <= 0.75x its peak memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # works without an install, too
import common  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def partition(args):
    """(stream context, SMs) for a run confined to `args.sms` SMs of a disjoint green context, or the GPU."""
    import contextlib

    import torch

    from harli_train import kernels

    if not args.sms or not torch.cuda.is_available():
        return contextlib.nullcontext(), None
    from harli_train.colocate.sm import SMLadder

    ladder = SMLadder.create(step=8)
    part = ladder.select(args.sms)
    kernels.set_num_sms(part.infer_sms)
    args._ladder = ladder  # keep the contexts alive for the whole run
    return torch.cuda.stream(part.infer_stream), part.infer_sms


def run_peft(args) -> dict:
    """transformers + peft, as a user would run it (probe_peers.py's recipe): autocast bf16, fp32 adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from harli_train.model import model_config

    mc = model_config(args.model)
    cfg = common.hf_llama_config(mc)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(dtype)
        model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
    pm = get_peft_model(
        model,
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"),
    )
    params = [p for p in pm.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, 256, (args.batch, args.seq), device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times = []
    ctx, sms = partition(args)
    with ctx:
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            loss = step()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    dt = common.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return {
        "step_s": dt,
        "tokens_per_s": args.batch * args.seq / dt,
        "peak_gib": peak,
        "loss": float(loss.detach()),
        "sms": sms,
    }


def run_ours(args) -> dict:
    """The trainer as `harli-train recipes/llama-8b-lora.yaml` runs it, with the kernel backend forced."""
    import torch

    from harli_train.config import load_recipe
    from harli_train.train.trainer import Trainer

    overrides = [
        f"model.name={args.model}",
        f"train.kernels={args.kernels}",
        f"train.batch_size={args.batch}",
        f"data.seq_len={args.seq}",
        f"train.steps={args.warmup + args.steps}",
        "train.warmup_steps=1",
        f"output.dir={common.out_dir() / ('run_' + args.kernels)}",
        "output.checkpoint_every=0",
        f"train.device={'cuda' if torch.cuda.is_available() else 'cpu'}",
        "train.log_every=1000",
        "colocation.trace=null",
    ]
    if not torch.cuda.is_available():
        overrides.append("model.dtype=float32")
    cfg = load_recipe(ROOT / "recipes" / "llama-8b-lora.yaml", overrides)
    trainer = Trainer(cfg, quiet=True)
    trainer.setup()
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ctx, sms = partition(args)
    with ctx:
        for _ in trainer.micro_steps():
            pass
    trainer.metrics.close()
    records = [json.loads(line) for line in (Path(cfg.output.dir) / "metrics.jsonl").read_text().splitlines()]
    timed = records[args.warmup :]
    dt = common.median([r["step_s"] for r in timed])
    return {
        "step_s": dt,
        "tokens_per_s": args.batch * args.seq / dt,
        "peak_gib": records[-1]["memory_gib"],
        "losses": [round(r["loss"], 4) for r in records],
        "grad_norms": [round(r["grad_norm"], 4) for r in records],
        "finite": all(r["loss"] == r["loss"] for r in records),
        "sms": sms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--one", choices=["peft", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--sms", type=int, default=0, help="confine the run to a green context of this many SMs")
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    if args.one:
        result = run_peft(args) if args.one == "peft" else run_ours(args)
        print(json.dumps(result))
        return
    base = (
        ["--model", "tiny", "--batch", "2", "--seq", "64", "--warmup", "1", "--steps", "2"]
        if args.dry_run
        else [
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
        ]
    )
    me = str(Path(__file__).resolve())
    if args.dry_run:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # the children run Triton on CPU tensors
    results = {
        "env": common.environment(),
        "config": {
            "model": args.model,
            "batch": args.batch,
            "seq": args.seq,
            "lora_rank": 16,
            "targets": TARGETS,
        },
    }
    runs = {
        "peft": ["peft"],
        "ours_torch": ["ours", "--kernels", "torch"],
        "ours_triton": ["ours", "--kernels", "triton"],
    }
    if not args.dry_run:  # the same, confined to a 64-SM partition
        runs.update(
            {
                "peft_64sm": ["peft", "--sms", "64"],
                "ours_triton_64sm": ["ours", "--kernels", "triton", "--sms", "64"],
            }
        )
    for name, child in runs.items():
        results[name] = common.run_child([me, "--one", *child, *base], timeout=600)
    rows = []
    for name in runs:
        r = results[name]
        peft = results["peft_64sm" if name.endswith("64sm") else "peft"]
        if "error" in r:
            rows.append([name, "error", "", "", "", ""])
            continue
        speed = r["tokens_per_s"] / peft["tokens_per_s"] if "tokens_per_s" in peft else float("nan")
        mem = r["peak_gib"] / peft["peak_gib"] if "peak_gib" in peft else float("nan")
        r["speedup_vs_peft"], r["memory_vs_peft"] = speed, mem
        rows.append([name, r["tokens_per_s"], r["step_s"] * 1e3, r["peak_gib"], speed, mem])
    results["targets"] = {"speedup_vs_peft": ">= 1.5", "memory_vs_peft": "<= 0.75"}
    path = common.write_json("bench_train.json", results)
    print(f"\nwrote {path}")
    print(
        common.table(
            rows, ["config", "tokens/s", "step ms", "peak GiB", "x peft (>=1.5)", "mem x peft (<=0.75)"]
        )
    )


if __name__ == "__main__":
    main()
