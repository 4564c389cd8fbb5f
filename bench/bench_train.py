"""Standalone LoRA training on Llama-3-8B shapes: harli-train against transformers+peft, in one run.

    python bench/bench_train.py            # on the GPU; writes $OUT/bench_train.json, prints a table last
    python bench/bench_train.py --dry-run  # on the CPU: the same code paths on the tiny model

Each configuration runs in its own process so that peak-memory figures are clean. The `_graphs` rows run
harli-train's step as CUDA graphs (`train.cuda_graphs`), against the eager rows of the same run. Throughput is the median
step time after warm-up; target (docs/design.md): >= 1.5x peft's tokens/s at <= 0.75x its peak memory.
Both sides train on the same rows: the recipe's data as harli-train's loader lays it out, packed by default
(peft then gets each row's per-document `position_ids` and the block-diagonal causal mask as a 4D
`attention_mask`, the way transformers takes packed rows under SDPA); `--no-packing` pads each example to a
row of its own on both sides.
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


def recipe(args, extra: list[str] | None = None):
    """recipes/llama-8b-lora.yaml as both sides of the bench train it."""
    import torch

    from harli_train.config import load_recipe

    overrides = [
        f"model.name={args.model}",
        f"train.batch_size={args.batch}",
        f"data.seq_len={args.seq}",
        f"data.packing={str(args.packing).lower()}",
        f"train.steps={args.warmup + args.steps}",
        f"train.device={'cuda' if torch.cuda.is_available() else 'cpu'}",
        "colocation.trace=null",
        *(extra or []),
    ]
    if not torch.cuda.is_available():
        overrides.append("model.dtype=float32")
    return load_recipe(ROOT / "recipes" / "llama-8b-lora.yaml", overrides)


def peft_batches(args, device: str):
    """The batches harli-train's loader yields for the recipe, as transformers takes them: input_ids, labels,
    and for packed rows position_ids and a [B, 1, T, T] boolean block-diagonal causal mask."""
    from harli_train.data.loader import DataLoader
    from harli_train.data.tokenizer import load_tokenizer
    from harli_train.model import is_preset
    from harli_train.model.attention import DocumentAttention
    from harli_train.train.validation import load_run_data

    cfg = recipe(args)
    tokenizer = load_tokenizer(cfg.model.name, is_preset(cfg.model.name))
    examples, _ = load_run_data(cfg, tokenizer)
    loader = DataLoader(
        examples,
        args.batch,
        args.seq,
        tokenizer.pad_id,
        packing=args.packing,
        shuffle=True,
        seed=cfg.train.seed,
    )
    while True:
        batch = loader.next_batch()
        out = {"input_ids": batch["input_ids"].to(device), "labels": batch["labels"].to(device)}
        if "doc_ids" in batch:
            out["position_ids"] = batch["positions"].to(device)
            out["attention_mask"] = DocumentAttention(batch["doc_ids"].to(device)).mask
        yield out


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
    batches = peft_batches(args, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = pm(**next(batches)).loss
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

    from harli_train.train.trainer import Trainer

    cfg = recipe(
        args,
        [
            f"train.kernels={args.kernels}",
            f"train.cuda_graphs={str(args.graphs).lower()}",
            "train.warmup_steps=1",
            f"output.dir={common.out_dir() / ('run_' + args.kernels + ('_graphs' if args.graphs else ''))}",
            "output.checkpoint_every=0",
            "output.overwrite=true",
            "train.log_every=1000",
        ],
    )
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
    ap.add_argument("--graphs", action="store_true", help="train.cuda_graphs: each micro-step a graph replay")
    ap.add_argument("--sms", type=int, default=0, help="confine the run to a green context of this many SMs")
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True)
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
    ) + ["--packing" if args.packing else "--no-packing"]
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
            "packing": args.packing,
        },
    }
    runs = {
        "peft": ["peft"],
        "ours_torch": ["ours", "--kernels", "torch"],
        "ours_triton": ["ours", "--kernels", "triton"],
        "ours_triton_graphs": ["ours", "--kernels", "triton", "--graphs"],
    }
    if not args.dry_run:  # the same, confined to a 64-SM partition
        runs.update(
            {
                "peft_64sm": ["peft", "--sms", "64"],
                "ours_triton_64sm": ["ours", "--kernels", "triton", "--sms", "64"],
                "ours_triton_graphs_64sm": ["ours", "--kernels", "triton", "--graphs", "--sms", "64"],
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
