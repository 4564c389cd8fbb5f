"""Entry points for the command line: one-shot generation, and replaying a load against the engine."""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from harli_train.engine.adapters import AdapterCatalog, read_for_serving
from harli_train.engine.engine import DecodeEngine, RequestRefused
from harli_train.engine.engine_config import EngineConfig, EngineError
from harli_train.engine.load import (
    TraceError,
    TraceReplay,
    TraceRequest,
    poisson_trace,
    read_trace,
    synthetic_prompt,
)
from harli_train.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_engine(
    model_source: str,
    device: str = "auto",
    dtype: str = "auto",
    seed: int = 0,
    config: EngineConfig | None = None,
    adapter: str | None = None,
) -> DecodeEngine:
    """Load `model_source` (preset or HF directory) and its tokenizer, and build an engine over it.

    With a PEFT `adapter` directory the engine has one adapter slot holding it, slot 1 (requests name it
    with `lora_slot=1`): served unmerged, by the same path as `serve --adapter`."""
    if adapter is None:
        return build_catalog(model_source, device, dtype, seed, config).engine
    return build_catalog(model_source, device, dtype, seed, config, adapters=[adapter]).engine


def build_catalog(
    model_source: str,
    device: str = "auto",
    dtype: str = "auto",
    seed: int = 0,
    config: EngineConfig | None = None,
    adapters: Sequence[str] = (),
    extra_slots: int = 0,
    max_lora_rank: int | None = None,
) -> AdapterCatalog:
    """An engine over `model_source` serving the base and each PEFT directory of `adapters` under its folder
    name (slots 1, 2, ... in that order), with `extra_slots` more slots for adapters loaded later, of rank
    <= `max_lora_rank` (default: the largest of `adapters`' ranks and 16). AdapterError for an adapter that
    does not fit the model."""
    from harli_train.data.tokenizer import load_tokenizer
    from harli_train.model import is_preset, load_model, resolve_dtype

    dev = _device(device)
    model = load_model(model_source, resolve_dtype(dtype, dev), dev, seed=seed)
    cfg = replace(config) if config is not None else EngineConfig()
    if adapters or extra_slots:
        ranks = [read_for_serving(model, path).rank for path in adapters]  # checked before sizing slots
        cfg.max_loras = max(cfg.max_loras, len(adapters) + extra_slots)
        cfg.max_lora_rank = max_lora_rank or max([16, *ranks])
    tokenizer = load_tokenizer(model_source, is_preset(model_source))
    engine = DecodeEngine(model, cfg, tokenizer=tokenizer)
    catalog = AdapterCatalog(engine, model_id(model_source))
    for path in adapters:
        catalog.add(adapter_id(path), catalog.read(path), str(path))
    return catalog


def model_id(source: str) -> str:
    """The id clients name a served model by: a preset's name, or an HF directory's folder name."""
    return Path(source).name if Path(source).expanduser().is_dir() else source


def adapter_id(path: str | Path) -> str:
    """The id an adapter directory is served under: its folder's name."""
    return Path(path).expanduser().resolve().name


def generate_text(
    model_source: str,
    prompts: list[str],
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    config: EngineConfig | None = None,
) -> list[str]:
    """Completions of `prompts` (one batch, continuous batching); a refused prompt gives '' and a warning."""
    longest = max((len(p.encode()) for p in prompts), default=0) + max_tokens + 1
    cfg = config or EngineConfig(max_model_len=max(longest, 256), max_num_seqs=max(1, min(256, len(prompts))))
    engine = build_engine(model_source, device, dtype, seed, cfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    seqs = engine.generate(prompts, params)
    return ["" if s.finish_reason == "refused" else engine.decode_text(s) for s in seqs]


def _trace_requests(
    trace: str | Path | None,
    rate: float | None,
    duration_s: float,
    prompt_len,
    output_len,
    burst_rate: float | None,
    seed: int,
) -> list[TraceRequest]:
    if trace is not None:
        return read_trace(trace)
    if rate is None:
        raise EngineError("serve-trace: give a trace file or a synthetic request rate (requests/s)")
    return poisson_trace(rate, duration_s, prompt_len, output_len, seed=seed, burst_rate=burst_rate)


def serve_trace(
    model_source: str,
    out_dir: str | Path,
    trace: str | Path | None = None,
    *,
    rate: float | None = None,
    duration_s: float = 60.0,
    prompt_len: int | str = 512,
    output_len: int | str = 128,
    burst_rate: float | None = None,
    max_batch: int = 64,
    time_scale: float = 1.0,
    kv_cache_bytes: int | None = None,
    ignore_eos: bool = True,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    config: EngineConfig | None = None,
) -> dict[str, Any]:
    """Replay a trace file (or a synthetic Poisson load) against the engine in real time.

    Writes requests.jsonl, steps.jsonl and summary.json under `out_dir` and returns the summary. Requests
    keep to their output length (`ignore_eos`), as serving benchmarks do; refused ones are recorded.
    """
    requests = _trace_requests(trace, rate, duration_s, prompt_len, output_len, burst_rate, seed)
    named = sorted({r.model for r in requests if r.model not in (None, model_id(model_source))})
    if named:
        raise TraceError(
            f"trace {trace}: request for model {named[0]!r}, but serve-trace serves the base model only "
            f"({model_id(model_source)!r}); the co-located run serves its adapter by the run's name"
        )
    need_len = max((r.prompt_len or len(r.prompt.encode()) + 1) + r.output_len for r in requests)
    cfg = config or EngineConfig(
        max_num_seqs=max_batch, max_model_len=max(need_len, 256), seed=seed, kv_cache_bytes=kv_cache_bytes
    )
    engine = build_engine(model_source, device, dtype, seed, cfg)
    vocab = engine.model.config.vocab_size

    # Warm-up (kernel compilation, first allocations) outside the measured run.
    engine.generate([synthetic_prompt(32, vocab, seed)], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.reset_metrics()

    replay = TraceReplay(requests, time_scale)
    t0 = engine.metrics.t0
    while not replay.exhausted or engine.has_unfinished():
        for r in replay.due(engine.clock() - t0):
            prompt = (
                r.prompt
                if r.prompt is not None
                else synthetic_prompt(r.prompt_len, vocab, seed + zlib.crc32(str(r.request_id).encode()))
            )
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=ignore_eos, seed=seed)
            try:
                engine.add_request(
                    prompt, params, request_id=r.request_id, arrival_time=t0 + r.arrival_s * time_scale
                )
            except RequestRefused as e:
                log.warning("%s", e)  # recorded in the metrics; the others continue
        if engine.has_unfinished():
            engine.step()
        elif not replay.exhausted:
            time.sleep(max(0.0, min(0.05, replay.next_arrival_s() - (engine.clock() - t0))))
    summary = engine.metrics.write(out_dir)
    summary["setup"] = {
        "model": model_source,
        "trace": str(trace) if trace is not None else None,
        "synthetic": None
        if trace is not None
        else {
            "rate": rate,
            "duration_s": duration_s,
            "prompt_len": str(prompt_len),
            "output_len": str(output_len),
            "burst_rate": burst_rate,
        },
        "time_scale": time_scale,
        "ignore_eos": ignore_eos,
        "device": str(engine.device),
        "kv_blocks": engine.storage.num_blocks,
        "engine": asdict(engine.config),  # max_model_len capped at the model's context
    }
    (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log.info(
        "serve-trace: %d requests, TTFT p50 %s ms, TPOT p50 %s ms -> %s",
        summary["requests"],
        summary["ttft_ms"]["p50"],
        summary["tpot_ms"]["p50"],
        out_dir,
    )
    return summary
