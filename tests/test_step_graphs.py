"""The step as CUDA graphs (train.cuda_graphs): the same gradients and loss as the eager step, bit for bit,
through the static-tensor chain the graphs replay (on a CPU the graphs are stand-ins that re-run the captured
code over the same static tensors; tests/test_gpu.py replays real graphs)."""

import json

import pytest
import torch

from harli_train.config import RecipeError, load_recipe
from harli_train.train.batch_buffers import BatchBuffers
from harli_train.train.shape_graphs import GraphCaptureError
from harli_train.train.step import train_step
from harli_train.train.step_graphs import StepGraphs
from harli_train.train.trainer import GRAPHS_ARENA, Trainer
from tests.test_train import QUICKSTART, _batch, _drain, _grads, _model


def _packed(seed, b=2, t=24):
    batch = _batch(seed, b, t)
    doc = torch.zeros(b, t, dtype=torch.long)
    doc[:, t // 2 :] = 1  # two documents a row
    positions = torch.arange(t).repeat(b, 1)
    positions[:, t // 2 :] -= t // 2
    return {**batch, "doc_ids": doc, "positions": positions}


def _seeded_model():
    torch.manual_seed(0)  # _model draws its adapter from the global generator
    return _model()


def _eager(batches, per_chunk):
    m = _seeded_model()
    result, phases = _drain(train_step(m, batches, per_chunk, buffers=BatchBuffers("cpu")))
    return _grads(m), result, phases


@pytest.mark.parametrize("per_chunk", [1, 3])
@pytest.mark.parametrize("make", [_batch, _packed], ids=["rows", "packed"])
def test_graphed_steps_equal_the_eager_step_bit_for_bit(per_chunk, make):
    want_grads, want, want_phases = _eager([make(1), make(2)], per_chunk)
    m = _seeded_model()
    graphs, buffers = StepGraphs(m.lora_parameters()), BatchBuffers("cpu")
    # Three steps on other data each: the graphs are made once and every step starts from fresh sums.
    for seeds in ((1, 2), (3, 4), (1, 2)):
        m.zero_grad(set_to_none=True)
        result, phases = _drain(
            train_step(m, [make(s) for s in seeds], per_chunk, buffers=buffers, graphs=graphs)
        )
    assert graphs.captures == 1 and phases == want_phases
    assert torch.equal(result.loss_sum, want.loss_sum)
    assert (result.target_tokens, result.input_tokens) == (want.target_tokens, want.input_tokens)
    for got, ref in zip(_grads(m), want_grads, strict=True):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("arena", [True, False], ids=["arena", "no-arena"])
def test_a_backward_on_another_set_reads_the_arena_or_rebuilds_and_the_result_is_unchanged(arena):
    # One set of graphs per (stream, SM budget): forwards under one budget, backwards under another. With the
    # saved-tensor arena every set saves into the same slots, so each backward reads what the other set's
    # forward saved; without it the set a backward runs on replays the chunk's forward first. Either way the
    # gradients and loss are the eager step's.
    from harli_train import kernels

    batches = [_packed(1), _packed(2)]
    want_grads, want, _ = _eager(batches, 1)
    m = _seeded_model()
    graphs = StepGraphs(m.lora_parameters(), arena=arena)
    gen, budget = train_step(m, batches, 1, buffers=BatchBuffers("cpu"), graphs=graphs), 64
    try:
        while True:
            with kernels.sm_budget(budget):
                phase = next(gen).phase
            budget = 32 if phase in ("loss", "bwd") else 64
    except StopIteration as stop:
        result = stop.value
    chunks = m.config.num_layers
    # The first micro-batch's backwards come after a loss on 64; the second's after its forwards on 32.
    assert graphs.captures == 2 and graphs.rebuilds == (0 if arena else 2 * chunks)
    assert graphs.rebuilds_on_move != arena and (graphs.arena_bytes > 0) == arena
    assert torch.equal(result.loss_sum, want.loss_sum)
    for got, ref in zip(_grads(m), want_grads, strict=True):
        assert torch.equal(got, ref)


def test_the_arena_holds_each_chunks_saved_tensors_once_and_never_the_weights():
    """The slots are made on the first pass and reused by every later one and every set; the model's
    weights, the adapter's parameters and the static tensors are saved where they are; a capture that would
    need a new slot is refused (the slot would live in one set's memory)."""
    from harli_train.train.saved_arena import SavedArena, SlotMissing

    m = _seeded_model()
    graphs = StepGraphs(m.lora_parameters())
    buffers = BatchBuffers("cpu")
    _drain(train_step(m, [_packed(1)], 1, buffers=buffers, graphs=graphs))
    (shape,) = graphs.shapes.values()
    arena = shape.arena
    slots = dict(arena.slots)
    assert {chunk for chunk, _ in slots} == set(range(m.config.num_layers))
    weights = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *shape._static()]}
    assert not weights & {t.untyped_storage().data_ptr() for t in slots.values()}
    _drain(train_step(m, [_packed(2), _packed(3)], 1, buffers=buffers, graphs=graphs))
    assert arena.slots.keys() == slots.keys() and all(arena.slots[k] is slots[k] for k in slots)
    frozen = SavedArena(set())
    frozen.frozen = True
    with pytest.raises(SlotMissing, match="no earlier pass saved"):
        with frozen.chunk(0), torch.enable_grad():
            x = torch.ones(3, requires_grad=True)
            (x * 2).exp()  # exp saves its result: a slot the frozen arena does not have


class _SavesAView(torch.autograd.Function):
    """A custom Function that saves a view of its input made in its forward, as the LoRA kernels save the
    rows of theirs: inside a forward (grad mode off) a view of an activation that requires grad reads as a
    leaf that requires grad."""

    @staticmethod
    def forward(ctx, x, w):
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, w, w.t())
        ctx.x_shape = x.shape
        return rows @ w

    @staticmethod
    def backward(ctx, dy):
        rows, _, w_t = ctx.saved_tensors
        return (dy @ w_t).view(ctx.x_shape), rows.t() @ dy


def test_a_view_of_an_activation_saved_by_a_custom_function_is_moved_and_a_parameter_stays():
    """The arena (and the page pool's stashes) copy what a Function saves unless it is a parameter, a leaf that
    requires grad, a view of either, or a static tensor: a view of the activation the Function was given is
    copied like the activation (a set of graphs that left it in its own pool would have another set's
    backward read stale memory); the parameter, its transpose and the rows of a leaf input stay."""
    from harli_train.saved_tensors import stays_in_place
    from harli_train.train.saved_arena import SavedArena

    w = torch.nn.Parameter(torch.randn(4, 5))
    seen = []

    class Probe(_SavesAView):
        @staticmethod
        def forward(ctx, x, w):
            rows = x.reshape(-1, x.shape[-1])
            assert rows.requires_grad and rows.is_leaf  # what torch reports inside a forward
            seen.append((stays_in_place(rows, set()), stays_in_place(w, set()), stays_in_place(w.t(), set())))
            return _SavesAView.forward(ctx, x, w)

    arena = SavedArena(set())
    with arena.chunk(0), torch.enable_grad():
        x = torch.randn(2, 3, 4, requires_grad=True)
        y = Probe.apply(x * 1.0, w)
    assert seen == [(False, True, True)]
    assert [tuple(t.shape) for t in arena.slots.values()] == [(6, 4)]  # the rows only
    y.sum().backward()
    assert torch.allclose(w.grad, (x.detach().reshape(-1, 4)).t() @ torch.ones(6, 5))
    # The rows of a leaf that requires grad (a chunk's input, alive for its backward anyway) stay.
    with SavedArena(set()).chunk(0), torch.enable_grad():
        Probe.apply(x, w)
    assert seen[-1] == (True, True, True)


def test_once_frozen_the_arena_refuses_a_pass_that_saves_other_tensors_or_fewer():
    """After the first capture every pass must save what the first saved, chunk by chunk: a slot of another
    shape would be replaced (freeing memory the captured graphs still write), one saved fewer would leave a
    slot another set's backward reads without this set's forward writing it."""
    from harli_train.train.saved_arena import SavedArena, SlotMissing

    def forward(arena, sizes):
        with arena.chunk(0), torch.enable_grad():
            for n in sizes:
                (torch.ones(n, requires_grad=True) * 2).exp()  # one saved tensor (exp's result) each

    arena = SavedArena(set())
    forward(arena, [3, 4])
    slots = dict(arena.slots)
    arena.frozen = True
    forward(arena, [3, 4])  # the same saves: the same slots
    assert arena.slots == slots
    with pytest.raises(SlotMissing, match="no earlier pass saved"):
        forward(arena, [3, 5])
    with pytest.raises(SlotMissing, match="saved 1 tensors where the first pass saved 2"):
        forward(arena, [3])
    assert arena.slots == slots


def test_graphs_need_the_buffers_and_no_stash():
    m = _model()
    graphs = StepGraphs(m.lora_parameters())
    with pytest.raises(ValueError, match="batch buffers"):
        _drain(train_step(m, [_batch(1)], 1, graphs=graphs))
    stash = lambda chunk: __import__("contextlib").nullcontext()  # noqa: E731
    with pytest.raises(ValueError, match="stash"):
        _drain(train_step(m, [_batch(1)], 1, buffers=BatchBuffers("cpu"), stash=stash, graphs=graphs))


def test_new_buffers_are_new_graphs_and_a_step_of_mixed_shapes_is_refused():
    m = _model()
    graphs = StepGraphs(m.lora_parameters())
    _drain(train_step(m, [_batch(1)], 1, buffers=BatchBuffers("cpu"), graphs=graphs))
    first = next(iter(graphs.shapes.values()))
    _drain(train_step(m, [_batch(1)], 1, buffers=BatchBuffers("cpu"), graphs=graphs))  # other addresses
    assert len(graphs.shapes) == 1 and next(iter(graphs.shapes.values())) is not first
    with pytest.raises(GraphCaptureError, match="differ in shape"):
        _drain(train_step(m, [_batch(1), _batch(2, t=20)], 1, buffers=BatchBuffers("cpu"), graphs=graphs))


def _recipe(tmp_path, graphs, **train):
    cfg = load_recipe(QUICKSTART)
    cfg.train.steps, cfg.train.grad_accum, cfg.train.cuda_graphs = 4, 2, graphs
    cfg.train.layers_per_microstep = 1
    cfg.output.dir, cfg.output.checkpoint_every = str(tmp_path / ("graphs" if graphs else "eager")), 0
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_a_run_with_cuda_graphs_trains_the_same_adapter(tmp_path):
    finals = []
    for graphs in (False, True):
        trainer = Trainer(_recipe(tmp_path, graphs), quiet=True)
        trainer.setup()
        trainer.train()
        assert (trainer.graphs is not None) == graphs and trainer.rebuilds_itself == graphs
        lines = (tmp_path / ("graphs" if graphs else "eager") / "metrics.jsonl").read_text().splitlines()
        finals.append(
            ([json.loads(line)["loss"] for line in lines], [p.detach().clone() for p in trainer.params])
        )
    (eager_loss, eager_params), (graph_loss, graph_params) = finals
    assert graph_loss == eager_loss
    assert all(torch.equal(a, b) for a, b in zip(graph_params, eager_params, strict=True))


def test_cuda_graphs_with_lora_dropout_is_a_recipe_error(tmp_path):
    cfg = _recipe(tmp_path, True)
    cfg.lora.dropout = 0.1
    with pytest.raises(RecipeError, match="train.cuda_graphs"):
        Trainer(cfg, quiet=True).setup()


@pytest.mark.slow
def test_a_colocated_run_with_cuda_graphs_places_the_arena_in_the_pool_and_trains_the_same(tmp_path):
    """On the host pool the graphs' saved-tensor arena lives in the trainer tenant's stashes; the run trains
    the adapter the eager run on the pool trains (a GPU keeps the pool off with graphs, and says why)."""
    from harli_train.colocate.commands import run_colocated
    from tests.runtime_support import adapter, assert_same_adapter, losses, recipe

    summary = run_colocated(
        recipe(tmp_path / "graphs", "train.cuda_graphs=true"), "tiny", policy="harli", quiet=True
    )
    pool = summary["memory"]["pool"]
    assert pool["enabled"] and pool["backend"] == "host"
    assert pool["tenants"]["trainer"]["peak"] > 0 and pool["trainer"]["stashed_bytes"] > 0
    assert summary["finetune"]["steps_run"] == 6
    graphs = summary["finetune"]["feed"]["graphs"]
    assert pool["trainer"]["arena_bytes"] >= graphs["arena_bytes"] > 0  # every slot in the stashes (aligned)
    assert graphs["sets"] >= 1 and graphs["rebuilds"] == summary["finetune"]["rebuilt_backward_chunks"] == 0
    assert graphs["arena_bytes"] > 0 and GRAPHS_ARENA
    run_colocated(recipe(tmp_path / "eager"), "tiny", policy="harli", quiet=True)
    assert losses(tmp_path / "graphs") == losses(tmp_path / "eager")
    assert_same_adapter(adapter(tmp_path / "graphs"), adapter(tmp_path / "eager"))


def test_the_arena_in_pool_stashes_gives_pages_back_mid_step_and_the_step_is_unchanged():
    """The arena's slots in an ActivationSwapper's stashes on a host pool: a KV grow past the free pages
    mid-step (after each forward, after each backward) spills the live chunks' bytes and unmaps the dead
    ones without a copy; the backward gets its bytes back; every step's gradients and loss are the eager
    step's, bit for bit."""
    from harli_train.memory import ActivationSwapper, PooledKVStorage
    from tests.test_allocator import PAGE, Spec, host_pool

    batches = [[_packed(1), _packed(2)], [_packed(3), _packed(4)]]
    want = []
    for pair in batches:
        want_grads, want_result, _ = _eager(pair, 1)
        want.append((want_grads, want_result))
    m = _seeded_model()
    graphs, buffers = StepGraphs(m.lora_parameters()), BatchBuffers("cpu")
    with host_pool(2000) as pool:
        trainer = pool.add_tenant("trainer")
        swapper = ActivationSwapper(pool, trainer, layer_bytes=400 * PAGE, slab_bytes=64 * PAGE)
        graphs.use_memory(swapper)
        kv = PooledKVStorage(pool, Spec(1, (1024,), torch.float32), max_blocks=1000)  # 2 pages a block
        taken = []

        def burst() -> None:  # the KV cache takes what the trainer could give back, then frees it again
            extra = swapper.reclaimable_pages() // 2 * 2
            if not extra:
                return
            before = trainer.stats()["used_pages"]
            kv.grow(kv.num_blocks + (pool.free_pages + extra) // 2)
            taken.append(before - trainer.stats()["used_pages"])
            kv.shrink(1)

        for pair, (want_grads, want_result) in zip(batches, want, strict=True):
            # Each step from the same adapter as its eager reference: the adapter is not stepped here.
            m.zero_grad(set_to_none=True)
            gen = train_step(m, pair, 1, buffers=buffers, graphs=graphs)
            try:
                while True:
                    if next(gen).phase in ("fwd", "bwd"):
                        burst()
            except StopIteration as stop:
                result = stop.value
            assert torch.equal(result.loss_sum, want_result.loss_sum)
            for got, ref in zip(_grads(m), want_grads, strict=True):
                assert torch.equal(got, ref)
        assert len(taken) >= 4 and all(n > 0 for n in taken)  # each burst took pages from the arena
        stats = swapper.stats
        assert stats["swap_out_bytes"] > 0 and stats["swap_in_bytes"] > 0 and stats["passthrough_bytes"] == 0
        # A dead chunk (its backward run) is unmapped, never copied: what was spilled is less than what the
        # reclaims freed.
        assert stats["swap_out_bytes"] < stats["reclaim_pages"] * pool.page_bytes
        graphs.use_memory(None)  # the arena's slots go: its stashes fill from the start again
        assert all(not s.fixed and s.used == 0 for s in swapper.pages.stashes.values())
        pool.check()


def _failing_capture(monkeypatch, fail):
    """Make capturing a set raise GraphCaptureError when ``fail(key)`` (keys: (stream, SM budget))."""
    from harli_train.train import shape_graphs

    real = shape_graphs.ShapeGraphs.set_for

    def set_for(self, key):
        if key not in self.sets and fail(key):
            raise shape_graphs.GraphCaptureError(f"capture refused on {key[1]} SMs (test)")
        return real(self, key)

    monkeypatch.setattr(shape_graphs.ShapeGraphs, "set_for", set_for)


def test_a_failed_capture_drops_the_graphs_and_the_run_trains_the_same_without_them(
    tmp_path, monkeypatch, caplog
):
    trainer = Trainer(_recipe(tmp_path, False), quiet=True)
    trainer.setup()
    trainer.train()
    want = [p.detach().clone() for p in trainer.params]
    _failing_capture(monkeypatch, lambda key: True)
    trainer = Trainer(_recipe(tmp_path / "failing", True), quiet=True)
    trainer.setup()
    trainer.train()
    assert trainer.graphs is None and "training goes on without train.cuda_graphs" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(trainer.params, want, strict=True))


def test_after_an_abandoned_graphed_step_the_arena_gives_every_page_back_and_the_next_step_is_unchanged():
    """A trainer out of memory abandons its step and the pool's hook calls ``release_idle``: the arena's
    stashes (what the abandoned forwards wrote) are unmapped, none copied; the step run again maps them anew
    and gives the eager step's gradients and loss."""
    from harli_train.memory import ActivationSwapper
    from tests.test_allocator import PAGE, host_pool

    pair = [_packed(1), _packed(2)]
    want_grads, want_result, _ = _eager(pair, 1)
    m = _seeded_model()
    graphs, buffers = StepGraphs(m.lora_parameters()), BatchBuffers("cpu")
    with host_pool(2000) as pool:
        trainer = pool.add_tenant("trainer")
        swapper = ActivationSwapper(pool, trainer, layer_bytes=400 * PAGE)
        graphs.use_memory(swapper)
        _drain(train_step(m, pair, 1, buffers=buffers, graphs=graphs))  # makes the slots
        m.zero_grad(set_to_none=True)
        gen = train_step(m, pair, 1, buffers=buffers, graphs=graphs)
        while next(gen).phase != "loss":  # every forward of the first micro-batch, then abandoned
            pass
        gen.close()
        assert trainer.stats()["used_pages"] > 0
        copied = swapper.stats["swap_out_bytes"]
        assert swapper.release_idle() > 0 and trainer.stats()["used_pages"] == 0
        assert swapper.stats["swap_out_bytes"] == copied  # dead bytes are not copied
        m.zero_grad(set_to_none=True)
        result, _ = _drain(train_step(m, pair, 1, buffers=buffers, graphs=graphs))
        assert torch.equal(result.loss_sum, want_result.loss_sum)
        for got, ref in zip(_grads(m), want_grads, strict=True):
            assert torch.equal(got, ref)
        pool.check()


@pytest.mark.slow
def test_on_the_pool_a_failed_capture_leaves_the_eager_steps_stashing_in_it(tmp_path, monkeypatch, caplog):
    """Co-located on the host pool with every capture refused: the trainer drops its graphs (their arena's
    stashes freed) and its eager steps stash in the pool; it trains the eager run's adapter."""
    from harli_train.colocate.commands import run_colocated
    from tests.runtime_support import adapter, assert_same_adapter, losses, recipe

    run_colocated(recipe(tmp_path / "eager"), "tiny", policy="harli", quiet=True)
    _failing_capture(monkeypatch, lambda key: True)
    summary = run_colocated(
        recipe(tmp_path / "dropped", "train.cuda_graphs=true"), "tiny", policy="harli", quiet=True
    )
    assert "training goes on without train.cuda_graphs" in caplog.text
    pool = summary["memory"]["pool"]
    assert pool["enabled"] and pool["trainer"]["stashed_bytes"] > 0
    assert summary["finetune"]["feed"]["graphs"] is None  # no graphs left at the end
    assert losses(tmp_path / "dropped") == losses(tmp_path / "eager")
    assert_same_adapter(adapter(tmp_path / "dropped"), adapter(tmp_path / "eager"))


def test_a_capture_failing_on_a_later_rung_mid_run_redoes_the_step_without_graphs(
    tmp_path, monkeypatch, caplog
):
    from tests.runtime_support import adapter, assert_same_adapter, graphed_runtime, losses, recipe

    standalone = tmp_path / "standalone"
    trainer = Trainer(recipe(standalone), quiet=True)
    trainer.setup()
    trainer.train()
    seen = set()
    _failing_capture(monkeypatch, lambda key: seen.add(key[1]) or len(seen) > 1)  # every set after the first
    shares = iter([16] * 3 + [96] * 1000)
    out = tmp_path / "colocated"
    rt = graphed_runtime(out, lambda: next(shares))
    summary = rt.run()
    assert rt.trainer.graphs is None and "training goes on without train.cuda_graphs" in caplog.text
    assert summary["finetune"]["abandoned_steps"] == 1 and summary["finetune"]["steps_run"] == 6
    assert losses(out) == losses(standalone)
    assert_same_adapter(adapter(out), adapter(standalone))


def test_an_interrupted_run_on_graphs_resumes_to_the_same_loss_curve(tmp_path):
    from tests.test_train import _losses
    from tests.test_train import _recipe as train_recipe

    over = {"lora.dropout": 0.0, "train.cuda_graphs": "true", "train.steps": 6, "output.checkpoint_every": 3}
    full = Trainer(train_recipe(tmp_path / "full", **over), quiet=True)
    full.setup()
    full.train()
    part = Trainer(train_recipe(tmp_path, **over), quiet=True)
    part.setup()
    for ms in part.micro_steps():
        if part.step == 4 and ms.phase == "bwd":  # mid-step: the checkpoint keeps the 4 steps counted
            part.interrupt()
            break
    assert part.finish()["steps"] == 4
    resumed = Trainer(train_recipe(tmp_path, **over), quiet=True)
    resumed.setup(resume=tmp_path / "run")
    resumed.train()
    assert resumed.graphs is not None and _losses(tmp_path / "run") == _losses(tmp_path / "full" / "run")


def test_a_replaced_trainer_gives_its_graphs_back_even_while_a_step_in_flight_holds_them(tmp_path):
    """A bench's windows replace the trainer (`Colocation.new_trainer`); what the old one's graphs hold (the
    arena, the static tensors, the sets) goes then, though its unfinished step still refers to the shape."""
    from harli_train.colocate.assembly import assemble
    from tests.test_colocation import recipe

    col = assemble(recipe(tmp_path / "setup", "train.cuda_graphs=true"), "tiny", spatial=True)
    try:
        old = col.new_trainer(tmp_path / "a")
        buffers = BatchBuffers("cpu")
        in_flight = train_step(old.model, [_packed(1)], 1, buffers=buffers, graphs=old.graphs)
        next(in_flight)  # the first forward: its shape's set and arena made
        (shape,) = old.graphs.shapes.values()
        assert shape.sets and shape.h and (shape.arena is None or shape.arena.slots)
        new = col.new_trainer(tmp_path / "b")
        assert old.graphs is None and not shape.sets and not shape.h
        assert shape.arena is None or not shape.arena.slots
        assert new.graphs is not None and not new.graphs.shapes and col.trainer is new
    finally:
        col.close()
