"""Puts a co-located set-up together from a recipe: shared weights, SM ladder, engine, profile, policy.

Order matters: the trainer's model is loaded (once, when the served model is the finetuned base) and set
up first; the engine serves a LoRA-free view of the same weights; every partition the policy may use gets
its decode graphs; the decode-latency profile is loaded or measured; on a GPU the trainer's kernels are
compiled for every SM budget before the clock starts, so no compile stalls decode. ``assemble`` is the one
place this happens, for the command line and the co-location benchmark alike (``Colocation``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from harli_train.colocate.colocation import Colocation
from harli_train.colocate.engine_adapter import EngineAdapter
from harli_train.colocate.live_adapter import LiveAdapter
from harli_train.colocate.policy import needs_partitions, profile_shares
from harli_train.colocate.pool_budget import pool_budget
from harli_train.colocate.pool_memory import PoolMemory
from harli_train.colocate.pool_report import disabled as pool_disabled
from harli_train.colocate.predictor_setup import (
    GraphedWorkload,
    build_predictor,
    check_objective,
    corun_workload,
)
from harli_train.colocate.shared_model import base_view
from harli_train.colocate.sm import SMLadder, TimeSliceLadder, is_cuda_stream, make_ladder
from harli_train.config import ColocationSection, RecipeConfig, RecipeError
from harli_train.data.tokenizer import load_tokenizer
from harli_train.engine import DecodeEngine, EngineConfig, KVCacheSpec, TensorKVStorage
from harli_train.engine.adapters import AdapterCatalog
from harli_train.engine.api import model_id as served_id
from harli_train.engine.engine_config import capped_to_context
from harli_train.engine.load import TraceRequest, poisson_trace, read_trace
from harli_train.memory import PoolError
from harli_train.model import LlamaForCausalLM, is_preset, load_model, model_config, resolve_dtype
from harli_train.train.run_checks import resolve_device
from harli_train.train.trainer import Trainer

log = logging.getLogger(__name__)

DEFAULT_RATE = {"cuda": 4.0, "cpu": 0.5}  # requests/s when a recipe gives neither a trace nor a rate
KV_MEMORY_FRACTION = 0.2  # of the GPU, at most, for the KV cache beside the trainer


def same_model(a: str, b: str) -> bool:
    """Whether two model sources (presets or directories) name the same weights."""
    if is_preset(a) or is_preset(b):
        return a == b
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def load_requests(col: ColocationSection, seed: int = 0, device: str = "cpu") -> list[TraceRequest]:
    """The recipe's load: its trace file, or Poisson arrivals at its rate for ``duration_s`` (rate 0: none,
    e.g. when HTTP clients bring the load)."""
    if col.trace is not None:
        return read_trace(col.trace)
    if col.rate == 0:
        return []
    rate = col.rate
    if rate is None:
        rate = DEFAULT_RATE.get(device, DEFAULT_RATE["cpu"])
        log.info(
            "colocation: no trace or rate in the recipe; serving %g requests/s for %gs", rate, col.duration_s
        )
    return poisson_trace(rate, col.duration_s, col.prompt_len, col.output_len, seed=seed)


def build_ladder(policy: str, device: torch.device, step: int = 16, spatial: bool | None = None) -> SMLadder:
    """Green-context rungs on a GPU (time slicing where impossible); the CPU stand-ins elsewhere: a stand-in
    split (run synchronously) when ``spatial`` or, by default, when ``policy`` needs SM partitions."""
    if device.type == "cuda":
        return make_ladder(step=step, device=device.index or 0)
    if needs_partitions(policy) if spatial is None else spatial:
        return SMLadder.cpu_standin(132, step)
    return TimeSliceLadder.cpu_standin(132, step)


def build_engine(
    model: LlamaForCausalLM,
    tokenizer: Any,
    ladder: SMLadder,
    requests: list[TraceRequest],
    max_batch: int,
    seed: int = 0,
    mixed_prefill: bool = False,
    lora_rank: int | None = None,
    base_id: str = "base",
    kv_storage: Callable[[KVCacheSpec, EngineConfig], Any] | None = None,
    whole_context: bool = False,
    varlen_decode_kernels: bool = True,
    decode_reserve_tokens: int = 0,
) -> EngineAdapter:
    """A decode engine over ``model`` (LoRA-free), its default partition on the ladder's full rung;
    ``mixed_prefill``: prefill chunks ride in decode steps (else prefill steps of their own). With
    ``lora_rank`` it has two adapter slots of that rank (a live adapter's buffers). Its catalog serves the
    base as ``base_id``. ``kv_storage(spec, config)``: the cache to serve from (the page pool's, which grows
    as far as the engine's batch limit and longest sequence can use); default: a fixed tensor, on a GPU sized
    for the batch limit within ``KV_MEMORY_FRACTION`` of the device.

    Sized for the longest of ``requests`` (``whole_context``: for the model's whole context, as HTTP clients
    send what they like) but never past the model's context: a longer request is refused (and recorded so)
    when it arrives, as is one that needs more than the whole KV cache. ``varlen_decode_kernels``,
    ``decode_reserve_tokens``: see ``EngineConfig`` (the first False only to measure the model's forward
    against it).
    """
    longest = max(((r.prompt_len or len(r.prompt.encode()) + 1) + r.output_len for r in requests), default=0)
    if whole_context:
        longest = model.config.max_position_embeddings
    # Steps are not overlapped: the controller sizes each step's partition from the step before it (its
    # measured latency and the batch it leaves), so every step completes before the next is planned.
    cfg = EngineConfig(
        max_num_seqs=max_batch,
        max_model_len=max(longest + 1, 256),
        seed=seed,
        overlap=False,
        mixed_prefill=mixed_prefill,
        max_loras=2 if lora_rank else 0,
        max_lora_rank=lora_rank or 16,
        varlen_decode_kernels=varlen_decode_kernels,
        decode_reserve_tokens=decode_reserve_tokens,
    )
    cfg = capped_to_context(cfg, model.config.max_position_embeddings)  # before the cache is sized from it
    device = model.lm_head.weight.device
    spec = KVCacheSpec.for_model(model.config, cfg.block_size, model.lm_head.weight.dtype)
    storage = None
    if kv_storage is not None:
        storage = kv_storage(spec, cfg)
    elif (
        device.type == "cuda"
    ):  # size the cache for the batch limit, leaving the rest of the GPU to the trainer
        cfg.num_kv_blocks = plain_kv_blocks(cfg, spec, device)
    full = ladder.full
    stream = full.infer_stream if is_cuda_stream(full.infer_stream) else None
    engine = DecodeEngine(
        model, cfg, stream=stream, num_sms=full.infer_sms, storage=storage, tokenizer=tokenizer
    )
    return EngineAdapter(engine, full, seed=seed, catalog=AdapterCatalog(engine, base_id))


def plain_kv_blocks(cfg: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """The fixed cache's blocks beside the trainer: enough for the batch limit, within
    ``KV_MEMORY_FRACTION`` of the GPU (``cpu_kv_bytes`` on a CPU), at least one longest sequence."""
    useful = cfg.max_num_seqs * cfg.max_blocks_per_seq
    if device.type == "cuda":
        cap = int(KV_MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory)
    else:
        cap = cfg.cpu_kv_bytes
    return max(cfg.max_blocks_per_seq, min(useful, cap // spec.bytes_per_block))


def kv_reserve_blocks(requests: Sequence[TraceRequest], col: Any, block_size: int) -> int:
    """The KV blocks the pool keeps clear of the trainer's cached working sets: the batch limit of requests
    of the load's mean length (no load, as with HTTP clients alone: ``prompt_len + output_len``)."""
    lengths = [(r.prompt_len or len(r.prompt.encode()) + 1) + r.output_len for r in requests]
    mean = sum(lengths) / len(lengths) if lengths else col.prompt_len + col.output_len
    return math.ceil(col.max_batch * mean / block_size)


# With train.cuda_graphs the trainer's saved-tensor arena lives in its tenant's stashes (PoolMemory.attach),
# and on a GPU its graphs capture into the tenant's MemPool (docs/design.md, "The arena in the page pool").
# False runs graphed steps on a GPU without the pool (an A/B: tests/test_gpu.py closes it for its runs
# without the pool).
GRAPHS_ON_CUDA_POOL = True


def open_pool(
    cfg: RecipeConfig, trainer: Trainer, device: torch.device
) -> tuple[PoolMemory | None, Callable[[KVCacheSpec, EngineConfig], Any] | None, dict[str, Any]]:
    """The page pool for ``cfg``'s co-located run when ``colocation.memory_pool`` (its budget checked now,
    RecipeError naming the key): (memory, the engine's KV factory, the summary's ``memory`` entry). Without
    the pool, or when the pool cannot be had on this machine (logged), (None, None, the reason)."""
    col = cfg.colocation
    if not col.memory_pool:
        return None, None, {"pool": pool_disabled("colocation.memory_pool is false")}
    if cfg.train.cuda_graphs and device.type == "cuda" and not GRAPHS_ON_CUDA_POOL:
        reason = "train.cuda_graphs on a GPU runs without the page pool (assembly.GRAPHS_ON_CUDA_POOL is off)"
        log.info("running without the page pool: %s", reason)
        return None, None, {"pool": pool_disabled(reason)}
    budget = pool_budget(cfg, device)
    shape = (cfg.train.batch_size, cfg.data.seq_len, cfg.train.layers_per_microstep)
    memory = PoolMemory(budget, device, trainer.model, shape)
    info: dict[str, Any] = {}

    def kv_storage(spec: KVCacheSpec, engine_cfg: EngineConfig) -> Any:
        try:
            return memory.open(spec, engine_cfg.max_num_seqs * engine_cfg.max_blocks_per_seq)
        except (PoolError, ValueError) as err:  # e.g. a KV block that does not tile the driver's page
            reason = str(err).splitlines()[0]
        # Out of the handler: the traceback no longer holds the half-made pool (its pages are freed).
        log.warning("running without the page pool: %s", reason)
        info["pool"] = pool_disabled(f"the page pool could not be set up: {reason}")
        return TensorKVStorage(spec, plain_kv_blocks(engine_cfg, spec, device), device)

    return memory, kv_storage, info


def check_policy(name: str, where: str = "--policy") -> str:
    try:
        ColocationSection(policy=name)
    except RecipeError as err:
        raise RecipeError(where, "", err.expected, err.found) from None
    return name


def assemble(
    cfg: RecipeConfig,
    serve_model: str,
    resume: str | Path | None = None,
    ladder_step: int | None = None,
    warm_up: bool = True,
    *,
    loads: Sequence[list[TraceRequest]] = (),
    spatial: bool | None = None,
    live_adapter: bool = False,
    http: bool = False,
    parallel: Any = None,
) -> Colocation:
    """Build the co-located set-up for ``cfg`` serving ``serve_model``, and the recipe's policy on it.

    A ``serve_model`` that names no preset or directory fails first (ModelError), then a recipe trace that
    cannot be read (TraceError). The trainer (resumed from ``resume`` when given) comes next: its output
    directory is checked before anything is loaded, and its model is the weights the engine serves when
    ``serve_model`` is the finetuned base. The engine is sized for the longest request of the recipe's load
    and of ``loads`` (further loads the caller will serve on it), or with ``http`` (``--serve``: clients send
    requests of any length) for the model's whole context. ``spatial=True`` gives a CPU the stand-in ladder
    with SM partitions whatever the recipe's policy (default: as the policy needs; a GPU has its green
    contexts either way). The decode profile is ``colocation.profile`` when set (reused when it matches this
    machine, else measured and written there). The recipe's policy is ``Colocation.policy``, prepared
    (``Colocation.prepare``) when ``warm_up``. RecipeError when the policy cannot run on this machine or no
    decode step can meet the objective.

    With ``live_adapter`` (``--serve``), or a load whose requests name a model, the trainer's adapter is
    served live as model id ``<output dir name>`` (``LiveAdapter``), when the served model is the trained
    base; a request naming a model not served is a RecipeError. ``parallel``: this rank's part of a
    tensor-parallel job (``parallel.colocated.TPAssembly``: its trainer, model slices, engine publishing and
    share agreement), None on one GPU.
    """
    col = cfg.colocation
    device = resolve_device(cfg.train.device, cfg.source)
    dtype = resolve_dtype(cfg.model.dtype, device)
    shared = same_model(serve_model, cfg.model.name)
    if not shared:
        model_config(serve_model)  # a served model that is not there fails before the trainer loads its own
    requests = load_requests(col, seed=cfg.train.seed, device=device.type)  # a bad trace fails here too
    trainer = Trainer(cfg, quiet=True) if parallel is None else parallel.trainer(cfg)
    trainer.setup(resume=resume)  # checks the output directory before loading anything
    load = load_model if parallel is None else parallel.load_served
    served = base_view(trainer.model) if shared else load(serve_model, dtype, device, seed=cfg.model.seed)
    ladder = build_ladder(col.policy, device, ladder_step or col.ladder_step, spatial)
    every_request = [*requests, *(r for load in loads for r in load)]
    live = shared and (live_adapter or any(r.model is not None for r in every_request))
    memory, kv_storage, memory_info = open_pool(cfg, trainer, device)
    engine = build_engine(
        served,
        load_tokenizer(serve_model, is_preset(serve_model)),
        ladder,
        every_request,
        col.max_batch,
        seed=cfg.train.seed,
        mixed_prefill=col.mixed_prefill,
        lora_rank=cfg.lora.rank if live else None,
        base_id=served_id(serve_model),
        kv_storage=kv_storage,
        whole_context=http,
        decode_reserve_tokens=col.decode_reserve_tokens,
    )
    if memory is not None and memory.kv is None:
        memory = None  # it could not be set up: a fixed cache instead (memory_info says why)
    if memory is not None:
        memory.bind(engine.engine)
        memory.attach(trainer)
        memory.kv_reserve_blocks = kv_reserve_blocks(every_request, col, engine.engine.config.block_size)
        # The profile's synthetic steps read distinct blocks, as many as a fixed cache would have.
        memory.fit_blocks(plain_kv_blocks(engine.engine.config, engine.engine.storage.spec, device))
    live_adapter_ = None
    if live:
        live_adapter_ = LiveAdapter(
            engine.engine,
            engine.catalog,
            Path(cfg.output.dir).name,
            trainer.model,
            trainer.step,
            col.serve_adapter_every,
        )
    unknown = sorted({r.model for r in every_request if r.model is not None} - set(engine.catalog.ids()))
    if unknown:
        engine.close()
        if memory is not None:
            memory.close()
        trainer.metrics.close()
        expected = f"requests naming a served model ({', '.join(engine.catalog.ids())})"
        raise RecipeError(cfg.source, "colocation.trace", expected, f"model {unknown[0]!r}")
    if parallel is not None:
        parallel.lead(engine)
    # Every policy sizes its mixed steps' prefill chunks from the predictor; harli picks its shares with it.
    model_id = f"{serve_model}|{dtype}|batch{col.max_batch}|{ladder.kind}"
    # Under tensor parallelism the load beside profiled steps runs without collectives (it needs none).
    corun = (
        corun_workload(
            trainer.model,
            cfg.train.batch_size,
            cfg.data.seq_len,
            cfg.train.layers_per_microstep,
            dtype,
            wrap=parallel.local_fn if parallel is not None else None,
        )
        if device.type == "cuda"
        else None
    )
    shares = profile_shares(col.policy, ladder)
    predictor, profile = build_predictor(
        engine, ladder, model_id, corun, col.max_batch, col.profile, shares=shares
    )
    if isinstance(corun, GraphedWorkload):
        corun.release()
    if memory is not None:
        memory.fit_blocks(1)  # the run grows the cache as its load needs; the trainer warms up beside it
    info = {
        "serve_model": serve_model,
        "train_model": cfg.model.name,
        "shared_weights": shared,
        "device": str(device),
        "requests_in_load": len(requests),
        "profile": {
            "samples": len(profile.samples),
            "key": profile.key.describe(),
            "fit": predictor.fit_report,
        },
        "memory": memory_info,
    }
    if live_adapter_ is not None:
        info["live_adapter"] = {"model": live_adapter_.name, "every": col.serve_adapter_every}
    colocation = Colocation(
        cfg,
        trainer,
        engine,
        ladder,
        requests,
        predictor,
        profile,
        info,
        engine.catalog,
        live_adapter_,
        memory,
        parallel,
    )
    try:
        try:
            policy = colocation.new_policy()
        except ValueError as err:
            raise RecipeError(
                cfg.source, "colocation.policy", "a policy this machine can run", str(err)
            ) from None
        engine.register(policy.partitions())
        check_objective(cfg, policy, engine, predictor, profile)
    except RecipeError:
        colocation.close()
        trainer.metrics.close()
        raise
    colocation.policy = colocation.prepare(policy) if warm_up else policy
    return colocation
