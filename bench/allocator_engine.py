"""bench_allocator's engine section: the decode engine over a KV cache that grows and shrinks in the pool,
against the same engine over a plain one (the greedy tokens must be identical)."""

from __future__ import annotations

import heapq
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from allocator_sizes import EngineLoad, Sizes, delta, make_pool  # noqa: E402

from harli_train.memory import PooledKVStorage  # noqa: E402


class OnDemandKV:
    """Before each engine step, maps the page groups the step may need and unmaps the tail groups it cannot
    need: the engine's free blocks cover what its running and waiting requests could ask for (decode's next
    slot, whole prompts on admission), so it schedules exactly what it would over a cache of max_blocks."""

    def __init__(self, engine: Any, kv: PooledKVStorage, wait: Any):
        self.engine, self.kv, self.wait = engine, kv, wait
        self.grow_ms: list[float] = []
        self.shrink_ms: list[float] = []
        self.pages = [self.mapped_pages]

    @property
    def mapped_pages(self) -> int:
        return self.kv.mapped_bytes // self.kv.pool.page_bytes

    def make_room(self, num_tokens: int) -> None:
        """Grow so that the whole cache can hold one request of `num_tokens` tokens: the engine refuses a
        request larger than the blocks it has now, not larger than what the storage could map."""
        bm = self.engine.block_manager
        if bm.blocks_for(num_tokens) > bm.num_blocks:
            t = time.perf_counter()
            self.engine.grow_kv_blocks(self.kv.grow(bm.blocks_for(num_tokens)))
            self.grow_ms.append((time.perf_counter() - t) * 1e3)
            self.pages.append(self.mapped_pages)

    def __call__(self) -> None:
        engine, kv, bm = self.engine, self.kv, self.engine.block_manager
        sched = engine.scheduler
        need = sum(bm.blocks_needed(s, len(s)) for s in (*sched.running, *sched.waiting))
        t = time.perf_counter()
        if need > bm.num_free and kv.num_blocks < kv.max_blocks:
            engine.grow_kv_blocks(kv.grow(bm.num_blocks + need - bm.num_free))
            self.grow_ms.append((time.perf_counter() - t) * 1e3)
        elif need <= bm.num_free:
            # The blocks handed out next are the lowest free ids (a min-heap): everything above them can go.
            keep = max(bm.used_blocks, default=-1) + 1
            if need:
                keep = max(keep, heapq.nsmallest(need, bm.free_blocks)[-1] + 1)
            groups = max(1, -(-keep // kv.blocks_per_page))
            if groups < kv.num_blocks // kv.blocks_per_page and engine.shrink_kv_blocks(keep):
                engine.grow_kv_blocks(kv.shrink(keep, wait=self.wait))  # whole pages stay mapped
                self.shrink_ms.append((time.perf_counter() - t) * 1e3)
        assert bm.num_blocks == kv.num_blocks, (bm.num_blocks, kv.num_blocks)
        self.pages.append(self.mapped_pages)


def serve(
    engine: Any, prompts: list[list[int]], load: EngineLoad, fit: OnDemandKV | None = None
) -> dict[str, Any]:
    """Feed `prompts` in bursts (by step count, so every run sees the same arrivals) and step until done;
    `fit()` runs before every step and once at the end."""
    from harli_train.engine import SamplingParams

    params = SamplingParams(max_tokens=load.new_tokens, ignore_eos=True)
    seqs, decode_ms, steps = [], [], 0
    t0 = time.perf_counter()
    while len(seqs) < len(prompts) or engine.has_unfinished():
        while len(seqs) < len(prompts) and len(seqs) // load.burst * load.gap <= steps:
            prompt = prompts[len(seqs)]
            if fit is not None:
                fit.make_room(len(prompt) + load.new_tokens - 1)
            seqs.append(engine.add_request(prompt, params))
        if fit is not None:
            fit()
        result = engine.step()
        if result.kind == "decode":
            decode_ms.append(result.latency_s * 1e3)
        steps += 1
    wall = time.perf_counter() - t0
    if fit is not None:
        fit()
    return {
        "tokens": [s.completion_token_ids for s in seqs],
        "steps": steps,
        "decode_steps": len(decode_ms),
        "decode_step_ms": common.median(decode_ms),
        "tokens_per_s": sum(s.num_completion_tokens for s in seqs) / wall,
    }


def bench_kv_with_engine(sz: Sizes) -> dict[str, Any]:
    """The decode engine over PooledKVStorage, growing as requests arrive and shrinking as they finish,
    against the same engine over a plain TensorKVStorage of the pool's full size: the greedy tokens must be
    identical. Records grow/shrink events, pages mapped, driver time per page and decode step times."""
    from harli_train.engine import DEFAULT_PARTITION, DecodeEngine, EngineConfig, KVCacheSpec, TensorKVStorage
    from harli_train.model import load_model

    load = sz.engine
    model = load_model(load.preset, load.dtype, sz.device)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(load.prompt_lens[0], load.prompt_lens[1] + 1, (load.prompts,), generator=gen)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lens]
    config = EngineConfig(max_num_seqs=load.prompts, max_model_len=load.prompt_lens[1] + load.new_tokens)
    spec = KVCacheSpec.for_model(model.config, config.block_size, load.dtype)
    # Room for every request at once: the pool never refuses, so only the mapping differs between the runs.
    max_blocks = sum(-(-(int(n) + load.new_tokens - 1) // config.block_size) for n in lens)
    block_bytes = spec.bytes_per_block // (2 * spec.num_layers)
    group_pages = 2 * spec.num_layers
    groups = -(-max_blocks // (sz.page // block_bytes))
    pool = make_pool(sz, groups * group_pages * sz.page)
    kv = PooledKVStorage(pool, spec, max_blocks=max_blocks)

    plain_engine = DecodeEngine(model, config, storage=TensorKVStorage(spec, kv.max_blocks, sz.device))
    serve(plain_engine, prompts[: load.burst], load)  # warm-up: kernels, allocator, graph first replays
    plain = serve(plain_engine, prompts, load)
    del plain_engine
    pooled_engine = DecodeEngine(model, config, storage=kv)
    fit = OnDemandKV(pooled_engine, kv, pooled_engine.runner.partitions[DEFAULT_PARTITION].stream)
    before = pool.stats()
    pooled = serve(pooled_engine, prompts, load, fit)
    after = pool.stats()
    mapped, unmapped = delta(before, after, "map"), delta(before, after, "unmap")
    identical = plain["tokens"] == pooled["tokens"]
    out = {
        "preset": load.preset,
        "dtype": str(load.dtype),
        "prompts": load.prompts,
        "prompt_lens": [int(n) for n in lens],
        "new_tokens": load.new_tokens,
        "arrivals": f"bursts of {load.burst} every {load.gap} steps",
        "identical_tokens": identical,
        "mismatched_requests": [
            i for i, (a, b) in enumerate(zip(plain["tokens"], pooled["tokens"], strict=True)) if a != b
        ],
        "blocks_per_page": kv.blocks_per_page,
        "pages_per_group": group_pages,
        "pages_budget": pool.budget_pages,
        "grow_events": len(fit.grow_ms),
        "shrink_events": len(fit.shrink_ms),
        "pages_mapped_min": min(fit.pages),
        "pages_mapped_max": max(fit.pages),
        "pages_mapped_end": fit.mapped_pages,
        "pages_mapped_total": mapped[1],
        "pages_unmapped_total": unmapped[1],
        "map_us_per_page": mapped[0] / max(mapped[1], 1),
        "set_access_us_per_page": delta(before, after, "set_access")[0] / max(mapped[1], 1),
        "unmap_us_per_page": unmapped[0] / max(unmapped[1], 1),
        "grow_ms_median": common.median(fit.grow_ms),
        "shrink_ms_median": common.median(fit.shrink_ms),
        "decode_step_ms_plain": plain["decode_step_ms"],
        "decode_step_ms_pool": pooled["decode_step_ms"],
        "decode_steps": pooled["decode_steps"],
        "tokens_per_s_plain": plain["tokens_per_s"],
        "tokens_per_s_pool": pooled["tokens_per_s"],
        "steps_plain": plain["steps"],
        "steps_pool": pooled["steps"],
    }
    del pooled_engine, fit, kv
    common.sync_device(torch.device(sz.device))
    pool.check()
    pool.close()
    return out
