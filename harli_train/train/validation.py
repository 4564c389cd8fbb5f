"""A run's data as its recipe names it: the training examples, and the validation set with its schedule."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator

from harli_train.config import RecipeConfig
from harli_train.data.dataset import load_examples, split_examples
from harli_train.data.example import DataError, Example
from harli_train.data.loader import eval_batches
from harli_train.data.tokenizer import Tokenizer
from harli_train.model.llama import LlamaForCausalLM
from harli_train.train.batch_buffers import BatchBuffers
from harli_train.train.step import MicroStep, eval_step

log = logging.getLogger(__name__)


def load_run_data(cfg: RecipeConfig, tokenizer: Tokenizer) -> tuple[list[Example], Validation | None]:
    """(training examples, validation or None): data.path's examples, less a seeded data.val_fraction of them
    when that is set (the same split on every run and resume with this train.seed), or data.val_path's.
    DataError for validation data with no token to take a loss on; a warning for train.eval_every without
    validation data."""
    data = cfg.data

    def load(path: str, max_examples: int | None = None) -> list[Example]:
        return load_examples(path, data.format, tokenizer, max_examples, data.train_on)

    examples, val = load(data.path, data.max_examples), None
    if data.val_path is not None:
        val = load(data.val_path)
    elif data.val_fraction is not None:
        examples, val = split_examples(examples, data.val_fraction, cfg.train.seed)
    if val is None:
        if cfg.train.eval_every:
            log.warning(
                "train.eval_every is set, but there is no validation data "
                "(data.val_path or data.val_fraction)"
            )
        return examples, None
    batches = eval_batches(val, cfg.train.batch_size, data.seq_len, tokenizer.pad_id, data.packing)
    if not sum(b["num_target_tokens"] for b in batches):
        raise DataError(
            f"the validation data ({data.val_path or 'data.val_fraction of ' + data.path}) "
            f"has no token to take a loss on within data.seq_len ({data.seq_len})"
        )
    return examples, Validation(batches, cfg.train.eval_every, cfg.train.layers_per_microstep)


class Validation:
    """The validation batches of a run (`eval_batches`: every example once and whole) and when they are
    evaluated: every `every` steps (0: never on a schedule) and after the last step."""

    def __init__(self, batches: list[dict], every: int, layers_per_microstep: int):
        self.batches, self.every, self.layers_per_microstep = batches, every, layers_per_microstep

    def due(self, step: int, last: bool) -> bool:
        """Whether the step just counted (`last`: the run's last one) is evaluated."""
        return last or (self.every > 0 and step % self.every == 0)

    def run(
        self,
        model: LlamaForCausalLM,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        buffers: BatchBuffers | None = None,
    ) -> Generator[MicroStep, None, float]:
        """The mean token loss over the validation set, as "eval" micro-steps (`eval_step`: the adapter, the
        data position and the RNG are untouched)."""
        loss, _ = yield from eval_step(model, self.batches, self.layers_per_microstep, autocast, buffers)
        return loss
