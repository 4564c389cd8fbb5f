"""What the page pool's activation stash costs the trainer's launching thread: recipes/llama-8b-lora.yaml's
trainer alone on a side stream, its steps plain and with every chunk's saved tensors stashed in pool pages.

    python bench/bench_stash.py            # H200: $OUT/bench_stash.json, ~2 min; a table last
    python bench/bench_stash.py --dry-run  # CPU: the tiny model on the host backend, seconds

Per variant (``plain``; ``stash``: an ``ActivationSwapper`` on a pool of ``--pool-gib``, stashing what the
co-located run stashes (``pool_budget.stash_min_bytes``); ``stash-all``: every saved activation of 4 KiB or
more; ``stash+mempool``: also the trainer's torch allocations in the pool, as a co-located run has them) and
step after warm-up: the host seconds its micro-steps took to launch (the generator's ``next``, the GPU left
running) and the step's wall time (synchronized at its end), as medians; for the stash variants also the calls
to ``_pack`` and ``_unpack``, their host time and what they copied. Then the pieces of one pack, each timed
alone over many calls: a stream lookup, a strided view, a copy of a saved tensor's size into the stash and the
bookkeeping.
The ratio that matters is the stash's host seconds a step over plain's, and its launch time against the
GPU's step time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
import common  # noqa: E402
import torch  # noqa: E402


def recipe(args: argparse.Namespace, out: Path):
    from harli_train.config import load_recipe

    cuda = torch.cuda.is_available() and not args.dry_run
    overrides = [
        f"train.steps={args.warmup + args.steps}",
        f"train.device={'cuda' if cuda else 'cpu'}",
        f"output.dir={out}",
        "output.checkpoint_every=0",
        "output.overwrite=true",
        "train.log_every=1000",
        "colocation.trace=null",
    ]
    if not cuda:
        overrides += ["model.name=tiny", "model.dtype=float32", "data.seq_len=64", "train.batch_size=2"]
    return load_recipe(ROOT / "recipes" / "llama-8b-lora.yaml", overrides)


class Timed:
    """Wrap a swapper's hook: calls and host seconds."""

    def __init__(self, fn):
        self.fn, self.calls, self.seconds = fn, 0, 0.0

    def __call__(self, *a):
        t0 = time.perf_counter()
        try:
            return self.fn(*a)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    from harli_train.colocate.pool_budget import chunk_saved_bytes, stash_min_bytes
    from harli_train.memory import ActivationSwapper, PagePool, TrainerMemory
    from harli_train.train.trainer import Trainer

    cfg = recipe(args, common.out_dir() / f"stash_{variant}")
    trainer = Trainer(cfg, quiet=True)
    trainer.setup()
    dev = trainer.device
    cuda = dev.type == "cuda"
    swapper = scope = pool = memory = None
    if variant != "plain":
        pool = PagePool(
            int(args.pool_gib * 2**30),
            backend="cuda" if cuda else "host",
            device=dev.index or 0,
            host_page_bytes=64 << 10,
            precreate=cuda,
        )
        tenant = pool.add_tenant("trainer")
        model = trainer.model
        chunk_bytes = chunk_saved_bytes(
            model.config,
            cfg.train.batch_size,
            cfg.data.seq_len,
            cfg.train.layers_per_microstep,
            trainer.dtype,
        )
        swapper = ActivationSwapper(
            pool,
            tenant,
            layer_bytes=chunk_bytes,
            exclude=[*model.parameters(), *model.buffers()],
            # stash-all: every saved activation of 4 KiB or more (the rule before stash_min_bytes)
            min_bytes=4096 if variant == "stash-all" else stash_min_bytes(chunk_bytes),
        )
        swapper._pack, swapper._unpack = Timed(swapper._pack), Timed(swapper._unpack)
        trainer.stash_chunk = swapper.layer
        if variant == "stash+mempool" and cuda:
            memory = TrainerMemory(pool, tenant)
            scope = memory.scope
    stream = torch.cuda.Stream(dev) if cuda else None
    launch, wall, micro = [], [], 0
    gen = trainer.micro_steps()
    with (
        torch.cuda.stream(stream) if cuda else contextlib.nullcontext(),
        scope() if scope else contextlib.nullcontext(),
    ):
        for step in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize(dev)
            if swapper is not None and step == args.warmup:
                for hook in (swapper._pack, swapper._unpack):
                    hook.calls, hook.seconds = 0, 0.0
                stashed0 = swapper.stats["stashed_bytes"]
                tensors0 = swapper.stats["stashed_tensors"]
            t0, host = time.perf_counter(), 0.0
            while True:
                t1 = time.perf_counter()
                try:
                    ms = next(gen)
                except StopIteration:
                    ms = None
                host += time.perf_counter() - t1
                micro += step >= args.warmup
                if ms is None or ms.phase == "optim":
                    break
            if cuda:
                torch.cuda.synchronize(dev)
            if step >= args.warmup:
                launch.append(host)
                wall.append(time.perf_counter() - t0)
    row: dict[str, Any] = {
        "variant": variant,
        "launch_s": statistics.median(launch),
        "step_s": statistics.median(wall),
        "micro_steps_per_step": micro / args.steps,
        "tokens_per_s": cfg.train.batch_size
        * cfg.train.grad_accum
        * cfg.data.seq_len
        / statistics.median(wall),
    }
    if swapper is not None:
        for name, hook in (("pack", swapper._pack), ("unpack", swapper._unpack)):
            row[f"{name}_calls_per_step"] = hook.calls / args.steps
            row[f"{name}_s_per_step"] = hook.seconds / args.steps
            row[f"{name}_us_per_call"] = 1e6 * hook.seconds / max(hook.calls, 1)
        row["stashed_gib_per_step"] = (swapper.stats["stashed_bytes"] - stashed0) / args.steps / 2**30
        row["stashed_tensors_per_step"] = (swapper.stats["stashed_tensors"] - tensors0) / args.steps
        row["min_stashed_bytes"] = swapper.min_bytes
        row["pieces"] = pieces(swapper, dev)
    # Everything the variant made goes before the next one claims its pool.
    del gen, trainer, swapper
    gc.collect()
    try:
        if memory is not None:
            memory.close()
        if pool is not None:
            pool.close()
    except Exception as e:  # the figures stand; what is left behind is named
        row["cleanup_error"] = f"{type(e).__name__}: {e}"
    return row


def pieces(swapper: Any, dev: torch.device, n: int = 2000) -> dict[str, float]:
    """Microseconds per call of what one pack does, each alone on an idle GPU."""
    out: dict[str, float] = {}
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    stash = max(swapper.pages.stashes.values(), key=lambda s: s.mapped)  # only mapped pages may be touched
    nbytes = min(32 << 20, stash.mapped * swapper.pool.page_bytes)
    src = torch.randn(nbytes // dtype.itemsize, device=dev, dtype=dtype)

    def timed(name: str, fn) -> None:
        fn()
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = 1e6 * (time.perf_counter() - t0) / n
        if cuda:
            torch.cuda.synchronize(dev)

    view = stash.view(0, src.nbytes, src.dtype, src.shape, src.stride())
    if cuda:
        timed("current_stream", lambda: torch.cuda.current_stream(dev))
    timed("view", lambda: stash.view(0, src.nbytes, src.dtype, src.shape, src.stride()))
    timed(f"copy_{nbytes >> 10}KiB", lambda: view.copy_(src))
    small = src[: (64 << 10) // dtype.itemsize]
    small_view = stash.view(0, small.nbytes, small.dtype, small.shape, small.stride())
    timed("copy_64KiB", lambda: small_view.copy_(small))
    timed(
        "checks",
        lambda: (
            small.nbytes,
            small.requires_grad,
            small.is_leaf,
            small.device,
            small.untyped_storage().data_ptr(),
        ),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pool-gib", type=float, default=48.0)
    ap.add_argument("--variants", default="plain,stash,stash-all,stash+mempool")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.dry_run:
        args.pool_gib = min(args.pool_gib, 0.5)
    rows = []
    for variant in args.variants.split(","):
        try:
            rows.append(run_variant(args, variant))
        except Exception as e:  # record it; the other variants still run
            rows.append({"variant": variant, "error": f"{type(e).__name__}: {e}"})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = Path(args.out) if args.out else common.out_dir() / "bench_stash.json"
    out.write_text(json.dumps({"env": common.environment(), "rows": rows}, indent=1))
    plain = next((r for r in rows if r["variant"] == "plain" and "error" not in r), None)
    print(
        f"{'variant':<15}{'launch s':>10}{'step s':>9}{'tok/s':>9}{'pack/step':>10}{'stashed':>9}{'us/pack':>9}"
        f"{'x plain':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<15} {r['error']}")
            continue
        ratio = r["launch_s"] / plain["launch_s"] if plain else float("nan")
        print(
            f"{r['variant']:<15}{r['launch_s']:>10.3f}{r['step_s']:>9.3f}{r['tokens_per_s']:>9.0f}"
            f"{r.get('pack_calls_per_step', 0):>10.0f}{r.get('stashed_tensors_per_step', 0):>9.0f}"
            f"{r.get('pack_us_per_call', 0):>9.1f}{ratio:>9.2f}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
