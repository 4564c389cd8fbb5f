"""The co-located job on one page pool: the KV cache and the trainer as its two tenants.

``PoolMemory`` owns the ``PagePool`` (the driver's VMM on a GPU, memfd pages on a CPU) and its tenants:

- ``kv``: the engine's ``PooledKVStorage``. It grows when the next steps need blocks (running sequences'
  next tokens, the waiting prompts admission would take, a page group of headroom) and shrinks when
  sequences have finished and whole page groups past the blocks in use lie idle (in batches: only once at
  least ``SHRINK_SLACK_GROUPS`` groups beyond the headroom are idle). The decode thread only orders these;
  the ``KVResizer`` thread maps and unmaps, so neither a mapping nor a spill it causes runs inside a step.
- ``trainer``: the ``ActivationSwapper``'s stashes (what each chunk of layers saves for backward, whence the
  pool takes pages back under pressure by spilling them to host memory; backward brings them back), on a
  GPU torch's allocations of the trainer's micro-steps (``TrainerMemory``), and on a CPU, where torch's
  pluggable allocator serves no tensors, the optimizer's state placed explicitly (``OptimizerPlacement``).

The engine's admission sees the pool: a request is refused only when it needs more blocks than the cache
could hold with every free page and every page the trainer could give back (``capacity_blocks``).
Otherwise it waits in the queue until the cache has grown, and the engine's own rules (FCFS admission,
preempting the newest sequence when a block is short) apply as ever. Nothing here raises into the loop:
a grow the pool cannot serve is counted and ordered again a few decisions later.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from harli_train.colocate.kv_resizer import KVResizer, Resized
from harli_train.colocate.memory_hook import CacheReleaseHook
from harli_train.colocate.optimizer_placement import OptimizerPlacement
from harli_train.colocate.pool_budget import (
    PoolBudget,
    chunk_saved_bytes,
    host_bytes,
    host_page_bytes,
    spill_reserve_bytes,
    stash_min_bytes,
)
from harli_train.colocate.pool_report import pool_report
from harli_train.memory import (
    ActivationSwapper,
    PagePool,
    PooledKVStorage,
    PoolError,
    TrainerMemory,
)

log = logging.getLogger(__name__)

HEADROOM_GROUPS = 1  # page groups kept mapped beyond what the next steps need
SHRINK_SLACK_GROUPS = 2  # idle groups beyond the headroom before a shrink is ordered
RETRY_DECISIONS = 8  # decisions between two tries of a grow the pool could not serve
SAMPLE_S = 0.05  # the resizer thread samples the pool's usage this often (and after every order)


@dataclass(frozen=True, slots=True)
class PoolSample:
    """The pool's usage as the resizer thread last saw it (an immutable snapshot the decode thread reads
    instead of calling into the pool, whose lock a mapping holds for milliseconds)."""

    t: float
    free_pages: int
    kv_pages: int
    trainer_pages: int
    reclaimable_pages: int
    reclaims: int  # reclaims that took pages from the trainer so far
    peak: tuple[int, int]  # (kv, trainer) pages, since the run began
    mean: tuple[float, float]  # (kv, trainer) pages, time-weighted since the run began


class PoolMemory(CacheReleaseHook):
    """The pool, its two tenants and the KV cache's resizing (a ``MemoryHook`` for the runtime).

    Build it with ``open(spec, max_blocks)`` from the engine's builder (the KV block decides the host page),
    then ``attach(trainer)`` (again for each new trainer). ``close()`` stops the resizer thread and gives
    the trainer's placed state back to ordinary tensors."""

    def __init__(
        self, budget: PoolBudget, device: torch.device, model: Any, train_shape: tuple[int, int, int]
    ):
        self.budget, self.device, self.model = budget, device, model
        self.train_shape = train_shape  # (batch, seq_len, layers per chunk)
        self.pool: PagePool | None = None
        self.kv: PooledKVStorage | None = None
        self.engine: Any = None
        self._trainer: Any = None
        self._placement: OptimizerPlacement | None = None
        self._acc: dict[str, Any] = {}  # the sample's statistics, the resizer thread's alone
        self._refusals0 = 0
        self.kv_reserve_blocks: int | None = None  # the cache the load wants, kept clear of the trainer

    # ---- set-up ----------------------------------------------------------------------------------
    def open(self, spec: Any, max_blocks: int) -> PooledKVStorage:
        """Create the pool and its tenants around a KV cache of ``spec`` (at most ``max_blocks`` blocks);
        returns the cache for the engine. PoolError when the backend cannot be had."""
        cuda = self.device.type == "cuda"
        block_bytes = spec.bytes_per_block // (2 * spec.num_layers)
        page = host_page_bytes(block_bytes)
        pool = PagePool(
            self.budget.bytes,
            backend="cuda" if cuda else "host",
            device=self.device.index or 0,
            host_page_bytes=page,
            precreate=cuda,  # a GPU claims its pages now; host pages are made as they are first used
        )
        quota_bytes = self.budget.trainer_quota_bytes
        quota = None if quota_bytes is None else max(quota_bytes // pool.page_bytes, 1)
        kv = PooledKVStorage(pool, spec, max_blocks, tenant=pool.add_tenant("kv"))
        tenant = pool.add_tenant("trainer", quota)
        batch, seq_len, layers = self.train_shape
        chunk_bytes = chunk_saved_bytes(self.model.config, batch, seq_len, layers, spec.dtype)
        stashes = -(-self.model.config.num_layers // max(layers, 1))
        swapper = ActivationSwapper(
            pool,
            tenant,
            layer_bytes=chunk_bytes,
            window=1,
            lookahead=1,
            exclude=[*self.model.parameters(), *self.model.buffers()],
            min_bytes=stash_min_bytes(chunk_bytes),
            host_reserve=(
                spill_reserve_bytes(
                    stashes * chunk_bytes, self.budget.bytes, self.budget.spill_host_bytes, host_bytes()[1]
                )
                if cuda
                else 0
            ),
        )
        trainer_memory = TrainerMemory(pool, tenant) if cuda else None
        # Nothing is kept unless all of it could be made (the caller then runs without the pool).
        self.pool, self.trainer_tenant, self.swapper, self.trainer_memory = (
            pool,
            tenant,
            swapper,
            trainer_memory,
        )
        self.kv = kv
        self.headroom_blocks = HEADROOM_GROUPS * self.kv.blocks_per_page
        self.slack_blocks = SHRINK_SLACK_GROUPS * self.kv.blocks_per_page
        self._grow_order: int | None = None
        self._shrink_order = -1
        self._retry_at = 0
        self._decisions = 0
        self._zero_counts()
        self.resizer = KVResizer(self.kv, self._sample, SAMPLE_S)
        slabs = self.swapper.host
        log.info(
            "page pool: %s backend, %d pages of %d KiB (%.2f GiB, %s); KV page group of %d blocks; "
            "%.2f GiB of host slabs for the trainer's spills made in %.1f s",
            pool.backend,
            pool.budget_pages,
            pool.page_bytes >> 10,
            pool.budget_pages * pool.page_bytes / 2**30,
            self.budget.source,
            self.kv.blocks_per_page,
            slabs.nbytes / 2**30,
            slabs.pin_seconds,
        )
        return self.kv

    def _zero_counts(self) -> None:
        self.counts = dict.fromkeys(("grows", "grow_pages", "grow_short", "shrinks", "shrink_pages"), 0)
        self.counts.update(grow_s=0.0, shrink_s=0.0)
        self.reclaim_grow_s: list[float] = []
        self._swap0 = self.swapper.stats_snapshot()

    def attach(self, trainer: Any) -> None:
        """Make ``trainer`` the trainer tenant: its chunks' saved tensors go to the swapper's stashes (with
        ``train.cuda_graphs``, the graphs' saved-tensor arena is placed there, and on a GPU the graphs
        capture into the tenant's MemPool), and on a CPU its optimizer state into pool pages (the previous
        trainer's is given back first)."""
        self.detach()
        trainer.stash_chunk = self.swapper.layer  # eager steps (and those after a failed capture)
        if trainer.graphs is not None:
            capture = self.trainer_memory.capture if self.trainer_memory is not None else None
            trainer.graphs.use_memory(self.swapper, capture)
        if self.pool.backend == "host":
            self._placement = OptimizerPlacement(self.pool, self.trainer_tenant, trainer.optimizer)
        self._trainer = trainer

    def detach(self) -> None:
        """The trainer stops being the tenant: its stashes and placed state go back, and its input buffers
        (made in the tenant's scope on a GPU, so they would outlive TrainerMemory) are dropped."""
        if self._trainer is None:
            return
        self._trainer.stash_chunk = None
        if self._trainer.graphs is not None:
            self._trainer.graphs.use_memory(None)
        self._trainer.buffers.release()
        if self._placement is not None:
            self._placement.release()
            self._placement = None
        self._trainer = None

    def fit_blocks(self, num_blocks: int) -> int:
        """Set-up only (no steps running): map page groups for ``num_blocks`` blocks, as many as the free
        pages allow, or unmap down to them; returns the blocks the cache now holds. The profile runs on a
        cache this size (its synthetic steps read distinct blocks), the run starts from what it then needs."""
        kv, eng = self.kv, self.engine
        if num_blocks < kv.num_blocks:
            keep = self._round(num_blocks)
            if eng is None or eng.shrink_kv_blocks(keep):  # the engine lets go of the blocks first
                kv.shrink(keep)
        else:
            spare = self.pool.free_pages // kv.pages_per_group * kv.blocks_per_page
            kv.grow(min(num_blocks, kv.num_blocks + spare))
        if eng is not None:
            eng.grow_kv_blocks(kv.num_blocks)
        return kv.num_blocks

    def bind(self, engine: Any) -> None:
        """The engine over ``kv``: its admission asks ``capacity_blocks`` what it may accept."""
        self.engine = engine
        engine.kv_capacity = self.capacity_blocks

    # ---- the MemoryHook ---------------------------------------------------------------------------
    @property
    def sample(self) -> PoolSample:
        return self.resizer.snapshot

    def begin_run(self) -> None:
        """A run starts: peaks, means and refusals count from now."""
        self.resizer.poke(reset=True, wait=True)
        self._take_results()  # what set-up resized is not the run's
        self._zero_counts()
        self._refusals0 = self.engine.kv_refusals if self.engine is not None else 0

    def trainer_scope(self) -> contextlib.AbstractContextManager:
        """Around each trainer micro-step: on a GPU its torch allocations go to the pool."""
        if self.trainer_memory is None:
            return contextlib.nullcontext()
        return self.trainer_memory.scope()

    def trainer_bytes(self) -> int:
        """The pool's pages the trainer tenant holds."""
        return self.trainer_tenant.stats()["used_pages"] * self.pool.page_bytes

    def trainer_peak_bytes(self) -> int:
        """The most pages the trainer tenant has held (its saved tensors' stashes included)."""
        return self.trainer_tenant.stats()["peak_pages"] * self.pool.page_bytes

    def trainer_room_bytes(self) -> int:
        """Free pages less those the KV cache would map to hold ``kv_reserve_blocks`` (default: its largest
        size): what the trainer's cached working sets may take and still leave decode the cache its load
        wants (those pages are no stashes: the pool cannot take them back)."""
        kv = self.kv
        want = kv.max_blocks if self.kv_reserve_blocks is None else min(self.kv_reserve_blocks, kv.max_blocks)
        groups = max(-(-want // kv.blocks_per_page) - kv.num_blocks // kv.blocks_per_page, 0)
        return max(self.pool.free_pages - groups * kv.pages_per_group, 0) * self.pool.page_bytes

    def capacity_blocks(self) -> int:
        """Blocks the cache could hold: those mapped, plus the page groups that the free pages and the pages
        the trainer could give back would map (the last sample's figures), at most ``max_blocks``."""
        s, kv = self.sample, self.kv
        spare = 0 if s is None else s.free_pages + s.reclaimable_pages
        groups = kv.num_blocks // kv.blocks_per_page + spare // kv.pages_per_group
        return min(kv.max_blocks, groups * kv.blocks_per_page)

    def before_decode(self, engine: Any) -> None:
        """Decode thread, before each engine step:
        take in finished resizes, order what the next steps need."""
        eng = engine.engine
        if self.engine is not eng:
            self.bind(eng)
        self._decisions += 1
        self._take_results()
        bm = eng.block_manager
        want = self._round(self._demand(eng))
        if want > bm.num_blocks:
            if self._grow_order is None and self._decisions >= self._retry_at:
                self._grow_order = self.resizer.grow(want)
        elif self._grow_order is None and bm.num_blocks - want >= self.slack_blocks:
            keep = self._round(max(max(bm.used_blocks, default=-1) + 1, want))
            if keep < bm.num_blocks and eng.shrink_kv_blocks(keep):
                self._shrink_order = self.resizer.shrink(keep)

    def on_trainer_oom(self) -> int | None:
        """Decode thread, after the trainer ran out of memory: stop using the cache's idle page groups and
        order their unmap (the resizer's thread does it); returns the order to wait for (None: none)."""
        eng = self.engine
        if eng is None:
            return None
        self._take_results()
        bm = eng.block_manager
        keep = self._round(max(bm.used_blocks, default=-1) + 1 + self.headroom_blocks)
        if self._grow_order is None and keep < bm.num_blocks and eng.shrink_kv_blocks(keep):
            self._shrink_order = self.resizer.shrink(keep)
            return self._shrink_order
        return None

    def after_trainer_oom(self, ticket: int | None) -> None:
        """Trainer's thread: its own empty stashes' pages back to the pool, torch's cached blocks too, and
        wait for the cache's unmap ordered by ``on_trainer_oom`` (``ticket``), so its next try finds them."""
        super().after_trainer_oom(ticket)
        self.swapper.release_idle()
        if ticket is not None:
            self.resizer.wait(ticket)

    def step_row(self) -> dict[str, Any]:
        """Fields for the runtime's step records: pages per tenant and reclaims so far (last sample)."""
        s = self.sample
        if s is None:
            return {}
        return {"kv_pages": s.kv_pages, "trainer_pages": s.trainer_pages, "reclaims": s.reclaims}

    # ---- internals --------------------------------------------------------------------------------
    def _round(self, blocks: int) -> int:
        per = self.kv.blocks_per_page
        return min(self.kv.max_blocks, -(-max(blocks, 1) // per) * per)

    def _demand(self, eng: Any) -> int:
        """Blocks the next steps use: those in use, each running sequence's next token (and the tokens the
        engine's ``decode_reserve_tokens`` keeps room for: ``Scheduler.reach``), the prompts admission would
        take next (FCFS, up to the batch limit) with their reserve, and the headroom."""
        bm, sched = eng.block_manager, eng.scheduler
        need = sum(bm.blocks_needed(s, max(len(s) + 1, sched.reach(s))) for s in sched.running)
        room = max(eng.config.max_num_seqs - len(sched.running), 0)
        need += sum(bm.blocks_needed(s, sched.reach(s)) for s in itertools.islice(sched.waiting, room))
        return bm.num_blocks - bm.num_free + need + self.headroom_blocks

    def _take_results(self) -> None:
        for r in self.resizer.results():
            self._count(r)
            if r.kind == "grow":
                if r.order > self._shrink_order:
                    self.engine.grow_kv_blocks(r.num_blocks)
                if r.order == self._grow_order:
                    self._grow_order = None
                    if r.error is not None:
                        self._retry_at = self._decisions + RETRY_DECISIONS

    def _count(self, r: Resized) -> None:
        c, kind = self.counts, r.kind
        if r.pages:
            c[f"{kind}s"] += 1
            c[f"{kind}_pages"] += r.pages
            c[f"{kind}_s"] += r.seconds
        if kind == "grow" and r.error is not None:
            c["grow_short"] += 1
        if kind == "grow" and r.reclaimed:
            self.reclaim_grow_s.append(r.seconds)  # a grow that waited for the trainer's spill

    def _sample(self, reset: bool) -> PoolSample:
        """Resizer thread: read the pool (its lock is this thread's to wait for) and the swapper; fold the
        figures into the run's peaks and time-weighted means (``reset``: a run starts now)."""
        now = time.perf_counter()
        pages = (self.kv.tenant.stats()["used_pages"], self.trainer_tenant.stats()["used_pages"])
        acc = self._acc
        if reset or not acc:
            acc.update(t0=now, t=now, area=[0.0, 0.0], peak=list(pages), last=pages)
        dt = now - acc["t"]
        for i in (0, 1):
            acc["area"][i] += dt * acc["last"][i]
            acc["peak"][i] = max(acc["peak"][i], pages[i])
        acc["t"], acc["last"] = now, pages
        span = now - acc["t0"]
        mean = tuple(a / span if span > 0 else float(p) for a, p in zip(acc["area"], pages, strict=True))
        return PoolSample(
            now,
            self.pool.free_pages,
            pages[0],
            pages[1],
            self.swapper.reclaimable_pages(),
            self.swapper.stats_snapshot()["reclaims"],
            (acc["peak"][0], acc["peak"][1]),
            mean,
        )

    # ---- the report -------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """``memory.pool`` of the run's summary."""
        self.resizer.poke(wait=True)
        self._take_results()
        now = self.swapper.stats_snapshot()
        return pool_report(self, {k: v - self._swap0[k] for k, v in now.items()})  # this run's figures

    def close(self) -> None:
        """Stop the resizer, give the trainer's placed state back, release TrainerMemory's pages (GPU).
        The pool itself goes when nothing refers to its pages any more (the engine's cache views them)."""
        if self.pool is None:
            return
        self.resizer.close()
        self.detach()
        if self.trainer_memory is not None:
            try:
                self.trainer_memory.close()
            except PoolError as err:
                # torch still holds pool memory: the pool must outlive it, through interpreter exit too.
                log.warning("%s; the page pool is kept until the process exits", err)
                self.pool._close.atexit = False
        self.trainer_memory = None
