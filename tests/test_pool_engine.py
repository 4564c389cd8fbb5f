"""The decode engine over a PooledKVStorage (host backend) that grows as requests arrive and shrinks as they
finish draws the same greedy tokens as the same engine over a plain TensorKVStorage of the full size."""

from __future__ import annotations

import heapq

import torch

from harli_train.engine import DecodeEngine, EngineConfig, KVCacheSpec, SamplingParams, TensorKVStorage
from harli_train.memory import PagePool, PooledKVStorage
from harli_train.model import load_model

PAGE = 64 << 10  # tiny, fp32, 16-token blocks: 4 KiB per layer's K block, 16 blocks (256 tokens) per page
PROMPT_LENS = [90, 200, 5, 130, 150, 23, 97]
ARRIVAL_STEPS = [0, 0, 3, 14, 14, 15, 30]  # the later ones arrive after the first have finished
NEW_TOKENS = 10


def fit_kv(engine: DecodeEngine, kv: PooledKVStorage, events: list[str]) -> None:
    """Map the page groups the next step may need (every running and waiting request's next blocks) and
    unmap the tail groups above the blocks it would hand out (the lowest free ids)."""
    bm, sched = engine.block_manager, engine.scheduler
    need = sum(bm.blocks_needed(s, len(s)) for s in (*sched.running, *sched.waiting))
    if need > bm.num_free:
        engine.grow_kv_blocks(kv.grow(bm.num_blocks + need - bm.num_free))
        events.append("grow")
    else:
        keep = max(bm.used_blocks, default=-1) + 1
        if need:
            keep = max(keep, heapq.nsmallest(need, bm.free_blocks)[-1] + 1)
        if -(-max(keep, 1) // kv.blocks_per_page) < kv.num_blocks // kv.blocks_per_page:
            assert engine.shrink_kv_blocks(keep)
            engine.grow_kv_blocks(kv.shrink(keep))  # the cache keeps whole pages
            events.append("shrink")
    assert bm.num_blocks == kv.num_blocks


def serve(engine: DecodeEngine, prompts: list[list[int]], fit=None) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    seqs, step = [], 0
    while len(seqs) < len(prompts) or engine.has_unfinished():
        while len(seqs) < len(prompts) and ARRIVAL_STEPS[len(seqs)] <= step:
            seqs.append(engine.add_request(prompts[len(seqs)], params))
        if fit is not None:
            fit()
        engine.step()
        step += 1
        engine.block_manager.check(engine.scheduler.running)
    if fit is not None:
        fit()
    return [s.completion_token_ids for s in seqs]


def test_pooled_kv_engine_matches_plain_while_growing_and_shrinking():
    model = load_model("tiny", torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    config = EngineConfig(max_num_seqs=8, max_model_len=256, kernels="torch")
    spec = KVCacheSpec.for_model(model.config, config.block_size, torch.float32)
    groups, planes = 4, 2 * spec.num_layers  # a page group is one page of every layer's K and V plane
    pool = PagePool(groups * planes * PAGE, backend="host", host_page_bytes=PAGE)
    kv = PooledKVStorage(pool, spec, max_blocks=groups * PAGE // (spec.bytes_per_block // planes))
    assert kv.blocks_per_page == 16 and kv.num_blocks == 16

    plain = serve(DecodeEngine(model, config, storage=TensorKVStorage(spec, kv.max_blocks, "cpu")), prompts)
    engine = DecodeEngine(model, config, storage=kv)
    events: list[str] = []
    pages: list[int] = []

    def fit() -> None:
        fit_kv(engine, kv, events)
        pages.append(pool.stats()["owned_pages"])

    pooled = serve(engine, prompts, fit)
    assert pooled == plain
    assert all(len(t) == NEW_TOKENS for t in pooled)
    # Grown from one page group past one and back, more than once: pages were mapped and unmapped mid-run.
    assert events.count("grow") >= 2 and events.count("shrink") >= 2, events
    assert events.index("shrink") < len(events) - 1, "the only shrink came at the end"
    assert max(pages) > planes and kv.num_blocks == kv.blocks_per_page
    assert pool.stats()["unmap_calls"] > 0
    pool.check()
