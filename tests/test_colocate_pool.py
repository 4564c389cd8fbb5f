"""The co-located job on one page pool (host backend): the KV cache grows and shrinks with the load off the
decode thread, the trainer is the pool's other tenant, pressure makes it give pages back, and nothing of it
changes what the trainer computes; the recipe keys and the report."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from harli_train.cli import main
from harli_train.colocate import pool_budget as pool_budget_module
from harli_train.colocate.assembly import build_engine
from harli_train.colocate.commands import run_colocated
from harli_train.colocate.pool_budget import (
    GIB,
    PoolBudget,
    host_page_bytes,
    pool_budget,
    spill_reserve_bytes,
)
from harli_train.colocate.pool_memory import PoolMemory
from harli_train.colocate.sm import TimeSliceLadder
from harli_train.config import RecipeError, load_recipe
from harli_train.data.tokenizer import load_tokenizer
from harli_train.engine import RequestRefused, SamplingParams
from harli_train.engine.load import TraceRequest
from harli_train.model import load_model
from harli_train.train.trainer import Trainer

from .runtime_support import adapter, assert_same_adapter, losses, recipe, rows

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
# A pool of 98 pages of 64 KiB: the trainer's stashes and optimizer state take ~67 of them at a step's
# peak, and a few 300-token requests want more than the rest (2 KiB of K/V a token; the test's trace).
PRESSURE = ["colocation.memory_gib=0.006", "train.steps=12", "train.layers_per_microstep=1"]


pytestmark = pytest.mark.usefixtures("one_thread")


def trained_alone(out: Path, *extra: str) -> Path:
    trainer = Trainer(recipe(out, *extra), quiet=True)
    trainer.setup()
    trainer.train()
    return out


def requests_of(run_dir: Path) -> list[dict]:
    path = run_dir / "colocate" / "serve" / "requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_colocated_quickstart_runs_on_the_pool_and_reports_both_tenants(tmp_path):
    summary = run_colocated(recipe(tmp_path / "pool"), "tiny", policy="harli", quiet=True)
    pool = summary["memory"]["pool"]
    assert pool["enabled"] and pool["backend"] == "host" and pool["budget_pages"] > 0
    assert pool["page_bytes"] == host_page_bytes(16 * 2 * 32 * 4)  # the tiny model's fp32 K block
    kv, trainer = pool["tenants"]["kv"], pool["tenants"]["trainer"]
    assert kv["peak"] > 0 and trainer["peak"] > 0 and 0 < kv["mean"] <= kv["peak"]
    assert trainer["now"] > 0 and pool["trainer"]["stashed_bytes"] > 0 and pool["trainer"]["placed_bytes"] > 0
    assert pool["grows"]["count"] >= 1 and pool["refusals"] == 0
    assert {"count", "pages", "bytes_spilled", "seconds", "pin_seconds", "copy_gpu_seconds"} <= pool[
        "reclaims"
    ].keys()
    saved = json.loads((tmp_path / "pool" / "colocate" / "summary.json").read_text())
    assert saved["memory"]["pool"]["tenants"] == pool["tenants"]
    step_rows = rows(tmp_path / "pool")
    assert all({"kv_pages", "trainer_pages", "reclaims"} <= r.keys() for r in step_rows)
    assert max(r["trainer_pages"] for r in step_rows) > 0
    assert (tmp_path / "pool" / "colocate" / "timeline.png").is_file()
    assert all(r["finish_reason"] == "length" for r in requests_of(tmp_path / "pool"))


@pytest.mark.slow
def test_without_the_pool_the_same_run_trains_the_same_adapter(tmp_path):
    """The A/B switch: colocation.memory_pool=false serves from a fixed KV tensor."""
    run_colocated(recipe(tmp_path / "pool"), "tiny", policy="harli", quiet=True)
    plain = run_colocated(
        recipe(tmp_path / "plain", "colocation.memory_pool=false"), "tiny", policy="harli", quiet=True
    )
    assert plain["memory"]["pool"] == {"enabled": False, "reason": "colocation.memory_pool is false"}
    assert "kv_pages" not in rows(tmp_path / "plain")[0]
    assert losses(tmp_path / "pool") == losses(tmp_path / "plain")
    assert_same_adapter(adapter(tmp_path / "pool"), adapter(tmp_path / "plain"))


@pytest.mark.slow
def test_kv_demand_beyond_the_free_pages_takes_pages_from_the_trainer_and_changes_nothing(tmp_path):
    # One burst at once, so the cache must grow at the start whatever the host's speed, and one request of
    # 8x the others' output: once the others finish, their page groups lie idle while it runs (a shrink).
    trace = tmp_path / "burst.jsonl"
    lengths = [30] * 6 + [240]
    trace.write_text("".join(f'{{"arrival_s": 0, "prompt_len": 300, "output_len": {n}}}\n' for n in lengths))
    pressure = [*PRESSURE, f"colocation.trace={trace}"]
    alone = trained_alone(tmp_path / "alone", *pressure)
    summary = run_colocated(recipe(tmp_path / "pressed", *pressure), "tiny", policy="harli", quiet=True)
    pool = summary["memory"]["pool"]
    assert pool["budget_pages"] == int(0.006 * GIB) // pool["page_bytes"]
    # The KV cache wanted more than the pages free: it took pages from the trainer's stashes, mid-training.
    assert pool["reclaims"]["count"] > 0 and pool["reclaims"]["pages"] > 0
    assert pool["tenants"]["kv"]["peak"] + pool["tenants"]["trainer"]["peak"] > pool["budget_pages"]
    assert pool["grows"]["count"] > 0 and pool["shrinks"]["count"] > 0
    assert summary["stop_reason"] == "trained" and summary["serving"]["refused"] == 0
    served = requests_of(tmp_path / "pressed")
    assert served and all(r["finish_reason"] == "length" for r in served), served
    # What was spilled came back: training computed exactly what it computes alone.
    assert losses(tmp_path / "pressed") == losses(alone)
    assert_same_adapter(adapter(tmp_path / "pressed"), adapter(alone))


def engine_on_pool(budget_bytes: int, decode_reserve_tokens: int = 0):
    model = load_model("tiny", torch.float32, "cpu")
    memory = PoolMemory(PoolBudget(budget_bytes, "test", None), torch.device("cpu"), model, (2, 32, 1))
    ladder = TimeSliceLadder.cpu_standin(132)
    load = [TraceRequest(0.0, 20, prompt_len=1000)]  # sizes max_model_len
    engine = build_engine(
        model,
        load_tokenizer("tiny", True),
        ladder,
        load,
        8,
        kv_storage=memory_kv(memory),
        decode_reserve_tokens=decode_reserve_tokens,
    )
    memory.bind(engine.engine)
    return memory, engine


def memory_kv(memory: PoolMemory):
    return lambda spec, cfg: memory.open(spec, cfg.max_num_seqs * cfg.max_blocks_per_seq)


def test_the_cache_grows_for_admission_and_shrinks_in_batches_as_sequences_finish():
    memory, engine = engine_on_pool(32 << 20)
    kv, eng = memory.kv, engine.engine
    one_group = kv.blocks_per_page
    assert kv.num_blocks == eng.block_manager.num_blocks == one_group
    for _ in range(4):  # 4 x 13 blocks: more than the one page group mapped
        eng.add_request(list(range(1, 200)), SamplingParams(max_tokens=20, ignore_eos=True))
    done, deadline = [], time.monotonic() + 60
    while eng.has_unfinished() and time.monotonic() < deadline:
        memory.before_decode(engine)  # orders resizes; the resizer thread maps them meanwhile
        result = eng.step()
        done += result.finished
        if result.kind == "idle":
            time.sleep(1e-3)  # admission waits for the grow
        eng.block_manager.check(eng.scheduler.running)
    assert len(done) == 4 and all(s.finish_reason == "length" for s in done)
    assert memory.counts["grows"] >= 1 and memory.counts["grow_pages"] >= 3 * kv.pages_per_group
    for _ in range(20):  # idle decisions: the idle groups go back in one batch
        memory.before_decode(engine)
        time.sleep(2e-3)
    memory.before_decode(engine)
    assert memory.counts["shrinks"] >= 1 and eng.block_manager.num_blocks == kv.num_blocks
    assert kv.num_blocks <= memory.headroom_blocks + one_group
    memory.close()
    memory.pool.check()


def _blocks_for_two_decoding(reserve: int) -> tuple[int, int]:
    """Two 199-token prompts decoding 8 steps on a pooled cache with ``reserve``: (blocks mapped, blocks
    in use) at the end."""
    memory, engine = engine_on_pool(32 << 20, decode_reserve_tokens=reserve)
    eng, steps = engine.engine, 0
    for _ in range(2):
        eng.add_request(list(range(1, 200)), SamplingParams(max_tokens=500, ignore_eos=True))
    deadline = time.monotonic() + 60
    while steps < 8 and time.monotonic() < deadline:
        memory.before_decode(engine)
        if eng.step().kind == "decode":
            steps += 1
        else:
            time.sleep(1e-3)
    memory.resizer.poke(wait=True)  # (orders run in turn: the grows ordered before it are done)
    memory.before_decode(engine)
    out = (memory.kv.num_blocks, len(eng.block_manager.used_blocks))
    memory.close()
    return out


def test_the_pooled_cache_grows_ahead_by_the_decode_reserve():
    plain_mapped, plain_used = _blocks_for_two_decoding(0)
    mapped, used = _blocks_for_two_decoding(400)  # 25 blocks of 16 tokens a sequence
    assert used == plain_used
    assert mapped >= used + 2 * 24 > plain_mapped  # the reserve is mapped ahead (one group of headroom more)


def test_after_a_trainer_oom_decode_orders_the_idle_groups_unmap_and_only_the_trainer_waits_for_it():
    memory, engine = engine_on_pool(32 << 20)
    kv, eng = memory.kv, engine.engine
    for _ in range(4):  # the cache grows past one page group, then every sequence ends
        eng.add_request(list(range(1, 200)), SamplingParams(max_tokens=4, ignore_eos=True))
    deadline = time.monotonic() + 60
    while eng.has_unfinished() and time.monotonic() < deadline:
        memory.before_decode(engine)
        if eng.step().kind == "idle":
            time.sleep(1e-3)
    grown = kv.num_blocks
    assert not eng.has_unfinished() and grown > memory.headroom_blocks + kv.blocks_per_page
    held, shrink, shrinks = threading.Event(), kv.shrink, memory.counts["shrinks"]
    kv.shrink = lambda n: (held.wait(10), shrink(n))  # the resizer's unmap waits until released
    t0 = time.monotonic()
    ticket = memory.on_trainer_oom()
    assert ticket is not None and time.monotonic() - t0 < 1  # ordered, not waited for
    assert eng.block_manager.num_blocks < grown == kv.num_blocks  # no longer used, still mapped
    trainer_half = threading.Thread(target=memory.after_trainer_oom, args=(ticket,))
    trainer_half.start()
    time.sleep(0.05)
    assert trainer_half.is_alive()  # the trainer's half waits for the unmap
    held.set()
    trainer_half.join(10)
    assert not trainer_half.is_alive() and kv.num_blocks == eng.block_manager.num_blocks
    memory.before_decode(engine)  # the decode thread takes the shrink's result in
    assert memory.counts["shrinks"] == shrinks + 1
    memory.close()
    memory.pool.check()


def test_a_request_beyond_what_the_pool_could_ever_give_is_refused_not_a_crash():
    memory, engine = engine_on_pool(24 * 64 << 10)  # 24 pages: 3 page groups of 16 blocks
    eng = engine.engine
    assert memory.capacity_blocks() == 3 * memory.kv.blocks_per_page
    eng.add_request(list(range(1, 600)), SamplingParams(max_tokens=10, ignore_eos=True))  # 38 blocks: fits
    with pytest.raises(RequestRefused, match="the whole cache has 48"):
        eng.add_request(list(range(1, 900)), SamplingParams(max_tokens=10, ignore_eos=True))
    assert eng.kv_refusals == 1
    memory.close()


def test_pool_keys_are_checked_with_the_key_named(tmp_path):
    with pytest.raises(RecipeError, match=r"colocation.memory_gib: expected a number > 0 or null, got -1"):
        recipe(tmp_path, "colocation.memory_gib=-1")
    with pytest.raises(RecipeError, match=r"colocation.trainer_memory_gib: expected a quota within the pool"):
        recipe(tmp_path, "colocation.memory_gib=2", "colocation.trainer_memory_gib=3")
    with pytest.raises(RecipeError, match=r"colocation.memory_pool: expected true or false"):
        recipe(tmp_path, "colocation.memory_pool=maybe")
    with pytest.raises(RecipeError, match=r"colocation.decode_reserve_tokens: expected an integer >= 0"):
        recipe(tmp_path, "colocation.decode_reserve_tokens=-8")
    cfg = recipe(tmp_path, "colocation.memory_gib=1000000")
    with pytest.raises(
        RecipeError, match=r"colocation.memory_gib: expected at most the [\d.]+ GiB free on this"
    ):
        pool_budget(cfg, torch.device("cpu"))
    budget = pool_budget(
        recipe(tmp_path, "colocation.memory_gib=0.5", "colocation.trainer_memory_gib=0.25"),
        torch.device("cpu"),
    )
    assert (budget.bytes, budget.trainer_quota_bytes, budget.source) == (
        GIB // 2,
        GIB // 4,
        "colocation.memory_gib",
    )
    default = pool_budget(recipe(tmp_path), torch.device("cpu"))
    assert default.bytes > 0 and "margin" in default.source


def test_the_spill_reserve_is_what_a_spill_can_fill_within_an_eighth_of_the_host(tmp_path, monkeypatch):
    # Default: every byte a spill can move (the stashes' bound, within the pool), up to an eighth of the host.
    assert spill_reserve_bytes(10 * GIB, 40 * GIB, None, 128 * GIB) == 10 * GIB
    assert spill_reserve_bytes(100 * GIB, 40 * GIB, None, 128 * GIB) == 16 * GIB
    assert spill_reserve_bytes(100 * GIB, 12 * GIB, None, 1024 * GIB) == 12 * GIB
    # colocation.spill_host_gib: what it says, never more than a spill can fill; 0 pins nothing ahead.
    assert spill_reserve_bytes(20 * GIB, 40 * GIB, 30 * GIB, 128 * GIB) == 20 * GIB
    assert spill_reserve_bytes(20 * GIB, 40 * GIB, 4 * GIB, 128 * GIB) == 4 * GIB
    assert spill_reserve_bytes(20 * GIB, 40 * GIB, 0, 128 * GIB) == 0
    with pytest.raises(
        RecipeError, match=r"colocation.spill_host_gib: expected a number >= 0 or null, got -1"
    ):
        recipe(tmp_path, "colocation.spill_host_gib=-1")
    cfg = recipe(tmp_path, "colocation.memory_gib=0.5", "colocation.spill_host_gib=3")
    assert pool_budget(cfg, torch.device("cpu")).spill_host_bytes == 3 * GIB
    assert pool_budget(recipe(tmp_path), torch.device("cpu")).spill_host_bytes is None
    # On a GPU a reserve past the host memory available is refused with the key named.
    monkeypatch.setattr(pool_budget_module, "available_bytes", lambda device: (40 * GIB, 80 * GIB))
    monkeypatch.setattr(pool_budget_module, "host_bytes", lambda: (2 * GIB, 8 * GIB))
    with pytest.raises(
        RecipeError, match=r"colocation.spill_host_gib: expected at most the 2.00 GiB of host"
    ):
        pool_budget(cfg, torch.device("cuda", 0))


def test_the_cli_refuses_a_pool_budget_past_free_memory_in_one_line(tmp_path):
    args = [
        str(QUICKSTART),
        "--colocate-with",
        "tiny",
        f"output.dir={tmp_path}",
        "colocation.memory_gib=1000000",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "colocation.memory_gib: expected at most the" in result.output and "Traceback" not in result.output


def test_trainer_quota_is_the_trainer_tenants(tmp_path):
    cfg = load_recipe(QUICKSTART, ["colocation.memory_gib=0.5", "colocation.trainer_memory_gib=0.125"])
    budget = pool_budget(cfg, torch.device("cpu"))
    memory, engine = engine_on_pool(budget.bytes)
    memory.close()
    with_quota = PoolMemory(budget, torch.device("cpu"), engine.engine.model, (2, 32, 1))
    with_quota.open(engine.engine.storage.spec, 64)
    assert with_quota.trainer_tenant.stats()["quota_pages"] == (GIB // 8) // with_quota.pool.page_bytes
    with_quota.close()


def test_the_trainer_tenant_gives_its_input_buffers_back_when_detached():
    # On a GPU the trainer's input buffers are made in TrainerMemory's scope: detached, the trainer drops
    # them, so that none outlives the tenant (its close counts every live allocation made in scope).
    from types import SimpleNamespace

    from harli_train.train.batch_buffers import BatchBuffers

    buffers = BatchBuffers("cpu")
    buffers.load(
        {"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long)}
    )
    assert buffers.num_buffers == 2
    trainer = SimpleNamespace(stash_chunk=object(), buffers=buffers, graphs=None)
    memory = PoolMemory.__new__(PoolMemory)
    memory._trainer, memory._placement = trainer, None
    memory.detach()
    assert buffers.num_buffers == 0 and trainer.stash_chunk is None and memory._trainer is None
    memory.detach()  # idempotent
