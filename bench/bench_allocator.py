"""The VMM page pool on the H200: driver costs next to docs/design.md, KV growth in place, trainer tensors in the
pool, reclaim latency of 1 GiB, the loss of training with swap against training without, and the decode
engine's greedy tokens over a KV cache that grows and shrinks in the pool against a plain one, in one run.

    python bench/bench_allocator.py            # on the GPU: writes $OUT/bench_allocator.json, a table last
    python bench/bench_allocator.py --dry-run  # on the CPU: host backend, small sizes, the same code paths

Every section runs in its own try/except and records its error in the JSON, so one failure loses nothing else.
Timings are medians over repeats after a warm-up; driver times come from the pool's own counters.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harli_train from this checkout
import common  # noqa: E402
from allocator_engine import bench_kv_with_engine  # noqa: E402
from allocator_sizes import DRY, GPU, MIB, Sizes, delta, make_pool  # noqa: E402

from harli_train.memory import (  # noqa: E402
    ActivationSwapper,
    PagePool,
    PooledKVStorage,
    PoolError,
    TrainerMemory,
)

# docs/design.md, "CUDA VMM via cuda.bindings", per 2 MiB page unless said otherwise (microseconds).
DESIGN_US = {
    "create": "15-17",
    "map": "4",
    "set_access": "39 per call",
    "unmap": "23",
    "release": "16",
    "map_access_128mib": "189 (one 128 MiB handle)",
}


def _kv(pool: PagePool, sz: Sizes) -> PooledKVStorage:
    """A KV storage whose range could hold the whole pool."""
    spec = sz.kv_spec
    blocks_per_page = pool.page_bytes // (torch.Size(spec.block_shape).numel() * spec.dtype.itemsize)
    return PooledKVStorage(
        pool, spec, max_blocks=(pool.budget_pages // (2 * spec.num_layers) + 1) * blocks_per_page
    )


def _grow_past_free(kv: PooledKVStorage, extra_pages: int) -> None:
    """Grow the KV cache by whole page groups covering the free pages plus `extra_pages`."""
    group = 2 * kv.spec.num_layers
    kv.grow(kv.num_blocks + -(-(kv.pool.free_pages + extra_pages) // group) * kv.blocks_per_page)


def bench_vmm_costs(sz: Sizes) -> dict[str, Any]:
    """Create / map / set-access / unmap per page, and one run of `run_pages` consecutive pages."""
    n = sz.cost_pages
    t0 = time.perf_counter()
    pool = make_pool(sz, (n + sz.run_pages) * sz.page)
    precreate_s = time.perf_counter() - t0
    s = pool.stats()
    out: dict[str, Any] = {
        "page_bytes": pool.page_bytes,
        "precreate_pages": s["created_pages"],
        "precreate_ms": precreate_s * 1e3,
        "create_us_per_page": s["create_us"] / s["create_calls"],
    }
    tenant = pool.add_tenant("bench")
    single, run = pool.reserve(tenant, 2 * n), pool.reserve(tenant, sz.run_pages)
    per = {"map": [], "set_access": [], "unmap": [], "run_map_access": [], "run_unmap": [], "run_wall": []}
    for rep in range(sz.reps + 1):  # the first repeat is the warm-up
        a = pool.stats()
        single.map(range(0, 2 * n, 2))  # every other slot: each page is its own run, its own set-access
        b = pool.stats()
        single.unmap(range(0, 2 * n, 2))
        c = pool.stats()
        t = time.perf_counter()
        run.map(range(sz.run_pages))
        wall = time.perf_counter() - t
        d = pool.stats()
        run.unmap(range(sz.run_pages))
        e = pool.stats()
        if rep == 0:
            continue
        for call, (x, y) in (("map", (a, b)), ("set_access", (a, b)), ("unmap", (b, c))):
            us, calls = delta(x, y, call)
            per[call].append(us / calls)
        per["run_map_access"].append(delta(c, d, "map")[0] + delta(c, d, "set_access")[0])
        per["run_unmap"].append(delta(d, e, "unmap")[0])
        per["run_wall"].append(wall * 1e6)
    out.update({f"{k}_us": common.median(v) for k, v in per.items()})
    out["run_pages"], out["run_mib"] = sz.run_pages, sz.run_pages * pool.page_bytes / MIB
    out["design_us"] = DESIGN_US
    pool.check()
    pool.close()
    return out


def bench_kv_grow_shrink(sz: Sizes) -> dict[str, Any]:
    """PooledKVStorage grows one page group at a time to kv_groups, shrinks, regrows; its contents must
    equal a plain tensor cache that took the same writes."""
    spec = sz.kv_spec
    block_bytes = torch.Size(spec.block_shape).numel() * spec.dtype.itemsize
    group_bytes = 2 * spec.num_layers * sz.page
    pool = make_pool(sz, group_bytes * (sz.kv_groups + 1))
    kv = PooledKVStorage(pool, spec, max_blocks=sz.kv_groups * (sz.page // block_bytes))
    bpp = kv.blocks_per_page
    plain = torch.zeros(
        spec.num_layers, 2, kv.max_blocks, *spec.block_shape, dtype=spec.dtype, device=sz.device
    )
    gen = torch.Generator(device=sz.device).manual_seed(0)

    def write(first: int, stop: int) -> None:
        values = torch.randn(
            spec.num_layers, 2, stop - first, *spec.block_shape, generator=gen, device=sz.device
        )
        kv.data[:, :, first:stop] = values.to(spec.dtype)
        plain[:, :, first:stop] = values.to(spec.dtype)

    write(0, bpp)
    grow_ms, shrink_ms = [], []
    for g in range(2, sz.kv_groups + 1):
        common.sync_device(torch.device(sz.device))
        t = time.perf_counter()
        kv.grow(g * bpp)
        grow_ms.append((time.perf_counter() - t) * 1e3)
        write((g - 1) * bpp, g * bpp)
    identical = torch.equal(kv.data[:, :, : kv.num_blocks], plain[:, :, : kv.num_blocks])
    keep = max(1, sz.kv_groups // 2)
    for g in range(sz.kv_groups - 1, keep - 1, -1):
        t = time.perf_counter()
        kv.shrink(g * bpp)  # waits for the device: the writes above may still be queued
        shrink_ms.append((time.perf_counter() - t) * 1e3)
    kv.grow(kv.max_blocks)
    write(keep * bpp, kv.max_blocks)
    identical = identical and torch.equal(kv.data, plain)
    s = pool.stats()
    out = {
        "group_mib": group_bytes / MIB,
        "blocks_per_page": bpp,
        "groups": sz.kv_groups,
        "grow_ms_per_group": common.median(grow_ms),
        "shrink_ms_per_group": common.median(shrink_ms),
        "identical_to_plain_tensor_cache": bool(identical),
        "map_calls": s["map_calls"],
        "set_access_calls": s["set_access_calls"],
        "unmap_calls": s["unmap_calls"],
    }
    pool.check()
    pool.close()
    return out


def bench_trainer_mempool(sz: Sizes) -> dict[str, Any]:
    """Torch tensors made inside TrainerMemory.scope() (forward on a side stream, backward on autograd's
    thread) must lie in pool regions; closing the scope's MemPool gives every page back."""
    if sz.device != "cuda":
        return {
            "skipped": "torch's pluggable allocator serves only CUDA tensors (the C pair is tested on CPU)"
        }
    pool = make_pool(sz, 2048 * MIB)
    trainer = pool.add_tenant("trainer")
    memory = TrainerMemory(pool, trainer)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), memory.scope():
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
        ).cuda()
        x = torch.randn(2048, 1024, device="cuda")
        h = model[1](model[0](x))
        loss = model[2](h).square().mean()
        loss.backward()
        forward = [x, h, loss, *model.parameters()]
        grads = [p.grad for p in model.parameters()]
    stream.synchronize()
    out = {
        "forward_tensors_in_pool": sum(pool.find(t.data_ptr()) is not None for t in forward),
        "forward_tensors": len(forward),
        "grads_in_pool": sum(pool.find(g.data_ptr()) is not None for g in grads),
        "grads": len(grads),
        "trainer_pages": trainer.stats()["used_pages"],
        "torch_allocs": pool.stats()["torch_allocs"],
        "routed_by": "stream" if hasattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool") else "thread",
    }
    del model, x, h, loss, forward, grads
    try:
        memory.close()
    except PoolError as e:  # survivors: recorded, and the pool is kept (their memory stays valid)
        out["close_error"] = str(e)
    out["trainer_pages_after_close"] = trainer.stats()["used_pages"]
    out["torch_frees"] = pool.stats()["torch_frees"]
    if "close_error" in out:
        return out
    pool.check()
    pool.close()
    return out


def _mlp(sz: Sizes) -> tuple[torch.nn.ModuleList, torch.Tensor]:
    layers, width, hidden, tokens = sz.mlp
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))
        for _ in range(layers)
    ).to(sz.device, sz.mlp_dtype)
    return blocks, torch.randn(tokens, width, device=sz.device, dtype=sz.mlp_dtype)


def _forward(
    blocks: torch.nn.ModuleList, x: torch.Tensor, swapper: ActivationSwapper | None = None, mid_backward=None
) -> torch.Tensor:
    h = x
    for i, block in enumerate(blocks):
        with swapper.layer(i) if swapper else contextlib.nullcontext():
            h = h + block(h)
        if mid_backward is not None and i == len(blocks) // 2:
            h.register_hook(lambda grad: mid_backward())
    return h.float().square().mean()


def bench_reclaim_latency(sz: Sizes) -> dict[str, Any]:
    """With the pool full, the KV cache asks for `reclaim_bytes`: the swapper spills whole layers of saved
    activations to pinned host memory and unmaps them. Latency of that kv.grow; backward brings them back."""
    blocks, x = _mlp(sz)
    pool = make_pool(sz, 6 * sz.reclaim_bytes + 256 * MIB)
    trainer, other = pool.add_tenant("trainer"), pool.add_tenant("ballast")
    swapper = ActivationSwapper(pool, trainer, layer_bytes=sz.reclaim_bytes, window=1)
    kv = _kv(pool, sz)
    group_bytes = 2 * sz.kv_spec.num_layers * pool.page_bytes
    groups = -(-sz.reclaim_bytes // group_bytes)
    lat_ms, reclaim_ms, swapped = [], [], []
    for _ in range(sz.reps + 1):
        loss = _forward(blocks, x, swapper)
        # Fill the pool, so that the KV cache must take its pages from the trainer.
        ballast = pool.reserve(other, max(1, pool.free_pages))
        ballast.map(range(pool.free_pages))
        common.sync_device(torch.device(sz.device))
        before = dict(swapper.stats)
        t = time.perf_counter()
        kv.grow(kv.num_blocks + groups * kv.blocks_per_page)
        lat_ms.append((time.perf_counter() - t) * 1e3)
        reclaim_ms.append((swapper.stats["reclaim_seconds"] - before["reclaim_seconds"]) * 1e3)
        swapped.append(swapper.stats["swap_out_bytes"] - before["swap_out_bytes"])
        kv.shrink(1)
        ballast.release()
        loss.backward()
        blocks.zero_grad(set_to_none=True)
    lat_ms, reclaim_ms, swapped = lat_ms[1:], reclaim_ms[1:], swapped[1:]
    out = {
        "kv_request_mib": groups * group_bytes / MIB,
        "grow_latency_ms": common.median(lat_ms),
        "reclaim_ms": common.median(reclaim_ms),
        "swap_out_mib": common.median(swapped) / MIB,
        "swap_gbps": common.median(swapped) / 1e9 / max(common.median(reclaim_ms) / 1e3, 1e-9),
        "swapper": swapper.stats,
        "pool_reclaim": pool.reclaim_stats,
    }
    pool.check()
    pool.close()
    return out


def bench_swap_loss_identity(sz: Sizes) -> dict[str, Any]:
    """The same training run with and without decode bursts that make the trainer spill (after forward and
    in the middle of backward); the loss curves must be equal bit for bit."""

    def train(swapper=None, burst=None) -> tuple[list[float], torch.Tensor]:
        blocks, x = _mlp(sz)
        opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
        losses = []
        for _ in range(sz.steps):
            loss = _forward(blocks, x, swapper, mid_backward=burst)
            if burst is not None:
                burst()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, torch.cat([p.detach().flatten().float() for p in blocks.parameters()])

    plain_losses, plain_params = train()
    pool = make_pool(sz, 3 * sz.reclaim_bytes)
    trainer = pool.add_tenant("trainer")
    swapper = ActivationSwapper(pool, trainer, layer_bytes=sz.reclaim_bytes, window=1)
    kv = _kv(pool, sz)

    def burst() -> None:  # the KV cache takes every free page and a third of the trainer's, then frees them
        _grow_past_free(kv, extra_pages=trainer.stats()["used_pages"] // 3 + 1)
        kv.shrink(1)

    swap_losses, swap_params = train(swapper, burst)
    out = {
        "steps": sz.steps,
        "losses_plain": plain_losses,
        "losses_swap": swap_losses,
        "identical_losses": plain_losses == swap_losses,
        "identical_params": torch.equal(plain_params, swap_params),
        "swap_out_mib": swapper.stats["swap_out_bytes"] / MIB,
        "swap_in_mib": swapper.stats["swap_in_bytes"] / MIB,
        "reclaims": pool.reclaim_stats["calls"],
    }
    pool.check()
    pool.close()
    return out


SECTIONS = {
    "vmm_costs": bench_vmm_costs,
    "kv_grow_shrink": bench_kv_grow_shrink,
    "trainer_mempool": bench_trainer_mempool,
    "reclaim_latency": bench_reclaim_latency,
    "swap_loss_identity": bench_swap_loss_identity,
    "kv_with_engine": bench_kv_with_engine,
}


def summary(r: dict[str, Any]) -> list[list[Any]]:
    def get(section: str, key: str) -> Any:
        found = r.get(section, {})
        missing = "error (see JSON)" if "error" in found else "skipped" if "skipped" in found else "-"
        return found.get(key, missing)

    def engine(key: str) -> Any:
        return get("kv_with_engine", key)

    run = f"map+access, one run of {get('vmm_costs', 'run_mib')} MiB (us)"
    return [
        ["create per page (us)", get("vmm_costs", "create_us_per_page"), DESIGN_US["create"]],
        ["map per page (us)", get("vmm_costs", "map_us"), DESIGN_US["map"]],
        ["set-access per call (us)", get("vmm_costs", "set_access_us"), DESIGN_US["set_access"]],
        ["unmap per page (us)", get("vmm_costs", "unmap_us"), DESIGN_US["unmap"]],
        [run, get("vmm_costs", "run_map_access_us"), DESIGN_US["map_access_128mib"]],
        ["unmap, same run (us)", get("vmm_costs", "run_unmap_us"), "-"],
        ["KV grow per page group (ms)", get("kv_grow_shrink", "grow_ms_per_group"), "-"],
        ["KV shrink per page group (ms)", get("kv_grow_shrink", "shrink_ms_per_group"), "-"],
        ["KV equals plain-tensor cache", get("kv_grow_shrink", "identical_to_plain_tensor_cache"), "True"],
        [
            "trainer tensors / grads in pool",
            f"{get('trainer_mempool', 'forward_tensors_in_pool')}/{get('trainer_mempool', 'forward_tensors')}"
            f" / {get('trainer_mempool', 'grads_in_pool')}/{get('trainer_mempool', 'grads')}",
            "all / all",
        ],
        ["trainer pages left after close", get("trainer_mempool", "trainer_pages_after_close"), "0"],
        [
            f"reclaim latency, {get('reclaim_latency', 'kv_request_mib')} MiB (ms)",
            get("reclaim_latency", "grow_latency_ms"),
            "-",
        ],
        ["  of which spill (ms)", get("reclaim_latency", "reclaim_ms"), "-"],
        ["loss identical with swap", get("swap_loss_identity", "identical_losses"), "True"],
        ["engine outputs identical (pool vs plain KV)", engine("identical_tokens"), "True"],
        [
            "engine KV grow / shrink events",
            f"{engine('grow_events')} / {engine('shrink_events')}",
            ">= 1 each",
        ],
        [
            "engine KV pages mapped, min / max",
            f"{engine('pages_mapped_min')} / {engine('pages_mapped_max')}",
            "-",
        ],
        ["engine KV map per page (us)", engine("map_us_per_page"), DESIGN_US["map"]],
        ["engine KV unmap per page (us)", engine("unmap_us_per_page"), DESIGN_US["unmap"]],
        ["decode step, plain KV (ms)", engine("decode_step_ms_plain"), "-"],
        ["decode step, pooled KV (ms)", engine("decode_step_ms_pool"), "= plain"],
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="host backend and small sizes, on the CPU")
    ap.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="run only these sections")
    args = ap.parse_args()
    sz = DRY if args.dry_run or not torch.cuda.is_available() else GPU
    results: dict[str, Any] = {"env": common.environment(), "sizes": repr(sz)}
    for name, fn in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        t = time.perf_counter()
        try:
            results[name] = fn(sz)
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = round(time.perf_counter() - t, 2)
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    path = common.write_json("bench_allocator.json", results)
    print(f"wrote {path}")
    print(common.table(summary(results), ["figure", "measured", "docs/design.md / target"]))


if __name__ == "__main__":
    main()
