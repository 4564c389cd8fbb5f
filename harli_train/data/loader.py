"""Fixed-shape training batches, epoch after epoch, resumable mid-epoch."""

from __future__ import annotations

import numpy as np
import torch

from harli_train.data.example import IGNORE_INDEX, DataError, Example

STATE_CONFIG_KEYS = ("batch_size", "seq_len", "packing", "shuffle", "seed", "num_examples", "num_tokens")


class DataLoader:
    """An endless stream of [batch_size, seq_len] batches over `examples`.

    Each epoch visits the examples in an order drawn from (seed, epoch) alone, never from the global
    RNG, so the batch sequence depends only on the arguments, and state_dict() (epoch and batch within
    it) is all a resumed loader needs to yield exactly the batches an uninterrupted one would.

    packing=True: the epoch's examples are concatenated into one token stream (labels alongside) and
    cut into rows of seq_len, as HF's group_texts does. A row can span several examples; attention
    stays causal over the whole row (no per-example mask) and labels are kept as they are, so a token
    may attend to the end of the example before it. Since load_examples labels bos IGNORE_INDEX, no
    loss is taken on guessing where the next example starts. The partial row at the end of the stream
    and the rows that would not fill a last batch are dropped.

    packing=False: one example per row, truncated to seq_len (keeping its start) or right-padded with
    pad_id and labels IGNORE_INDEX. Under causal attention right padding cannot affect the real
    tokens, so no attention mask is needed.
    """

    def __init__(
        self,
        examples: list[Example],
        batch_size: int,
        seq_len: int,
        pad_id: int,
        packing: bool = True,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 (one input and its next token), got {seq_len}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if not examples:
            raise DataError("no examples to build batches from")
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.packing, self.shuffle, self.seed = packing, shuffle, seed
        self.num_examples = len(examples)
        lengths = [len(e.input_ids) for e in examples]
        self.num_tokens = sum(lengths)
        self.num_truncated = sum(n > seq_len for n in lengths) if not packing else 0

        if packing:
            # All examples back to back; an epoch's stream is a gather from these in shuffled order.
            self._lengths = torch.tensor(lengths, dtype=torch.long)
            self._starts = torch.cumsum(self._lengths, 0) - self._lengths
            self._ids = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.long)
            self._labels = torch.tensor([t for e in examples for t in e.labels], dtype=torch.long)
            rows = self.num_tokens // seq_len
        else:
            self._ids = torch.full((self.num_examples, seq_len), pad_id, dtype=torch.long)
            self._labels = torch.full((self.num_examples, seq_len), IGNORE_INDEX, dtype=torch.long)
            for i, e in enumerate(examples):
                n = min(len(e.input_ids), seq_len)
                self._ids[i, :n] = torch.tensor(e.input_ids[:n], dtype=torch.long)
                self._labels[i, :n] = torch.tensor(e.labels[:n], dtype=torch.long)
            rows = self.num_examples
        self._batches_per_epoch = rows // batch_size
        if self._batches_per_epoch == 0:
            raise DataError(self._too_little_data_message())

        self._epoch, self._step = 0, 0
        self._cached_epoch = -1
        self._rows_ids = self._rows_labels = torch.empty(0, dtype=torch.long)

    @property
    def batches_per_epoch(self) -> int:
        return self._batches_per_epoch

    @property
    def epoch(self) -> float:
        """Progress in epochs: 1.25 is a quarter of the way through the second epoch."""
        return self._epoch + self._step / self._batches_per_epoch

    def next_batch(self) -> dict:
        """input_ids and labels as LongTensor[batch_size, seq_len], and num_target_tokens: how many
        tokens the shifted loss is taken on, (labels[:, 1:] != IGNORE_INDEX).sum()."""
        if self._cached_epoch != self._epoch:
            self._rows_ids, self._rows_labels = self._epoch_rows(self._epoch)
            self._cached_epoch = self._epoch
        rows = slice(self._step * self.batch_size, (self._step + 1) * self.batch_size)
        input_ids = self._rows_ids[rows].clone()
        labels = self._rows_labels[rows].clone()
        self._step += 1
        if self._step == self._batches_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
        num_target_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
        return {"input_ids": input_ids, "labels": labels, "num_target_tokens": num_target_tokens}

    def state_dict(self) -> dict:
        """Position (epoch, batch within it) plus the settings a resume must match; plain ints/bools."""
        state = {key: getattr(self, key) for key in STATE_CONFIG_KEYS}
        return {"epoch": self._epoch, "step": self._step, **state}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; the data and batch settings must be the ones it was saved with."""
        changed = [
            f"{key} was {state[key]!r}, now {getattr(self, key)!r}"
            for key in STATE_CONFIG_KEYS
            if key in state and state[key] != getattr(self, key)
        ]
        if changed:
            raise DataError(
                "cannot resume the data loader; the data or its settings changed: " + "; ".join(changed)
            )
        if not 0 <= state["step"] < self._batches_per_epoch or state["epoch"] < 0:
            raise DataError(
                f"cannot resume the data loader: position epoch={state['epoch']} step={state['step']} "
                f"is out of range ({self._batches_per_epoch} batches per epoch)"
            )
        self._epoch, self._step = int(state["epoch"]), int(state["step"])

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_examples)
        # Seeding with the (seed, epoch) pair keeps every epoch's stream independent of every other's.
        rng = np.random.default_rng([self.seed, epoch])
        return torch.from_numpy(rng.permutation(self.num_examples))

    def _epoch_rows(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All of one epoch's rows, [batches_per_epoch * batch_size, seq_len] (more in padding mode)."""
        order = self._order(epoch)
        if not self.packing:
            return self._ids[order], self._labels[order]
        lengths, starts = self._lengths[order], self._starts[order]
        # Stream position p inside the k-th example of the epoch reads flat index starts[k] + p - offsets[k].
        offsets = torch.cumsum(lengths, 0) - lengths
        index = torch.repeat_interleave(starts - offsets, lengths) + torch.arange(self.num_tokens)
        index = index[: self._batches_per_epoch * self.batch_size * self.seq_len]
        return self._ids[index].view(-1, self.seq_len), self._labels[index].view(-1, self.seq_len)

    def _too_little_data_message(self) -> str:
        b, t = self.batch_size, self.seq_len
        if self.packing:
            return (
                f"not enough data for one batch: packing needs batch_size x seq_len = {b} x {t} = {b * t} "
                f"tokens, but the {self.num_examples} examples have {self.num_tokens}"
            )
        return (
            f"not enough data for one batch: batch_size is {b}, but there are only "
            f"{self.num_examples} examples (padding mode uses one example per row)"
        )
