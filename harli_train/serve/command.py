"""`harli-train serve`: the engine alone behind the OpenAI-compatible HTTP API, until SIGTERM or Ctrl-C.

On a GPU the engine is warmed up before the port opens (``warm_for_serving``). Shutdown stops admitting (new
requests get 503), gives running requests ``grace_s`` to finish, aborts the rest, writes the records
(``OUT/serve/requests.jsonl``, ``steps.jsonl``, ``summary.json``) and returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harli_train.engine.api import model_id
from harli_train.engine.engine_config import EngineConfig, capped_to_context, gib_bytes

log = logging.getLogger(__name__)


def run_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    out_dir: str | Path | None = None,
    max_queue: int = 256,
    max_batch: int = 64,
    device: str = "auto",
    grace_s: float = 10.0,
    ready: Callable[[int], None] | None = None,
    adapters: Sequence[str] = (),
    allow_runtime_lora: bool = False,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    kv_cache_gib: float | None = None,
    build: Callable[[EngineConfig], Any] | None = None,
) -> dict[str, Any]:
    """Serve ``model`` and each PEFT directory of ``adapters`` (under its folder's name) on ``host:port``
    (port 0: any free one, passed to ``ready``) until SIGTERM/SIGINT; returns the serving summary.

    ``allow_runtime_lora`` adds the routes that load and unload adapters while serving. ``max_loras`` adapter
    slots (default: one per adapter, and 4 more with ``allow_runtime_lora``) of rank ``max_lora_rank``
    (default: the largest given, at least 16); ``kv_cache_gib``: the KV cache's size (default: the engine's
    rule, `EngineConfig`). ``build(config)``: the engine to serve with instead, the base
    only (tensor parallelism passes rank 0's, which leads the other ranks through its warm-up too)."""
    from harli_train.adapter import AdapterError
    from harli_train.engine.adapters import AdapterCatalog
    from harli_train.engine.api import build_catalog
    from harli_train.model import model_config
    from harli_train.serve.app import Server
    from harli_train.serve.engine_loop import EngineLoop

    name = model_id(model)
    out = Path(out_dir or f"runs/serve-{name}")
    out.mkdir(parents=True, exist_ok=True)
    context = model_config(model).max_position_embeddings
    cfg = EngineConfig(max_num_seqs=max_batch, max_model_len=context, kv_cache_bytes=gib_bytes(kv_cache_gib))
    cfg = capped_to_context(cfg, context)
    if build is not None:
        engine = build(cfg)
        catalog = AdapterCatalog(engine, name)
    else:
        extra = 4 if allow_runtime_lora else 0
        if max_loras is not None:
            if max_loras < len(adapters):
                raise AdapterError(
                    f"--max-loras {max_loras} is fewer than the {len(adapters)} adapters given"
                )
            extra = max_loras - len(adapters)
        catalog = build_catalog(
            model, device, config=cfg, adapters=adapters, extra_slots=extra, max_lora_rank=max_lora_rank
        )
        engine = catalog.engine
    warm_for_serving(engine)
    loop = EngineLoop(engine, max_queue=max_queue, catalog=catalog)
    loop.start()
    server = Server(
        loop.port,
        engine.tokenizer,
        cfg.max_model_len,
        catalog,
        api_key,
        alive=lambda: loop.alive,
        allow_runtime_lora=allow_runtime_lora,
    )
    try:
        asyncio.run(_serve(server, host, port, grace_s, ready))
    finally:
        loop.stop(grace_s)
        summary = engine.metrics.write(out / "serve")
        engine.close()
    summary = {"model": name, "records": str(out / "serve"), **summary}
    (out / "serve" / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log.info("served %d requests; records in %s", summary.get("requests", 0), out / "serve")
    return summary


def warm_for_serving(engine: Any) -> float:
    """Warm ``engine`` up before clients reach it, on a GPU (``DecodeEngine.warm_up``: the prefill shapes
    compiled, every way of sampling run), so that no client's request pays a kernel's compile or first load
    (a compile alone stalls every running request for a second or more); returns the seconds it took (0 on
    a CPU, whose interpreted kernels compile nothing). Needs an idle engine."""
    if engine.device.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    ran = engine.warm_up()
    seconds = time.perf_counter() - t0
    log.info("engine warmed up in %.1f s (%d warm-up requests)", seconds, ran)
    return seconds


async def _serve(server, host: str, port: int, grace_s: float, ready: Callable[[int], None] | None) -> None:
    """Listen until SIGTERM/SIGINT; then stop listening and give running requests ``grace_s`` to end."""
    from aiohttp import web

    runner = web.AppRunner(server.app(), handle_signals=False)
    await runner.setup()
    sock = socket.create_server((host, port), reuse_port=False)
    bound = sock.getsockname()[1]
    await web.SockSite(runner, sock, shutdown_timeout=grace_s).start()
    log.info("serving %s on http://%s:%d/v1 (SIGTERM or Ctrl-C stops)", ", ".join(server.models), host, bound)
    if ready is not None:
        ready(bound)
    stop = asyncio.Event()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio.remove_signal_handler(sig)
        log.info("stopping: no new connections; running requests get %g s", grace_s)
        await runner.cleanup()
