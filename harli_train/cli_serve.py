"""The serving commands: `serve` (an OpenAI-compatible API), `loadgen` (a client that replays a trace over
HTTP) and `serve-trace` (a trace replayed in-process against the decode engine)."""

from __future__ import annotations

import click

from harli_train.cli_support import friendly, strict_json, tensor_parallel_run
from harli_train.engine.engine_config import gib_bytes

# The engine's KV cache size, for `serve` and `serve-trace` alike.
kv_cache_option = click.option(
    "--kv-cache-gib",
    default=None,
    type=click.FloatRange(min=0.0, min_open=True),
    help="The KV cache's size [default: 90% of the GPU less what is in use there; on a CPU 256 MiB]; fixed "
    "sizes let engines share a GPU.",
)


@click.command()
@click.option("--model", "model_source", required=True, help="Preset or local HF directory to serve.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0: any free port."
)
@click.option("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1/ requests.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Records (default: runs/serve-<model name>).")  # fmt: skip
@click.option("--max-queue", default=256, show_default=True, type=click.IntRange(min=1),
              help="Requests waiting at most; more get 429.")  # fmt: skip
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(min=1))
@kv_cache_option
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--adapter", "adapters", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A PEFT LoRA adapter directory (safetensors) to serve as model id <its folder name>; "
              "repeat for more.")  # fmt: skip
@click.option("--allow-runtime-lora", is_flag=True,
              help="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter.")  # fmt: skip
@click.option("--max-loras", default=None, type=click.IntRange(min=1),
              help="Adapter slots [default: one per --adapter, "
              "4 more with --allow-runtime-lora].")  # fmt: skip
@click.option("--max-lora-rank", default=None, type=click.IntRange(1, 256),
              help="Largest adapter rank served "
              "[default: the largest --adapter's, at least 16].")  # fmt: skip
@click.option("--tensor-parallel", "tensor_parallel", type=int, default=1, show_default=True, metavar="N",
              help="Split the model over N ranks (GPUs; gloo processes on a CPU).")  # fmt: skip
@friendly
def serve(
    model_source: str,
    host: str,
    port: int,
    api_key: str | None,
    out_dir: str | None,
    max_queue: int,
    max_batch: int,
    kv_cache_gib: float | None,
    device: str,
    adapters: tuple[str, ...],
    allow_runtime_lora: bool,
    max_loras: int | None,
    max_lora_rank: int | None,
    tensor_parallel: int,
) -> None:
    """Serve MODEL (and each --adapter, unmerged) behind an OpenAI-compatible API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics) until SIGTERM or Ctrl-C; the records go under
    --out."""
    from harli_train.serve.command import run_server

    if tensor_parallel != 1:
        if adapters or allow_runtime_lora:
            raise click.UsageError(
                "--tensor-parallel does not serve adapters yet (--adapter, --allow-runtime-lora)"
            )
        args = dict(model=model_source, host=host, port=port, api_key=api_key, out_dir=out_dir)
        args.update(max_queue=max_queue, max_batch=max_batch, kv_cache_gib=kv_cache_gib, device=device)
        summary = tensor_parallel_run("serve", tensor_parallel, [model_source], device, args)
    else:
        summary = run_server(
            model_source, host, port, api_key, out_dir, max_queue, max_batch, device,
            adapters=adapters, allow_runtime_lora=allow_runtime_lora, max_loras=max_loras,
            max_lora_rank=max_lora_rank, kv_cache_gib=kv_cache_gib,
        )  # fmt: skip
    click.echo(strict_json({k: summary[k] for k in ("model", "records", "requests", "refused")}, 1))


@click.command()
@click.option("--url", required=True, help="The server, e.g. http://127.0.0.1:8000 (its /v1 API).")
@click.option("--trace", required=True, type=click.Path(exists=True, dir_okay=False), help="JSONL trace.")
@click.option("--model", default=None, help="Model id to ask for (default: the server's first).")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True))
@click.option("--api-key", default=None)
@click.option("--tpot-ms", default=None, type=click.FloatRange(min=0.0, min_open=True),
              help="Judge every token interval against this objective.")  # fmt: skip
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Write client_requests.jsonl and client_summary.json here.")  # fmt: skip
@friendly
def loadgen(
    url: str,
    trace: str,
    model: str | None,
    time_scale: float,
    api_key: str | None,
    tpot_ms: float | None,
    out_dir: str | None,
) -> None:
    """Replay TRACE against a server over HTTP, streaming; measure TTFT and TPOT at the client."""
    from harli_train.serve.loadgen import run_loadgen

    summary = run_loadgen(url, trace, model, time_scale, api_key, tpot_ms, out_dir)
    click.echo(strict_json(summary, 1))


@click.command("serve-trace")
@click.option(
    "--model", "model_source", default="tiny", show_default=True, help="Preset or local HF directory."
)
@click.option(
    "--trace", type=click.Path(exists=True, dir_okay=False), help="JSONL trace (see recipes/traces/)."
)
@click.option(
    "--rate", type=click.FloatRange(min=0.0, min_open=True), help="Synthetic Poisson load, requests/s."
)
@click.option("--duration", default=30.0, show_default=True, help="Seconds of synthetic load.")
@click.option(
    "--prompt-len", default="512", show_default=True, help="N, uniform:LO:HI or lognormal:MEDIAN:SIGMA."
)
@click.option("--output-len", default="128", show_default=True, help="Same forms as --prompt-len.")
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--time-scale", default=1.0, show_default=True, help="Stretch (>1) or compress trace time.")
@kv_cache_option
@click.option("--out", "out_dir", default="runs/serve", show_default=True, type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@friendly
def serve_trace(
    model_source: str,
    trace: str | None,
    rate: float | None,
    duration: float,
    prompt_len: str,
    output_len: str,
    max_batch: int,
    time_scale: float,
    kv_cache_gib: float | None,
    out_dir: str,
    seed: int,
    device: str,
) -> None:
    """Replay a trace (or a Poisson load) against the decode engine; write per-request/per-step metrics."""
    from harli_train.engine.api import serve_trace as run

    if (trace is None) == (rate is None):
        raise click.UsageError("give exactly one of --trace and --rate")
    summary = run(
        model_source,
        out_dir,
        trace,
        rate=rate,
        duration_s=duration,
        prompt_len=prompt_len,
        output_len=output_len,
        max_batch=max_batch,
        time_scale=time_scale,
        kv_cache_bytes=gib_bytes(kv_cache_gib),
        seed=seed,
        device=device,
    )
    click.echo(strict_json({k: summary[k] for k in summary if k != "setup"}, indent=1))
