"""The VMM page pool on its host backend (memfd pages, same semantics as CUDA VMM): mapping, data,
exhaustion, accounting under random and concurrent use, the torch allocator pair, the KV storage and
the activation swapper's bit-identical training."""

from __future__ import annotations

import contextlib
import ctypes
import random
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest
import torch

from harli_train.memory import (
    ActivationSwapper,
    PagePool,
    PooledKVStorage,
    PoolError,
    PoolExhausted,
    QuotaExceeded,
    TrainerMemory,
    native,
)

PAGE = 4096  # host pages as small as the OS allows keep the tests fast


def host_pool(pages: int) -> PagePool:
    return PagePool(pages * PAGE, backend="host", host_page_bytes=PAGE)


@dataclass(frozen=True)
class Spec:
    """The fields PooledKVStorage reads from the engine's KVCacheSpec."""

    num_layers: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype


def test_library_loads_and_picks_the_host_backend_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert not native.cuda_driver_available()
    with PagePool(8 * PAGE, host_page_bytes=PAGE) as pool:
        assert (pool.backend, pool.device.type, pool.page_bytes, pool.budget_pages) == (
            "host",
            "cpu",
            PAGE,
            8,
        )
    with pytest.raises(PoolError, match=r"CUDA backend unavailable: dlopen\(libcuda.so.1\) failed"):
        PagePool(8 * PAGE, backend="cuda")
    with pytest.raises(PoolError, match="less than one page"):
        host_pool(0)
    with pytest.raises(PoolError, match="not a positive multiple of the OS page"):
        PagePool(8 * PAGE, backend="host", host_page_bytes=1000)
    with pytest.raises(PoolError, match="needs the CUDA backend"), host_pool(4) as pool:
        TrainerMemory(pool, pool.add_tenant("trainer"))


def test_a_missing_native_library_is_a_clear_error(monkeypatch):
    native._lib.cache_clear()
    monkeypatch.setattr(native, "native_library_path", lambda: None)
    try:
        with pytest.raises(PoolError, match=r"harli_train._vmm\) is not built: run `pip install -e .`"):
            host_pool(4)
    finally:
        native._lib.cache_clear()


def test_map_unmap_remap_semantics():
    with host_pool(16) as pool:
        kv = pool.add_tenant("kv")
        region = pool.reserve(kv, 8)
        assert region.va % PAGE == 0 and region.mapped() == [False] * 8 and pool.free_pages == 16
        region.map([0, 1, 2, 5])
        assert region.mapped() == [True, True, True, False, False, True, False, False]
        assert kv.stats()["used_pages"] == 4 and pool.free_pages == 12
        with pytest.raises(PoolError, match="slot 2 of region .* is already mapped"):
            region.map([3, 2])  # all or nothing: 3 stays unmapped
        with pytest.raises(PoolError, match="slot 3 of region .* is not mapped"):
            region.unmap([2, 3])  # all or nothing: 2 stays mapped
        with pytest.raises(PoolError, match="outside region"):
            region.map([8])
        assert region.mapped()[2:4] == [True, False]
        region.unmap([1])
        assert pool.free_pages == 13 and not region.mapped()[1]
        region.map([1])
        stats = pool.stats()
        # One set-access per run of consecutive slots: [0, 1, 2], [5], then the remapped [1].
        assert (stats["map_calls"], stats["set_access_calls"], stats["unmap_calls"]) == (5, 3, 1)
        assert pool.find(region.va + 5 * PAGE + 7) == region.id and pool.find(region.va + 8 * PAGE) is None
        pool.check()
        region.release()
        assert (kv.stats()["regions"], kv.stats()["used_pages"]) == (0, 0)
        assert pool.free_pages == 16 and pool.stats()["regions"] == 0
        pool.check()


def test_data_written_through_a_mapping_survives_remapping_of_other_pages():
    rng = random.Random(0)
    with host_pool(24) as pool:
        region = pool.reserve(pool.add_tenant("kv"), 16)
        region.map(range(16))
        data = region.as_tensor().view(16, PAGE)
        stable = [0, 3, 7, 12]
        data[stable] = torch.randint(0, 256, (len(stable), PAGE), dtype=torch.uint8)
        expected = data[stable].clone()
        others = [p for p in range(16) if p not in stable]
        for _ in range(40):
            pick = rng.sample(others, 5)
            region.unmap(pick)
            region.map(pick)
            data[pick] = rng.randrange(256)  # a remapped page is writable again
            assert torch.equal(data[pick], torch.full((5, PAGE), data[pick[0], 0].item(), dtype=torch.uint8))
        assert torch.equal(data[stable], expected)
        pool.check()


_FAULT_CHILD = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
V, S, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
lib.hvmm_pool_create.argtypes = [I, I, S, S, I, ctypes.POINTER(V)]
lib.hvmm_tenant_add.argtypes = [V, ctypes.c_char_p, S, ctypes.POINTER(I)]
lib.hvmm_region_reserve.argtypes = [V, I, S, ctypes.POINTER(I), ctypes.POINTER(ctypes.c_uint64)]
lib.hvmm_region_map.argtypes = [V, I, ctypes.POINTER(S), S]
pool, tenant, region, va = V(), I(), I(), ctypes.c_uint64()
assert lib.hvmm_pool_create(2, 0, 4 * 4096, 4096, 1, ctypes.byref(pool)) == 0
assert lib.hvmm_tenant_add(pool, b"kv", 0, ctypes.byref(tenant)) == 0
assert lib.hvmm_region_reserve(pool, tenant, 2, ctypes.byref(region), ctypes.byref(va)) == 0
assert lib.hvmm_region_map(pool, region, (S * 1)(0), 1) == 0
ctypes.memset(va.value, 7, 4096)
print("mapped page reads", ctypes.string_at(va.value, 1)[0], flush=True)
ctypes.string_at(va.value + 4096, 1)  # slot 1 is reserved but unmapped
print("unreachable", flush=True)
"""


def test_touching_an_unmapped_page_faults_like_an_illegal_address():
    child = subprocess.run(
        [sys.executable, "-c", _FAULT_CHILD, native.native_library_path()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.stdout.splitlines() == ["mapped page reads 7"]
    assert child.returncode == -signal.SIGSEGV


def test_exhaustion_is_a_clear_error_and_leaves_the_pool_consistent():
    with host_pool(8) as pool:
        kv, trainer = pool.add_tenant("kv"), pool.add_tenant("trainer", quota_pages=3)
        a, b = pool.reserve(kv, 8), pool.reserve(trainer, 8)
        a.map(range(5))
        b.map(range(2))
        before = (a.mapped(), b.mapped(), pool.free_pages, kv.stats(), trainer.stats())
        with pytest.raises(
            PoolExhausted,
            match=r"page pool exhausted: tenant 'kv' asked for 3 pages, 1 of 8 "
            r"are free \(pages owned: kv=5, trainer=2\)",
        ):
            a.map([5, 6, 7])
        with pytest.raises(
            QuotaExceeded, match="tenant 'trainer' is at its quota: owns 2 of 3 pages and asked for 2 more"
        ):
            b.map([2, 3])
        assert (a.mapped(), b.mapped(), pool.free_pages, kv.stats(), trainer.stats()) == before
        pool.check()
        a.map([5])
        with pytest.raises(PoolExhausted, match="0 of 8 are free"):
            b.map([2])
        stats = pool.stats()
        assert (stats["exhausted_errors"], stats["quota_errors"], stats["free_pages"]) == (2, 1, 0)
        pool.check()


def test_torch_allocator_pair_maps_whole_pages_of_the_bound_tenant():
    lib = native._lib()
    with host_pool(16) as pool:
        trainer = pool.add_tenant("trainer", quota_pages=6)
        lib.hvmm_torch_bind(None, -1)
        assert lib.hvmm_torch_alloc(PAGE, 0, None) is None  # nothing bound
        lib.hvmm_torch_bind(pool._handle, trainer.id)
        try:
            ptr = lib.hvmm_torch_alloc(3 * PAGE + 1, 0, None)
            assert ptr % PAGE == 0 and pool.find(ptr) is not None
            assert trainer.stats()["used_pages"] == 4
            ctypes.memset(ptr, 0xAB, 4 * PAGE)
            assert ctypes.string_at(ptr + 4 * PAGE - 1, 1) == b"\xab"
            assert lib.hvmm_torch_alloc(3 * PAGE, 0, None) is None  # 4 + 3 pages > quota of 6
            assert pool.stats()["regions"] == 1  # the failed allocation left nothing behind
            pool.check()
            # Closing under a live torch allocation would leave torch with dangling memory: refused.
            with pytest.raises(PoolError, match="torch still holds 1 allocation"):
                pool.close()
            assert ctypes.string_at(ptr, 1) == b"\xab"
            lib.hvmm_torch_free(ptr, 3 * PAGE + 1, 0, None)
            stats = pool.stats()
            assert (stats["torch_allocs"], stats["torch_frees"], stats["regions"]) == (1, 1, 0)
            assert trainer.stats()["used_pages"] == 0 and pool.find(ptr) is None
            pool.check()
        finally:
            lib.hvmm_torch_bind(None, -1)


def test_kv_storage_grows_and_shrinks_in_place_like_a_plain_tensor_cache():
    spec = Spec(num_layers=3, block_shape=(4, 2, 8), dtype=torch.float32)  # 256 B: 16 blocks per page
    with host_pool(24) as pool:
        kv = PooledKVStorage(pool, spec, max_blocks=60)
        assert (kv.blocks_per_page, kv.max_blocks, kv.num_blocks) == (16, 64, 16)
        assert kv.tenant.stats()["used_pages"] == 6  # group 0: page 0 of each of the 6 K/V planes
        plain = torch.zeros(3, 2, 64, *spec.block_shape)
        ptrs = [(kv.k_cache(layer).data_ptr(), kv.v_cache(layer).data_ptr()) for layer in range(3)]

        def write(blocks: range) -> None:
            for layer in range(3):
                for k_or_v, cache in ((0, kv.k_cache(layer)), (1, kv.v_cache(layer))):
                    values = torch.randn(len(blocks), *spec.block_shape)
                    cache[blocks.start : blocks.stop] = values
                    plain[layer, k_or_v, blocks.start : blocks.stop] = values

        def same(n: int) -> bool:
            return all(
                torch.equal(kv.k_cache(i)[:n], plain[i, 0, :n])
                and torch.equal(kv.v_cache(i)[:n], plain[i, 1, :n])
                for i in range(3)
            )

        write(range(0, 16))
        assert kv.grow(40) == 48 and kv.tenant.stats()["used_pages"] == 18
        write(range(16, 48))
        assert same(48) and kv.k_cache(0).shape == (48, *spec.block_shape) and kv.k_cache(0).is_contiguous()
        assert kv.shrink(20) == 32 and same(32)
        assert kv.shrink(0) == 16 and same(16)  # group 0 always stays
        assert kv.grow(1000) == 64 and kv.tenant.stats()["used_pages"] == 24
        write(range(16, 64))
        assert same(64)
        assert [(kv.k_cache(i).data_ptr(), kv.v_cache(i).data_ptr()) for i in range(3)] == ptrs
        assert torch.equal(kv.pages()[2, 1, 3, 5], plain[2, 1, 3 * 16 + 5])
        assert kv.pages().shape == (3, 2, 4, 16, *spec.block_shape)
        pool.check()
        with pytest.raises(ValueError, match="does not divide the pool page"):
            PooledKVStorage(pool, Spec(1, (3, 5), torch.float32), max_blocks=8, tenant=kv.tenant)


def test_kv_storage_meets_the_engine_protocol():
    kv_cache = pytest.importorskip("harli_train.engine.kv_cache")
    spec = kv_cache.KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    with host_pool(8) as pool:
        kv = PooledKVStorage(pool, spec, max_blocks=64)
        assert isinstance(kv, kv_cache.KVStorage) and kv.spec is spec
        assert kv.k_cache(1).shape == (kv.num_blocks, *spec.block_shape)


def test_kv_growth_asks_the_trainer_to_give_pages_back():
    with host_pool(12) as pool:
        kv = PooledKVStorage(
            pool, Spec(1, (1024,), torch.float32), max_blocks=6
        )  # 1 block per page, 2 planes
        trainer = pool.add_tenant("trainer")
        held = pool.reserve(trainer, 10)
        held.map(range(10))
        assert pool.free_pages == 0

        def give_back(n_pages: int) -> int:
            mapped = [s for s, m in enumerate(held.mapped()) if m][:n_pages]
            held.unmap(mapped)
            return len(mapped)

        pool.register_reclaimer(trainer, give_back)
        assert kv.grow(3) == 3 and trainer.stats()["used_pages"] == 6
        assert pool.reclaim_stats["pages_freed"] == 4
        pool.register_reclaimer(trainer, lambda n: 0)
        assert kv.grow(6) == 6  # the first reclaimer gave its last 6 pages
        with pytest.raises(PoolExhausted, match=r"after reclaiming 0 of 2 pages from other tenants"):
            PooledKVStorage(pool, Spec(1, (1024,), torch.float32), max_blocks=2, tenant=kv.tenant)
        pool.check()


def test_random_alloc_free_reclaim_sequences_keep_the_books():
    rng = random.Random(1234)
    lib = native._lib()
    with host_pool(40) as pool:
        kv, trainer = pool.add_tenant("kv"), pool.add_tenant("trainer", quota_pages=25)
        regions = [pool.reserve(kv, 30)] + [pool.reserve(trainer, 10) for _ in range(3)]
        owned = {r.id: set() for r in regions}  # the test's own books
        torch_allocs: dict[int, int] = {}  # ptr -> pages

        def reclaim(n: int) -> int:
            freed = 0
            for r in regions[1:]:
                take = sorted(owned[r.id])[: n - freed]
                r.unmap(take)
                owned[r.id] -= set(take)
                freed += len(take)
            return freed

        pool.register_reclaimer(trainer, reclaim)
        lib.hvmm_torch_bind(pool._handle, trainer.id)
        try:
            for _ in range(400):
                op = rng.random()
                region = rng.choice(regions)
                # Mostly valid slots, sometimes any slots (refused as already mapped / not mapped).
                mapped = owned[region.id] if op >= 0.55 else set(range(region.n_pages)) - owned[region.id]
                pool_of = sorted(mapped) if mapped and rng.random() < 0.9 else list(range(region.n_pages))
                slots = rng.sample(pool_of, min(len(pool_of), rng.randint(1, 4)))
                try:
                    if op < 0.55:
                        region.map(slots, reclaim=region is regions[0])
                        owned[region.id] |= set(slots)
                    elif op < 0.8:
                        region.unmap(slots)
                        owned[region.id] -= set(slots)
                    elif op < 0.9:
                        pages = rng.randint(1, 3)
                        ptr = lib.hvmm_torch_alloc(pages * PAGE - 7, 0, None)
                        if ptr is not None:
                            torch_allocs[ptr] = pages
                    elif torch_allocs:
                        ptr = rng.choice(list(torch_allocs))
                        lib.hvmm_torch_free(ptr, 0, 0, None)
                        del torch_allocs[ptr]
                except PoolError:
                    pass  # refused calls change nothing, which the books below check
                pool.check()
                trainer_pages = sum(len(owned[r.id]) for r in regions[1:]) + sum(torch_allocs.values())
                assert kv.stats()["used_pages"] == len(owned[regions[0].id])
                assert trainer.stats()["used_pages"] == trainer_pages <= 25
                assert pool.free_pages == 40 - len(owned[regions[0].id]) - trainer_pages
                assert all(
                    region.mapped() == [s in owned[region.id] for s in range(region.n_pages)]
                    for region in regions
                )
        finally:
            lib.hvmm_torch_bind(None, -1)
        assert pool.stats()["exhausted_errors"] > 0 and pool.reclaim_stats["pages_freed"] > 0


def test_concurrent_use_from_threads_keeps_data_and_books():
    with host_pool(48) as pool:
        tenant = pool.add_tenant("kv")
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            region = pool.reserve(tenant, 12)
            data = region.as_tensor().view(12, PAGE)
            mine: set[int] = set()
            try:
                for _ in range(250):
                    if rng.random() < 0.55 and len(mine) < 12:
                        slots = rng.sample([s for s in range(12) if s not in mine], 1)
                        with contextlib.suppress(PoolExhausted):
                            region.map(slots)
                            mine |= set(slots)
                            data[slots] = seed
                    elif mine:
                        slot = rng.choice(sorted(mine))
                        assert torch.all(data[slot] == seed), "another thread's page showed up in mine"
                        region.unmap([slot])
                        mine.discard(slot)
                assert all(torch.all(data[s] == seed) for s in mine)
                region.release()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        stats = pool.stats()
        assert stats["owned_pages"] == 0 and stats["map_calls"] == stats["unmap_calls"] > 0
        pool.check()


def _train(
    steps: int,
    swapper: ActivationSwapper | None = None,
    after_forward=None,
    mid_backward=None,
    *,
    rows: int = 32,
    device: str = "cpu",
):
    """A residual MLP stack trained with SGD on ``rows`` rows; returns losses and final parameters."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        for _ in range(6)
    ).to(device)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.05)
    x, y = torch.randn(rows, 64).to(device), torch.randn(rows, 64).to(device)
    losses = []
    for _ in range(steps):
        h = x
        for i, block in enumerate(blocks):
            with swapper.layer(i) if swapper else contextlib.nullcontext():
                h = h + block(h)
            if i == 3 and mid_backward is not None:
                h.register_hook(lambda grad: mid_backward())
        loss = torch.nn.functional.mse_loss(h, y)
        if after_forward is not None:
            after_forward()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in blocks.parameters()]


def test_swapping_activations_under_reclaim_leaves_training_bit_identical():
    losses, params = _train(3)
    with host_pool(150) as pool:
        trainer = pool.add_tenant("trainer")
        swapper = ActivationSwapper(pool, trainer, layer_bytes=32 * PAGE, window=1, lookahead=1)
        kv = PooledKVStorage(pool, Spec(1, (1024,), torch.float32), max_blocks=60)  # 2 pages per block

        def decode_burst() -> None:  # the KV cache takes 20 pages more than are free, then frees them again
            before = trainer.stats()["used_pages"]
            kv.grow(kv.num_blocks + (pool.free_pages + 20) // 2)
            assert trainer.stats()["used_pages"] <= before - 20
            kv.shrink(1)

        got_losses, got_params = _train(3, swapper, after_forward=decode_burst, mid_backward=decode_burst)
        assert got_losses == losses
        assert all(torch.equal(a, b) for a, b in zip(got_params, params, strict=True))
        stats = swapper.stats
        assert stats["swap_out_bytes"] > 0 and stats["swap_in_bytes"] > 0 and stats["passthrough_bytes"] == 0
        assert pool.reclaim_stats["calls"] == 6 and pool.reclaim_stats["pages_freed"] >= 6 * 20
        pool.check()


def test_spills_reuse_their_host_slabs_and_a_stash_spans_several():
    """Spilled bytes go to host slabs kept for the run: slabs of a page each (a stash spans several, copied
    out and back slab by slab), a second run of the same bursts makes no new slab, and training stays
    bit-identical; a reserve makes them up front."""
    losses, params = _train(3)
    with host_pool(150) as pool:
        trainer = pool.add_tenant("trainer")
        swapper = ActivationSwapper(
            pool, trainer, layer_bytes=32 * PAGE, slab_bytes=PAGE, host_reserve=3 * PAGE
        )
        assert swapper.host.count == 3 and swapper.host.nbytes == 3 * PAGE
        kv = PooledKVStorage(pool, Spec(1, (1024,), torch.float32), max_blocks=60)

        def decode_burst() -> None:
            kv.grow(kv.num_blocks + (pool.free_pages + 20) // 2)
            kv.shrink(1)

        got_losses, got_params = _train(3, swapper, after_forward=decode_burst, mid_backward=decode_burst)
        assert got_losses == losses
        assert all(torch.equal(a, b) for a, b in zip(got_params, params, strict=True))
        spilled, made = swapper.stats["swap_out_bytes"], swapper.host.count
        assert spilled > 0 and made > 3
        again, _ = _train(3, swapper, after_forward=decode_burst, mid_backward=decode_burst)
        assert again == losses
        assert swapper.stats["swap_out_bytes"] > spilled and swapper.host.count == made  # reused, none made
        pool.check()


def test_a_reserve_the_host_refuses_part_way_keeps_what_it_pinned_and_warns(monkeypatch, caplog):
    """Pinned memory refused at set-up (the host's RAM or its locked-memory limit) ends the reserve with a
    warning; the slabs made stay, and spills make more as they need them."""
    from harli_train.memory import host_slabs

    slabs = host_slabs.HostSlabs(slab_bytes=PAGE)
    made = slabs._make

    def refused_after_two() -> torch.Tensor:
        if slabs.count >= 2:
            raise torch.OutOfMemoryError("CUDA error: out of memory (cudaHostAlloc)")
        return made()

    monkeypatch.setattr(slabs, "_make", refused_after_two)
    with caplog.at_level("WARNING", logger=host_slabs.__name__):
        assert slabs.reserve(5 * PAGE) == 2 * PAGE
    assert slabs.count == 2 and "pinned 0.00 GiB of the 0.00 GiB" in caplog.text
    monkeypatch.setattr(slabs, "_make", made)
    assert len(slabs.take(3 * PAGE)) == 3 and slabs.count == 3  # the two kept, one more made


def test_release_idle_gives_back_only_empty_stashes_and_training_stays_identical():
    losses, params = _train(3)
    with host_pool(150) as pool:
        trainer = pool.add_tenant("trainer")
        swapper = ActivationSwapper(pool, trainer, layer_bytes=32 * PAGE, window=1, lookahead=1)
        freed_mid_forward = []

        def mid_forward() -> None:  # stashes hold saved tensors: nothing is given back
            freed_mid_forward.append(swapper.release_idle())

        got_losses, got_params = _train(3, swapper, after_forward=mid_forward)
        held = trainer.stats()["used_pages"]
        assert held > 0 and freed_mid_forward == [0, 0, 0]
        assert swapper.release_idle() == held and trainer.stats()["used_pages"] == 0  # after backward: all
        assert got_losses == losses
        assert all(torch.equal(a, b) for a, b in zip(got_params, params, strict=True))
        again, _ = _train(3, swapper)  # the stashes map their pages again
        assert again == losses and trainer.stats()["used_pages"] == held
        assert swapper.stats["swap_out_bytes"] == 0  # empty stashes are unmapped, never copied
        pool.check()


def test_swapper_leaves_parameters_and_their_views_in_place():
    torch.manual_seed(0)
    frozen = torch.nn.Linear(64, 256).requires_grad_(False)  # a LoRA base weight: saved as weight.t()
    x = torch.randn(32, 64, requires_grad=True)
    with host_pool(64) as pool:
        swapper = ActivationSwapper(pool, pool.add_tenant("trainer"), layer_bytes=16 * PAGE)
        with swapper.layer(0):
            y = torch.nn.functional.gelu(frozen(x))
        y.sum().backward()
        grad = x.grad.clone()
        assert swapper.stats["stashed_bytes"] == 32 * 256 * 4  # gelu's input, not the 64 KiB weight
        x.grad = None
        torch.nn.functional.gelu(frozen(x)).sum().backward()
        assert torch.equal(x.grad, grad)
        pool.check()


def test_saved_tensors_under_min_bytes_stay_ordinary_tensors_and_training_is_the_same():
    """A saved activation under ``min_bytes`` is not copied into the stash (each pack costs the launching
    thread the same whatever its size); the gradients are those of a run without the swapper. The co-located
    threshold scales with the chunk's reserve, from 4 KiB to 1 MiB."""
    from harli_train.colocate.pool_budget import STASH_MIN_CAP, STASH_MIN_FLOOR, stash_min_bytes

    assert stash_min_bytes(1 << 20) == STASH_MIN_FLOOR
    assert stash_min_bytes(64 << 20) == 32 << 10
    assert stash_min_bytes(14 << 30) == STASH_MIN_CAP  # Llama-3-8B's 4-layer chunk at 4 x 1024
    torch.manual_seed(0)
    w1, w2 = torch.randn(64, 256, requires_grad=True), torch.randn(256, 4, requires_grad=True)
    x = torch.randn(32, 64)

    def run(swapper: ActivationSwapper | None) -> list[torch.Tensor]:
        with swapper.layer(0) if swapper else contextlib.nullcontext():
            h = torch.tanh(x @ w1)  # saves x (32 x 64 fp32, 8 KiB) and h (32 x 256, 32 KiB)
            y = torch.sigmoid(h @ w2)  # saves h (again: one copy) and y (32 x 4, 512 B)
        y.sum().backward()
        grads = [w1.grad.clone(), w2.grad.clone()]
        w1.grad = w2.grad = None
        return grads

    want = run(None)
    with host_pool(64) as pool:
        swapper = ActivationSwapper(
            pool, pool.add_tenant("trainer"), layer_bytes=16 * PAGE, min_bytes=16 << 10
        )
        got = run(swapper)
        assert swapper.stats["stashed_tensors"] == 1 and swapper.stats["stashed_bytes"] == 32 * 256 * 4  # h
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        pool.check()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool is built on Linux only")
def test_the_install_names_a_missing_compiler(tmp_path):
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "CXX": "no-such-c++", "CC": "no-such-cc"}
    build = [
        "build_ext",
        "--force",
        "--build-temp",
        str(tmp_path / "tmp"),
        "--build-lib",
        str(tmp_path / "lib"),
    ]
    proc = subprocess.run(
        [sys.executable, "setup.py", *build], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "no C++ compiler found to build its page pool" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
