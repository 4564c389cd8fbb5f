"""GPU-only paths: green-context partitions confine kernels to disjoint SMs, and the documented co-located
commands exit cleanly (exit 0, nothing after the summary) with the trainer thread, graphs and green contexts.
Skipped without a GPU; bench/smoke_gpu.sh runs them on the GPU machine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[1]


def _write_sm_ids(out: torch.Tensor) -> None:
    """Launch one one-warp program per element of `out` (int32) on the current stream, each writing the SM it
    ran on."""
    import triton
    import triton.language as tl

    @triton.jit
    def smid_kernel(out_ptr):
        pid = tl.program_id(0)
        smid = tl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.store(out_ptr + pid, smid)

    smid_kernel[(out.numel(),)](out, num_warps=1)


def _sm_ids(stream: torch.cuda.Stream, programs: int = 4096) -> set[int]:
    """The SMs a grid of `programs` one-warp programs ran on when launched on `stream`."""
    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(stream):
        _write_sm_ids(out)
    stream.synchronize()
    assert (out >= 0).all()
    return set(out.tolist())


def test_green_context_rungs_confine_kernels_to_disjoint_sms():
    from harli_train.colocate.sm import SMLadder

    ladder = SMLadder.create(step=16)
    try:
        total = torch.cuda.get_device_properties(0).multi_processor_count
        assert ladder.total_sms == total and ladder.full.train_sms == 0
        for p in ladder.spatial:
            assert p.infer_sms + p.train_sms == total
            infer, train = _sm_ids(p.infer_stream), _sm_ids(p.train_stream)
            assert len(infer) <= p.infer_sms and len(train) <= p.train_sms, p
            assert not infer & train, f"{p}: inference and trainer SMs overlap"
    finally:
        ladder.close()


def test_the_graphed_profile_workload_replays_one_capture_per_partition_on_its_trainer_sms():
    """`predictor_setup.GraphedWorkload`: the first call on a partition runs the workload once and captures
    it on that partition's trainer stream, every call replays the partition's own graph (once each), and the
    replays run on the trainer's SMs only."""
    from harli_train.colocate.predictor_setup import GraphedWorkload
    from harli_train.colocate.sm import SMLadder

    ladder = SMLadder.create(step=16)
    try:
        count = torch.zeros(1, device="cuda")
        seen = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
        calls = []

        def eager(part):
            calls.append(part.infer_sms)
            with torch.cuda.stream(part.train_stream):
                count.add_(1)
                _write_sm_ids(seen)

        run = GraphedWorkload(eager)
        a, b = ladder.spatial[0], ladder.spatial[-1]
        for part in (a, a, b, a):
            run(part)
        torch.cuda.synchronize()
        assert calls == [a.infer_sms, a.infer_sms, b.infer_sms, b.infer_sms]  # a warm-up and a capture each
        assert count[0].item() == 2 + 4  # the two warm-ups, then four replays (a capture runs nothing)
        seen.fill_(-1)
        torch.cuda.synchronize()
        run(b)
        b.train_stream.synchronize()
        assert (seen >= 0).all() and len(set(seen.tolist())) <= b.train_sms
        assert not set(seen.tolist()) & _sm_ids(b.infer_stream), "the replay ran on decode's SMs"
    finally:
        ladder.close()


def test_the_trainer_thread_runs_its_cpu_ops_on_itself_alone():
    """On a GPU the trainer thread's torch CPU ops (its data) bring no OpenMP team of their own."""
    import threading

    from harli_train.colocate.trainer_worker import gpu_thread_setup

    seen = []

    def body() -> None:
        gpu_thread_setup(torch.cuda.current_device())
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [1] and (torch.get_num_threads() > 1 or (os.cpu_count() or 1) == 1)


def _run(
    args: list[str], tmp_path: Path, timeout: int = 300, prelude: str | None = None
) -> subprocess.CompletedProcess:
    """``python -m harli_train ARGS`` in ``tmp_path`` (``prelude``: Python run first, in the same process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = ["-m", "harli_train"]
    if prelude is not None:
        command = ["-c", f"{prelude}; import sys; from harli_train.cli import main; main(sys.argv[1:])"]
    return subprocess.run(
        [sys.executable, *command, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _stderr_excerpt(stderr: str) -> str:
    """The tail of ``stderr``, led by the message of an abort (a C++ exception's ``what():`` line, whose
    long native stack would push it out of the tail)."""
    what = [line for line in stderr.splitlines() if "what():" in line or line.startswith("terminate called")]
    tail = stderr[-3000:]
    return "\n".join([*what, "...", tail]) if what and what[-1] not in tail else tail


def _assert_clean_exit(proc: subprocess.CompletedProcess) -> dict:
    """Exit 0, stdout exactly one JSON document, no abort or traceback after it."""
    assert proc.returncode == 0, _stderr_excerpt(proc.stderr)
    for marker in ("terminate called", "Traceback", "CUDA error"):
        assert marker not in proc.stderr, _stderr_excerpt(proc.stderr)
    return json.loads(proc.stdout)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_colocated_run_on_green_contexts_exits_cleanly(tmp_path, graphs):
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    overrides = ["train.steps=8", "colocation.duration_s=4", f"output.dir={tmp_path / 'run'}"]
    overrides.append(f"train.cuda_graphs={str(graphs).lower()}")
    proc = _run([recipe, "--colocate-with", "tiny", "--quiet", *overrides], tmp_path)
    summary = _assert_clean_exit(proc)
    assert summary["trainer"]["steps"] == 8
    feed = json.loads((tmp_path / "run" / "colocate" / "summary.json").read_text())["finetune"]["feed"]
    if graphs:  # captured on every trainer rung at the warm-up, none dropped
        assert "without train.cuda_graphs" not in proc.stderr and feed["graphs"]["sets"] >= 2, proc.stderr
    else:
        assert feed["graphs"] is None
    assert (tmp_path / "run" / "colocate" / "summary.json").is_file()
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def graphs_model():
    """The tiny preset in bf16 on the GPU with a rank-8 adapter drawn away from zero (B too)."""
    from harli_train.model import load_model

    torch.manual_seed(0)
    m = load_model("tiny", torch.bfloat16, "cuda", seed=1)
    m.add_lora(8, 16.0, 0.0, seed=2)
    with torch.no_grad():
        for p in m.lora_parameters():
            p.normal_(0, 0.05)
    return m.train()


def graphs_batch(seed, b=4, t=256, two_docs=True):
    """A packed batch of random ids: two documents a row (the second from t // 3), or one."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 250, (b, t), generator=g)
    doc = (torch.arange(t) >= t // 3).long().repeat(b, 1) * int(two_docs)
    positions = torch.arange(t).repeat(b, 1) - doc * (t // 3)
    return {
        "input_ids": ids,
        "labels": ids.clone(),
        "positions": positions,
        "doc_ids": doc,
        "num_target_tokens": b * (t - 1),
    }


@pytest.mark.parametrize(
    "rungs_used, arena",
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["one-set", "two-rungs", "one-set-arena", "two-rungs-arena"],
)
def test_captured_steps_equal_eager_steps_and_a_backward_replays_on_another_rung(rungs_used, arena):
    """train.cuda_graphs on the GPU: real graphs, bf16 autocast over fp32 adapter masters, two micro-batches of
    packed rows, a clipped AdamW update after each step (torch's clip and fused AdamW on the eager path, the
    update's own graph on the graphed one). Three steps give the eager steps' losses, gradient norms,
    gradients and adapter (same kernels, same configurations: each replay reads the masters as the optimizer
    left them), and so do steps whose forwards replay on one green-context rung and whose backwards and
    update replay on another: with the saved-tensor arena (what train.cuda_graphs runs) each backward reads
    what the other rung's forward saved (among them the rows a LoRA kernel saves, a view of its input), without
    it each backward's forward is replayed on its rung first."""
    from harli_train.colocate.sm import SMLadder
    from harli_train.train.adapter_update import AdapterUpdate, make_optimizer_state
    from harli_train.train.batch_buffers import BatchBuffers
    from harli_train.train.step import train_step
    from harli_train.train.step_graphs import StepGraphs

    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    batches = [graphs_batch(1), graphs_batch(2)]

    def steps(graphed: bool, rungs=None, arena: bool = True):
        """Three steps, each followed by an AdamW update: the losses, the last step's gradients, the adapter.
        With ``rungs``, a micro-step after a forward replays on rungs[0]'s trainer stream, after the loss or
        a backward on rungs[1]'s."""
        m, buffers = graphs_model(), BatchBuffers("cuda")
        params = list(m.lora_parameters())
        opt = torch.optim.AdamW(params, lr=2e-2, fused=True)
        make_optimizer_state(opt)  # as the trainer makes it
        graphs = StepGraphs(params, arena=arena) if graphed else None
        update = AdapterUpdate(opt, 0.5) if graphed else None
        prev, losses, norms = torch.cuda.current_stream(), [], []
        for i in range(3):
            lr = 2e-2 / (i + 1)
            gen, phase = train_step(m, batches, 1, autocast, buffers=buffers, graphs=graphs), "fwd"
            try:
                while True:
                    stream = prev if rungs is None else rungs[phase in ("loss", "bwd")].train_stream
                    stream.wait_stream(prev)
                    with torch.cuda.stream(stream):
                        phase = next(gen).phase
                    prev = stream
            except StopIteration as stop:
                torch.cuda.synchronize()  # the step's last launches went to a non-blocking rung stream
                losses.append(stop.value.loss_sum.item())
            grads = [p.grad.float().clone() for p in params]
            # The copies run on this thread's stream; the graphed update below (its clip scales the gradients
            # in place) runs on the rung's stream, which does not wait for this one.
            torch.cuda.synchronize()
            if update is None:
                opt.param_groups[0]["lr"] = lr
                norms.append(torch.nn.utils.clip_grad_norm_(params, 0.5).item())
                opt.step()
            else:
                with torch.cuda.stream(prev):
                    norm = update(lr, graphs=True)
                torch.cuda.synchronize()
                norms.append(norm.item())
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        assert graphs is None or graphs.captures == (1 if rungs is None else 2)  # a set per rung
        assert update is None or len(update._captured) == 1  # the update ran on one stream: one graph
        # Each backward after a forward on the other rung read the arena, or, without it, was rebuilt.
        assert graphs is None or rungs is None or (graphs.rebuilds == 0) == arena
        assert graphs is None or (graphs.arena_bytes > 0) == arena
        return losses, norms, grads, [p.detach().float().clone() for p in params]

    want, want_norms, want_grads, want_params = steps(False)
    # The updates move the loss far more than the tolerance: a replay of stale masters would show; the
    # clip bound is below the first step's norm, so the clip scales.
    assert abs(want[2] - want[0]) > 20 * 1e-3 * abs(want[0]) and want_norms[0] > 0.5
    ladder = SMLadder.create(step=32)
    try:
        rungs = [ladder.spatial[0], ladder.spatial[-1]] if rungs_used else None
        got, got_norms, grads, params = steps(True, rungs, arena)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=0, msg=lambda m: f"losses: {m}")
        torch.testing.assert_close(got_norms, want_norms, rtol=1e-2, atol=0, msg=lambda m: f"norms: {m}")
        # Another rung's kernels split their sums differently: whole tensors agree, element by element
        # Adam may step a near-zero gradient either way. Every tensor off is named, not just the first.
        mods = graphs_model().lora_modules().items()
        names = [f"{name}.lora_{ab}" for name, mod in mods if mod.has_lora for ab in "AB"]  # lora_parameters
        off = []
        for what, got_ts, want_ts in (("grad", grads, want_grads), ("param", params, want_params)):
            for name, a, b in zip(names, got_ts, want_ts, strict=True):
                err = (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()
                if not err <= 2e-2:
                    # got = c * want + rest: c near 0.5 or 1.5 says a micro-batch's share lost or doubled.
                    c = (torch.dot(a.flatten(), b.flatten()) / torch.dot(b.flatten(), b.flatten())).item()
                    off.append(f"{what} {name} off by {err:.3g} (c {c:.3g})")
        assert not off, "; ".join(off)
    finally:
        ladder.close()


def test_profile_command_exits_cleanly(tmp_path):
    report = _assert_clean_exit(
        _run(["profile", "--model", "tiny", "--out", str(tmp_path / "p.json")], tmp_path)
    )
    assert report["samples"] > 0 and (tmp_path / "p.json").is_file()


def test_the_cuda_pool_takes_stash_pages_back_mid_step_and_training_stays_bit_identical():
    """The reclaim protocol on the driver's pages, each time at a known point: a KV grow past the free pages
    after each forward (every layer's stash held) and in the middle of each backward takes 20 pages from the
    trainer's stashes (spilled to pinned host memory, brought back before backward reads them), and the
    losses and parameters equal those of the same training without a pool."""
    from harli_train.memory import ActivationSwapper, PagePool, PooledKVStorage

    from .test_allocator import Spec, _train

    page, rows = 2 << 20, 16384  # 16384 rows: each block's saved tensors fill ~18 pages of 2 MiB
    losses, params = _train(3, rows=rows, device="cuda")
    with PagePool(150 * page, backend="cuda") as pool:
        trainer = pool.add_tenant("trainer")
        swapper = ActivationSwapper(pool, trainer, layer_bytes=32 * page, window=1, lookahead=1)
        kv = PooledKVStorage(pool, Spec(1, (page // 4,), torch.float32), max_blocks=60)  # 2 pages a block
        taken = []

        def decode_burst() -> None:
            before = trainer.stats()["used_pages"]
            kv.grow(kv.num_blocks + (pool.free_pages + 20) // 2)
            taken.append(before - trainer.stats()["used_pages"])
            kv.shrink(1)

        got_losses, got_params = _train(
            3, swapper, after_forward=decode_burst, mid_backward=decode_burst, rows=rows, device="cuda"
        )
        torch.cuda.synchronize()
        assert got_losses == losses
        assert all(torch.equal(a, b) for a, b in zip(got_params, params, strict=True))
        assert len(taken) == 6 and min(taken) >= 20, taken
        assert swapper.stats["swap_out_bytes"] > 0 and swapper.stats["swap_in_bytes"] > 0
        assert pool.reclaim_stats["calls"] == 6
        pool.check()


def _pool_run(
    tmp_path: Path, name: str, *extra: str, graphs_on_pool: bool = False
) -> tuple[dict, list[float]]:
    """A co-located quickstart on the CUDA page pool under static:64 (the same SM budgets every run, so the
    kernels take the same configurations); its memory.pool (with the trainer's OOM recoveries) and its
    losses. The load is 8 bursts, 0.25 s apart, each of 64 requests of 1024 + 64 tokens (what the engine runs
    at once; tiny's KV page group holds 1024 blocks of 16 tokens: a burst wants 5 groups, the idle cache
    1-2): the cache grows at every burst and shrinks between them, and 24 steps (~50 ms each on the H200)
    keep the trainer stepping through all of them, so both tenants near their peaks meet several times, not
    once at a single load's peak, whose timing against the trainer's steps depends on the host. The pool's
    budget is 16 GiB unless ``extra`` names one: far above both tenants' peaks, and a fixed size, since the
    GPU may be shared (bench/smoke_gpu.sh runs commands beside the tests) and a pool claims its pages when it
    starts."""
    run = tmp_path / name
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    trace = tmp_path / "bursts.jsonl"
    if not trace.exists():
        burst = '{{"arrival_s": {t}, "prompt_len": 1024, "output_len": 64}}\n' * 64
        trace.write_text("".join(burst.format(t=0.25 * i) for i in range(8)))
    overrides = ["train.steps=24", "train.log_every=1", f"colocation.trace={trace}"]
    overrides += ["colocation.max_batch=64"]
    if not any(x.startswith("colocation.memory_gib=") for x in extra):
        overrides.append("colocation.memory_gib=16")
    overrides += [f"output.dir={run}", *extra]
    args = [recipe, "--colocate-with", "tiny", "--policy", "static:64", "--quiet", *overrides]
    # The command line's main; graphs_on_pool=False closes the assembly's gate for graphs on the GPU's pool.
    gate = f"import harli_train.colocate.assembly as a; a.GRAPHS_ON_CUDA_POOL = {bool(graphs_on_pool)}"
    _assert_clean_exit(_run(args, tmp_path, prelude=gate))
    summary = json.loads((run / "colocate" / "summary.json").read_text())
    pool = {**summary["memory"]["pool"], "trainer_oom_recoveries": summary["finetune"]["oom_recoveries"]}
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    return pool, losses


def test_colocated_run_on_the_cuda_pool_gives_pages_back_under_pressure_and_trains_the_same(
    tmp_path, monkeypatch
):
    # Every measured run loads one stored profile (a run that profiles holds different trainer pages).
    monkeypatch.setenv("HARLI_PROFILE_DIR", str(tmp_path / "profiles"))
    _pool_run(tmp_path, "profiled")
    pool, losses = _pool_run(tmp_path, "roomy")
    assert pool["enabled"] and pool["backend"] == "cuda" and pool["page_bytes"] == 2 << 20
    kv, trainer = pool["tenants"]["kv"]["peak"], pool["tenants"]["trainer"]["peak"]
    group = pool["kv"]["pages_per_group"]
    assert pool["budget_pages"] > trainer + kv  # the roomy run never came under pressure
    assert trainer > 0  # the trainer's torch allocations and stashes are pool pages
    # The cache grows to 3 page groups or more at the load's peak and can shrink to 2 when idle.
    assert kv >= 3 * group, pool
    # One page group short of both peaks together. Whichever side asks second when both near their peaks
    # resolves the pressure: a KV grow while the trainer holds its stashes takes pages back from them (a
    # reclaim); a trainer step that finds the pages taken by the cache is abandoned, the cache's idle groups
    # are unmapped and the step runs again (a recovery). Which comes first depends on the host's timing;
    # test_the_cuda_pool_takes_stash_pages_back_mid_step_... drives the reclaim at known points. Either way no request is
    # refused and training is bit-identical.
    budget_gib = (trainer + kv - group) * (2 << 20) / 2**30
    pressed, pressed_losses = _pool_run(tmp_path, "pressed", f"colocation.memory_gib={budget_gib}")
    report = json.dumps(pressed, indent=1)
    assert pressed["budget_pages"] == trainer + kv - group, report
    assert pressed["reclaims"]["count"] + pressed["trainer_oom_recoveries"] > 0, report
    assert pressed["refusals"] == 0, report
    assert pressed_losses == losses


@pytest.mark.parametrize("launch", ["wait", "ahead"])
def test_graphed_steps_on_the_cuda_pool_train_the_same_with_the_arena_in_pool_pages(
    tmp_path, monkeypatch, launch
):
    """train.cuda_graphs beside the CUDA page pool (the assembly's gate opened for these runs): the graphs
    capture into the trainer tenant's MemPool and their saved-tensor arena lives in its stashes; the run
    trains what the same graphed run without the pool trains, and under a budget one page group short of
    both peaks the pressure resolves (a reclaim of arena pages, or a recovery) with the same losses, and
    the process exits cleanly (a capture that failed under pressure leaves no routing into the MemPool for
    its destructor to abort on: `harli_train.cuda_capture`). ``launch``: each step's successor launched
    before its tokens are read (``colocation.launch_ahead``), or not."""
    monkeypatch.setenv("HARLI_PROFILE_DIR", str(tmp_path / "profiles"))
    graphs = ("train.cuda_graphs=true", f"colocation.launch_ahead={str(launch == 'ahead').lower()}")
    _, plain_losses = _pool_run(tmp_path, "plain", *graphs, "colocation.memory_pool=false")
    pool, losses = _pool_run(tmp_path, "roomy", *graphs, graphs_on_pool=True)
    report = json.dumps(pool, indent=1)
    assert pool["enabled"] and pool["backend"] == "cuda", report
    # The arena's slots are placed at capture, during set-up's warm-up: a level, not the run's stashed bytes.
    assert pool["trainer"]["arena_bytes"] > 0 and pool["tenants"]["trainer"]["peak"] > 0, report
    assert losses == plain_losses
    kv, trainer = pool["tenants"]["kv"]["peak"], pool["tenants"]["trainer"]["peak"]
    budget_gib = (trainer + kv - pool["kv"]["pages_per_group"]) * (2 << 20) / 2**30
    pressed, pressed_losses = _pool_run(
        tmp_path, "pressed", *graphs, f"colocation.memory_gib={budget_gib}", graphs_on_pool=True
    )
    report = json.dumps(pressed, indent=1)
    assert pressed["reclaims"]["count"] + pressed["trainer_oom_recoveries"] > 0, report
    assert pressed["refusals"] == 0, report
    assert pressed_losses == losses


def test_a_replaced_graphed_trainer_captures_again_on_the_cuda_pool(tmp_path, monkeypatch):
    """The bench's windows give each run a fresh trainer (`Colocation.new_trainer`): the replaced trainer's
    graphs are all released, then the new one captures into the same trainer MemPool. Every new trainer
    keeps its graphs (no capture refused: `cuda_capture.anchor_pool`), and the process exits cleanly."""
    monkeypatch.setenv("HARLI_PROFILE_DIR", str(tmp_path / "profiles"))
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    overrides = ["train.steps=24", "train.cuda_graphs=true", "colocation.policy=static:64"]
    overrides += ["colocation.memory_gib=16", f"output.dir={tmp_path / 'run'}"]
    code = f"""
import harli_train.colocate.assembly as assembly
from harli_train.config import load_recipe
assembly.GRAPHS_ON_CUDA_POOL = True
cfg = load_recipe({recipe!r}, {overrides!r})
col = assembly.assemble(cfg, "tiny", loads=[], spatial=True)
assert col.memory is not None and col.memory.trainer_memory is not None, "not on the CUDA pool"
for i in range(3):
    if i:
        col.new_trainer({str(tmp_path)!r} + "/t" + str(i))
        col.prepare(col.new_policy("static:64"))
    assert col.trainer.graphs is not None and col.trainer.graphs.captures > 0, f"trainer {{i}} lost its graphs"
col.close()
print("recaptured")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "recaptured" in proc.stdout, _stderr_excerpt(proc.stderr)
    for marker in ("terminate called", "Traceback", "failed (RuntimeError"):
        assert marker not in proc.stderr, _stderr_excerpt(proc.stderr)


def test_a_step_told_to_wait_for_another_streams_work_starts_after_it():
    # harli:handoff=gpu launches a whole-GPU step while the trainer's queued work still runs on another
    # stream; `wait_before_next` orders the next launched step after that work's end event on the GPU.
    from harli_train.engine import DecodeEngine, EngineConfig, SamplingParams
    from harli_train.model import load_model

    model = load_model("tiny", torch.bfloat16, "cuda")
    engine = DecodeEngine(model, EngineConfig(block_size=16, max_num_seqs=2, max_model_len=64))
    params = SamplingParams(max_tokens=3)
    engine.generate([[1, 2, 3, 4]], params)  # compiled and warm: a generation takes milliseconds
    side = torch.cuda.Stream()

    def other_work() -> torch.cuda.Event:
        ended = torch.cuda.Event()
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles
            ended.record(side)
        return ended

    ended = other_work()
    engine.generate([[1, 2, 3, 4]], params)
    assert not ended.query()  # the control: a step that does not wait finishes long before the work ends
    side.synchronize()
    ended = other_work()
    engine.wait_before_next(ended)
    engine.generate([[1, 2, 3, 4]], params)
    assert ended.query()  # the step's tokens came back only after the other stream's work had ended
    engine.close()


def _worker_run(tmp_path: Path, refill: bool) -> tuple[list[torch.Tensor], int, int]:
    """The tiny trainer's 3 steps through a trainer thread on one stream, one micro-step queued at most:
    fed one plan (``refill``) or a plan every 2 ms until done. Its adapter, micro-steps launched, refills."""
    import time
    from types import SimpleNamespace

    from harli_train.colocate.policy import BESIDE, StepPlan
    from harli_train.colocate.trainer_worker import TrainerWorker
    from harli_train.model import load_model
    from harli_train.train.trainer import Trainer

    from .runtime_support import recipe

    cfg = recipe(tmp_path / f"refill-{refill}", "train.steps=3")
    trainer = Trainer(cfg, model=load_model("tiny", torch.bfloat16, "cuda"), quiet=True)
    trainer.setup()
    worker = TrainerWorker(trainer, refill=refill, max_in_flight=1)
    stream = torch.cuda.Stream()
    plan = StepPlan(SimpleNamespace(infer_sms=0), BESIDE, stream, 64, 1e-3, None, "test")
    worker.start()
    deadline = time.perf_counter() + 120
    fed = False
    while not worker.snapshot.done and time.perf_counter() < deadline:
        if not (refill and fed):
            worker.tick()
            worker.feed(plan)
            worker.decided()
            fed = True
        time.sleep(2e-3)
    worker.stop()
    torch.cuda.synchronize()
    assert worker.snapshot.done
    return (
        [p.detach().clone() for p in trainer.model.lora_parameters()],
        worker.snapshot.launched_total,
        worker.refills,
    )


def test_the_trainer_thread_refills_its_queue_between_plans_and_trains_the_same(tmp_path):
    # With refill, one plan trains to the end: each micro-step that ends makes room for the next one (the
    # optimizer's boundary too), on the same stream and SM budget as plans fed every 2 ms would launch them.
    fed, launched_fed, _ = _worker_run(tmp_path, refill=False)
    refilled, launched, refills = _worker_run(tmp_path, refill=True)
    assert launched == launched_fed and refills >= launched - 1
    assert all(torch.equal(a, b) for a, b in zip(refilled, fed, strict=True))
