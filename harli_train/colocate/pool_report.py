"""``memory.pool`` of a co-located run's summary: what ``PoolMemory`` did with the page pool's pages."""

from __future__ import annotations

from typing import Any

from harli_train.engine.metrics import percentiles


def pool_report(pm: Any, st: dict[str, Any]) -> dict[str, Any]:
    """The report of ``pm`` (a ``PoolMemory`` whose resizer results are taken up), with ``st`` its swapper's
    counters over this run."""
    pool, s, c = pm.pool, pm.sample, pm.counts
    eng = pm.engine

    def tenant(i: int, pages: int) -> dict[str, Any]:
        return {"now": pages, "peak": s.peak[i], "mean": round(s.mean[i], 2)}

    copy_s = st["reclaim_copy_seconds"]
    return {
        "enabled": True,
        "backend": pool.backend,
        "page_bytes": pool.page_bytes,
        "budget_pages": pool.budget_pages,
        "budget_source": pm.budget.source,
        "trainer_quota_pages": None
        if pm.budget.trainer_quota_bytes is None
        else pm.budget.trainer_quota_bytes // pool.page_bytes,
        "tenants": {"kv": tenant(0, s.kv_pages), "trainer": tenant(1, s.trainer_pages)},
        "kv": {
            "blocks_per_page_group": pm.kv.blocks_per_page,
            "pages_per_group": pm.kv.pages_per_group,
            "max_blocks": pm.kv.max_blocks,
            "blocks_now": pm.kv.num_blocks,
        },
        "grows": {
            "count": c["grows"],
            "pages": c["grow_pages"],
            "seconds": round(c["grow_s"], 6),
            "short": c["grow_short"],
        },
        "shrinks": {
            "count": c["shrinks"],
            "pages": c["shrink_pages"],
            "seconds": round(c["shrink_s"], 6),
        },
        "reclaims": {
            "count": st["reclaims"],
            "pages": st["reclaim_pages"],
            "bytes_spilled": st["reclaim_spilled_bytes"],
            "seconds": round(copy_s, 6),
            "spill_gib_per_s": st["reclaim_spilled_bytes"] / copy_s / 2**30 if copy_s > 0 else None,
            # Of those seconds (GPU): pinning the host buffers, and the copies' own GPU time; the rest waited
            # for the trainer's queued work (the copies are ordered after it) or unmapped.
            "pin_seconds": round(st["reclaim_pin_seconds"], 6),
            "copy_gpu_seconds": round(st["reclaim_copy_gpu_seconds"], 6),
            # The host slabs spills go to (pinned on a GPU), made at set-up or by a larger spill, and kept.
            "host_slab_bytes": pm.swapper.host.nbytes,
            # KV grows that took pages from the trainer: order to mapped, the spill included.
            "grow_ms": percentiles([1e3 * t for t in pm.reclaim_grow_s]),
        },
        "trainer": {
            k: st[k]
            for k in (
                "stashed_bytes",
                "stashed_tensors",
                "passthrough_bytes",
                "swap_out_bytes",
                "swap_in_bytes",
            )
        }
        | {
            "min_stashed_bytes": pm.swapper.min_bytes,
            # The graphs' saved-tensor arena in the stashes (train.cuda_graphs): placed at capture, which on a
            # GPU runs at set-up, before the run's counts start; so a level, not this run's stashed bytes.
            "arena_bytes": pm.swapper.arena_bytes(),
            "placed_bytes": pm._placement.nbytes if pm._placement is not None else 0,
        },
        "refusals": eng.kv_refusals - pm._refusals0 if eng is not None else 0,
    }


def disabled(reason: str) -> dict[str, Any]:
    """``memory.pool`` of a run without the pool."""
    return {"enabled": False, "reason": reason}
