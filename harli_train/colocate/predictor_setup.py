"""The decode-latency predictor of a co-located set-up: the profile it is fitted to (loaded when this
machine's is stored, else measured on the engine's partitions, alone and beside a trainer-shaped workload),
and the check that the recipe's objective is one a decode step can meet at all."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harli_train import kernels
from harli_train.colocate.engine_adapter import EngineAdapter
from harli_train.colocate.policy import Policy
from harli_train.colocate.predictor import LatencyPredictor, fit_options
from harli_train.colocate.profile import (
    Profile,
    ProfileKey,
    default_profile_path,
    get_or_build_profile,
    save_profile,
)
from harli_train.colocate.profile_grid import MixedGrid, add_adapter_steps, build_profile
from harli_train.colocate.sm import Partition, SMLadder, is_cuda_stream
from harli_train.colocate.step_timing import fastest_step_s
from harli_train.config import RecipeConfig, RecipeError
from harli_train.model import LlamaForCausalLM

log = logging.getLogger(__name__)

GPU_BATCHES, GPU_KV_LENS = (1, 8, 32, 64, 128), (256, 1024, 2048)
CPU_BATCHES, CPU_KV_LENS = (1, 4, 16), (64, 256, 1024)
# Whether the profile's trainer workload runs as a CUDA graph per partition (`GraphedWorkload`) rather than
# launched eagerly. On: launched eagerly, its queue cannot get ahead of the GPU beside small decode shares,
# so those co-run points time decode mostly alone and price it low (docs/design.md, the predictor);
# `bench/probe_corun.py` measures both against the same decode points. A profile records its kind
# (`meta.corun_workload`), and a stored one of the other kind is made again.
GRAPHED_CORUN = True


def corun_workload(
    model: LlamaForCausalLM,
    batch: int,
    seq_len: int,
    layers: int,
    dtype: torch.dtype,
    wrap: Callable[[Callable], Callable] | None = None,
):
    """A trainer-shaped micro-step for profiling: ``layers`` layers forward over [batch, seq_len], no grad;
    captured per partition (``GraphedWorkload``) when ``GRAPHED_CORUN``. ``wrap``: what each eager launch
    (a capture's too) runs inside, e.g. tensor parallelism's ``local_fn`` (no collectives)."""
    device = model.lm_head.weight.device
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(batch, seq_len, model.config.hidden_size, generator=gen, device=device).to(dtype)
    cos, sin = model.rope(torch.arange(seq_len, device=device)[None])
    layers = min(layers, model.config.num_layers)

    def corun(part: Partition) -> None:
        with torch.cuda.stream(part.train_stream), kernels.sm_budget(max(part.train_sms, 1)), torch.no_grad():
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                model.run_layers(0, layers, hidden, None, cos, sin)

    eager = corun if wrap is None else wrap(corun)
    return GraphedWorkload(eager) if GRAPHED_CORUN else eager


class GraphedWorkload:
    """``eager`` (a profile workload launching on a partition's trainer stream) captured as a CUDA graph on
    each partition's stream at its first call there, after one eager warm-up, and replayed from then on. A
    replay costs the host microseconds, so the micro-steps the profile queues beside a timed decode step
    are all ahead of the GPU however fast the partition runs them. One memory pool serves every partition's
    graph (they never run at once); the graphs live as long as this object."""

    def __init__(self, eager: Callable[[Partition], None]) -> None:
        self.eager = eager
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: Any = None  # made at the first capture

    def __call__(self, part: Partition) -> None:
        graph = self.graphs.get(part.infer_sms)
        if graph is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            self.eager(part)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=part.train_stream):
                self.eager(part)
            self.graphs[part.infer_sms] = graph
        with torch.cuda.stream(part.train_stream):
            graph.replay()

    def release(self) -> None:
        """Drop the graphs and give their pool's memory back (once profiling is done with them)."""
        self.graphs.clear()
        torch.cuda.empty_cache()


def workload_kind(corun: Callable[[Partition], None]) -> str:
    """How a profile workload runs the trainer's work: "graphed" (``GraphedWorkload``) or "eager"."""
    return "graphed" if isinstance(corun, GraphedWorkload) else "eager"


def mixed_grid(max_batch: int, max_tokens: int, max_len: int, on_gpu: bool) -> MixedGrid:
    """The mixed steps to profile for an engine of ``max_batch`` sequences whose chunks reach ``max_tokens``
    (and contexts ``max_len``): the default grid where it fits, else three chunk sizes and two contexts spread
    over what does (a small model's engine), so each share has enough points for the model's terms."""
    base = (
        MixedGrid() if on_gpu else MixedGrid(batches=(2, 8), kv_len=64, tokens=(8, 32, 96), contexts=(0, 48))
    )
    batches = tuple(b for b in base.batches if b < max_batch) or (max(max_batch - 1, 1),)
    top = max(min(max(base.tokens), max_tokens), 3)
    tokens = tuple(sorted({max(1, min(n, top)) for n in base.tokens}))
    if len(tokens) < 3:
        tokens = (max(top // 8, 1), max(top // 3, 2), top)
    contexts = tuple(sorted({min(c, max_len // 4) for c in base.contexts}))
    kv_len = min(base.kv_len, max(max_len - 1, 1))
    corun = tuple(b for b in base.corun_batches if b in batches) or batches[-1:]
    return MixedGrid(batches, kv_len, tokens, contexts, corun, base.warmup, base.reps)


def build_predictor(
    engine: EngineAdapter,
    ladder: SMLadder,
    model_id: str,
    corun: Any,
    max_batch: int,
    path: str | Path | None = None,
    reps: int | None = None,
    batches: tuple[int, ...] | None = None,
    kv_lens: tuple[int, ...] | None = None,
    shares: list[int] | None = None,
) -> tuple[LatencyPredictor, Profile]:
    """Fit the predictor to the stored profile of this machine, or profile the engine now (and store it);
    ``shares``: the decode shares to cover (default: every rung). On a GPU a stored profile must have been
    made beside the same kind of workload as ``corun`` (``workload_kind``)."""
    on_gpu = is_cuda_stream(ladder.full.infer_stream)
    engine.register(ladder.partitions)
    max_len = engine.engine.config.max_model_len - 1
    batches = tuple(
        sorted(
            {b for b in batches or (GPU_BATCHES if on_gpu else CPU_BATCHES) if b <= max_batch}
            | {max_batch if on_gpu else min(max_batch, 16)}
        )
    )
    kv_lens = tuple(sorted({min(k, max_len) for k in kv_lens or (GPU_KV_LENS if on_gpu else CPU_KV_LENS)}))
    if len(kv_lens) < 2:  # stage 1 of the predictor needs two KV sizes per share
        kv_lens = (max(max_len // 4, 1), max_len)
    reps = reps or (10 if on_gpu else 3)
    key = ProfileKey.current(model_id, sm_count=ladder.total_sms)
    cfg = engine.engine.config
    shares = sorted(set(shares or ladder.shares))
    mixed = mixed_grid(max_batch, min(cfg.max_num_batched_tokens, max_len // 2), max_len, on_gpu)
    # What the co-run points ran beside (GPU only: the CPU stand-in's trainer loops in a thread).
    workload = workload_kind(corun) if on_gpu and corun is not None else None
    grid = dict(
        batches=batches,
        kv_lens=kv_lens,
        shares=shares,
        warmup=3 if on_gpu else 1,
        reps=reps,
        corun_reps=3 * reps if on_gpu else None,
        mixed_step_fn=engine.synthetic_mixed,
        mixed_grid=mixed,
        # With adapter slots: what one adapter and each one more add to a decode step (LoRACost).
        lora_slots=tuple(range(1, min(engine.engine.num_adapter_slots, 4) + 1)),
    )

    def build() -> Profile:
        log.info(
            "profiling decode on %d partitions (%s): batches %s, KV lengths %s",
            len(grid["shares"]),
            ladder.kind,
            batches,
            kv_lens,
        )
        return build_profile(
            key,
            engine.synthetic_decode,
            corun if on_gpu else None,
            ladder,
            engine.kv_bytes_per_token,
            engine.engine.mixed_token_buckets,
            corun_workload=workload,
            **grid,
        )

    if path is None and not on_gpu:  # CPU timings depend on the machine's load: measure afresh
        profile = build()
    else:
        stored = Path(path or default_profile_path(key))
        needs = {"corun_workload": workload} if workload is not None else None
        profile = get_or_build_profile(stored, key, build, shares, needs)
        if grid["lora_slots"] and lacks_adapter_steps(profile.samples):
            log.warning(
                "profile %s has no %s on adapters, which this engine serves: timing those (the rest stands)",
                stored,
                "steps" if not any(s.get("lora_slots") for s in profile.samples) else "mixed steps",
            )
            profile = add_adapter_steps(
                profile,
                engine.synthetic_decode,
                ladder,
                grid["lora_slots"],
                shares=set(shares) & set(profile.shares),
                warmup=grid["warmup"],
                reps=grid["reps"],
                mixed_step_fn=engine.synthetic_mixed,
            )
            save_profile(stored, profile)
    predictor = LatencyPredictor.fit(
        profile.samples,
        ladder.total_sms,
        float(profile.meta.get("kv_bytes_per_token", engine.kv_bytes_per_token)),
        **fit_options(profile.meta),
    )
    predictor.pad_to(engine.engine.mixed_token_buckets)  # the buckets this engine's steps will take
    return predictor, profile


def lacks_adapter_steps(samples: list[dict]) -> bool:
    """Whether a profile lacks the adapter steps an engine with adapter slots needs: decode steps on
    adapters, and mixed steps on them where it has mixed steps."""
    if not any(s.get("lora_slots") for s in samples):
        return True
    has_mixed = any("prefill_tokens" in s for s in samples)
    return has_mixed and not any(s.get("lora_slots") and "prefill_tokens" in s for s in samples)


def fastest_decode_s(
    policy: Policy,
    engine: EngineAdapter,
    tpot_s: float,
    predictor: LatencyPredictor | None = None,
    profile: Profile | None = None,
    reps: int = 5,
) -> tuple[float, int, str]:
    """The shortest decode step ``policy`` can run: batch 1 over one cached token, on its largest decode
    share, the trainer paused. Returns (seconds, that share's SMs, where the figure comes from).

    With a predictor: the smaller of the uncorrected prediction and the profile's fastest step on that share
    (a fit's error must not refuse an objective a step could meet). Without one (static, streams,
    exclusive), or when that figure misses ``tpot_s``: also the least of ``reps`` such steps timed now on the
    engine (a few milliseconds of work), as a busy host may have slowed the profile's few steps on a CPU.
    """
    share = max(p.infer_sms for p in policy.partitions())
    best, source = float("inf"), "measured now"
    if predictor is not None:
        measured = [
            float(r["latency_s"])
            for r in (profile.samples if profile is not None else [])
            if not r["corun"] and int(r["infer_sms"]) == share
        ]
        best, source = (
            min([predictor.predict(1, 1, share, corun=False, raw=True), *measured]),
            "per the profile",
        )
    if best > tpot_s:
        part = next(p for p in policy.partitions() if p.infer_sms == share)
        now = fastest_step_s(engine.synthetic_decode, part, reps=reps)
        if now < best:
            best, source = now, "measured now"
    return best, share, source


def check_objective(
    cfg: RecipeConfig,
    policy: Policy,
    engine: EngineAdapter,
    predictor: LatencyPredictor | None = None,
    profile: Profile | None = None,
) -> None:
    """RecipeError on ``colocation.tpot_ms`` when not even the fastest decode step meets it: every step would
    violate the objective, and a policy holding to it would keep the trainer paused for nothing."""
    tpot_s = cfg.colocation.tpot_ms * 1e-3
    seconds, share, source = fastest_decode_s(policy, engine, tpot_s, predictor, profile)
    if seconds > tpot_s:
        expected = (
            f"an objective a decode step can meet: the fastest one (batch 1, decode on {share} of "
            f"{policy.ladder.total_sms} SMs, the trainer paused) takes {seconds * 1e3:.3g} ms {source}"
        )
        raise RecipeError(cfg.source, "colocation.tpot_ms", expected, f"{cfg.colocation.tpot_ms:g}")
