"""Command line: `harli-train RECIPE.yaml [--colocate-with MODEL] [key.sub=value ...]` and a few verbs."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from functools import wraps

import click

from harli_train import __version__

# Mistakes a user can make; each prints one clear line instead of a traceback.
_USER_ERRORS: tuple[type[BaseException], ...] = ()


def _user_errors() -> tuple[type[BaseException], ...]:
    global _USER_ERRORS
    if not _USER_ERRORS:
        from harli_train.adapter import AdapterError
        from harli_train.config import RecipeError
        from harli_train.data.dataset import DataError
        from harli_train.model import ModelError
        from harli_train.train.checkpoint import CheckpointError

        _USER_ERRORS = (RecipeError, ModelError, DataError, AdapterError, CheckpointError)
    return _USER_ERRORS


def _friendly(fn: Callable) -> Callable:
    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _user_errors() as e:
            raise click.ClickException(str(e)) from None
        except FileNotFoundError as e:
            raise click.ClickException(f"file not found: {e.filename}") from None

    return wrapper


class _RecipeGroup(click.Group):
    """A group whose default command is `train`: `harli-train r.yaml` means `harli-train train r.yaml`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["train", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_RecipeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="harli-train")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Finetune a LoRA adapter, alone or on the GPU that serves decode for the base model.

    \b
    Main form:  harli-train RECIPE.yaml [--colocate-with MODEL] [key.sub=value ...]
    Example:    harli-train recipes/quickstart.yaml train.steps=50
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="harli-train: %(message)s",
                        stream=sys.stderr)


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--colocate-with", "colocate_with", metavar="MODEL",
              help="Serve MODEL (a preset or HF directory) for decode on the same GPU while training.")
@click.option("--policy", help="Co-location policy: harli, static:N, streams, temporal or exclusive.")
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in the output directory.")
@click.option("--resume-from", type=click.Path(exists=True), help="Continue from this checkpoint or run directory.")
@click.option("--quiet", is_flag=True, help="No per-step console lines (metrics.jsonl is still written).")
@_friendly
def train(recipe: str, overrides: tuple[str, ...], colocate_with: str | None, policy: str | None,
          resume: bool, resume_from: str | None, quiet: bool) -> None:
    """Train as RECIPE says; OVERRIDES are `section.key=value` pairs applied on top of it."""
    from harli_train.config import load_recipe
    from harli_train.train.trainer import Trainer

    if policy is not None:
        overrides = (*overrides, f"colocation.policy={policy}")
    cfg = load_recipe(recipe, overrides)
    if colocate_with is not None:
        raise click.ClickException(
            "--colocate-with: the co-location runtime is not part of this build yet; "
            "train standalone (without --colocate-with) for now"
        )
    trainer = Trainer(cfg, quiet=quiet)
    trainer.setup(resume=resume_from or (cfg.output.dir if resume else None))
    summary = trainer.train()
    click.echo(json.dumps(summary, indent=2))
    if summary["interrupted"]:
        sys.exit(130)
