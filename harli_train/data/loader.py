"""Fixed-shape training batches, epoch after epoch, resumable mid-epoch; and the batches of an evaluation."""

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
    cut into rows of seq_len, as HF's group_texts does, but a row's documents never see each other: each
    batch carries `doc_ids` (which document of the row each token belongs to), for the model's
    block-diagonal causal mask, and `positions` that restart at 0 with every document. A document cut by
    the end of a row goes on in the next row as a document of its own there. A document's first label is
    never learned (in a row it would be predicted from the document before), so each document's loss is
    what it would be alone. The partial row at the end of the stream and the rows that would not fill a
    last batch are dropped.

    packing=False: one example per row, truncated to seq_len (keeping its start) or right-padded with
    pad_id and labels IGNORE_INDEX. Under causal attention right padding cannot affect the real
    tokens, so no `doc_ids` are needed.
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
            self._ids, self._labels, self._lengths = _flatten(examples)
            self._starts = torch.cumsum(self._lengths, 0) - self._lengths
            rows = self.num_tokens // seq_len
        else:
            self._ids, self._labels = _padded_rows(examples, seq_len, pad_id)
            rows = self.num_examples
        self._batches_per_epoch = rows // batch_size
        if self._batches_per_epoch == 0:
            raise DataError(self._too_little_data_message())

        self._epoch, self._step = 0, 0
        self._cached_epoch = -1
        self._rows_ids = self._rows_labels = self._doc_starts = torch.empty(0, dtype=torch.long)

    @property
    def batches_per_epoch(self) -> int:
        return self._batches_per_epoch

    @property
    def epoch(self) -> float:
        """Progress in epochs: 1.25 is a quarter of the way through the second epoch."""
        return self._epoch + self._step / self._batches_per_epoch

    def next_batch(self) -> dict:
        """The next batch: `input_ids`, `labels` and `positions` as LongTensor[batch_size, seq_len], `doc_ids`
        too when packing (see the class), and `num_target_tokens`: how many tokens the shifted loss is taken
        on, (labels[:, 1:] != IGNORE_INDEX).sum()."""
        if self._cached_epoch != self._epoch:
            self._rows_ids, self._rows_labels, self._doc_starts = self._epoch_rows(self._epoch)
            self._cached_epoch = self._epoch
        first, b, t = self._step * self.batch_size, self.batch_size, self.seq_len
        rows = slice(first, first + b)
        if self.packing:
            positions, doc_ids = _layout(self._doc_starts, first * t, b, t)
        else:
            positions, doc_ids = torch.arange(t).expand(b, t).clone(), None
        self._step += 1
        if self._step == self._batches_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
        return _batch(self._rows_ids[rows].clone(), self._rows_labels[rows].clone(), positions, doc_ids)

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

    def _epoch_rows(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All of one epoch's rows, [batches_per_epoch * batch_size, seq_len] (more in padding mode), and
        where each document starts in the epoch's stream (packing; empty otherwise)."""
        order = self._order(epoch)
        if not self.packing:
            return self._ids[order], self._labels[order], torch.empty(0, dtype=torch.long)
        lengths, starts = self._lengths[order], self._starts[order]
        # Stream position p inside the k-th example of the epoch reads flat index starts[k] + p - offsets[k].
        offsets = torch.cumsum(lengths, 0) - lengths
        index = torch.repeat_interleave(starts - offsets, lengths) + torch.arange(self.num_tokens)
        index = index[: self._batches_per_epoch * self.batch_size * self.seq_len]
        return self._ids[index].view(-1, self.seq_len), self._labels[index].view(-1, self.seq_len), offsets

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


def eval_batches(
    examples: list[Example], batch_size: int, seq_len: int, pad_id: int, packing: bool = True
) -> list[dict]:
    """Every token of `examples`, in order, as batches shaped like DataLoader's (same keys), so that an
    evaluation pass sees each example once and whole: packing, examples are placed in rows as they come, a row
    that the next one would overflow is closed and padded (pad_id, labels IGNORE_INDEX, a document of its
    own), and an example longer than seq_len is cut into rows of its own; so with the block-diagonal mask
    each example's loss is the loss it has alone. Without packing each example is a row (truncated to
    seq_len, as in training). The last batch may hold fewer rows."""
    if not examples:
        raise DataError("no examples to evaluate on")
    if not packing:
        ids, labels = _padded_rows(examples, seq_len, pad_id)
        positions = torch.arange(seq_len).expand(len(examples), seq_len)
        return [
            _batch(
                ids[r : r + batch_size],
                labels[r : r + batch_size],
                positions[r : r + batch_size].clone(),
                None,
            )
            for r in range(0, len(examples), batch_size)
        ]
    rows: list[list[tuple[list[int], list[int]]]] = [[]]
    used = 0
    for e in examples:
        labels = [IGNORE_INDEX, *e.labels[1:]]  # nothing in its document precedes its first token
        for s in range(0, len(e.input_ids), seq_len):
            piece = (e.input_ids[s : s + seq_len], labels[s : s + seq_len])
            if used + len(piece[0]) > seq_len:
                rows.append([])
                used = 0
            rows[-1].append(piece)
            used += len(piece[0])
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), seq_len), dtype=torch.long)
    doc_ids = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for r, pieces in enumerate(rows):
        t = 0
        for d, (piece_ids, piece_labels) in enumerate(pieces):
            n = len(piece_ids)
            ids[r, t : t + n], labels[r, t : t + n] = torch.tensor(piece_ids), torch.tensor(piece_labels)
            positions[r, t : t + n], doc_ids[r, t : t + n] = torch.arange(n), d
            t += n
        positions[r, t:], doc_ids[r, t:] = torch.arange(seq_len - t), len(pieces)  # the padding
    return [
        _batch(
            ids[r : r + batch_size],
            labels[r : r + batch_size],
            positions[r : r + batch_size],
            doc_ids[r : r + batch_size],
        )
        for r in range(0, len(rows), batch_size)
    ]


def _flatten(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The examples' ids and labels back to back,
    each example's first label IGNORE_INDEX, and their lengths."""
    ids = torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.long)
    labels = torch.tensor([t for e in examples for t in e.labels], dtype=torch.long)
    lengths = torch.tensor([len(e.input_ids) for e in examples], dtype=torch.long)
    labels[torch.cumsum(lengths, 0) - lengths] = IGNORE_INDEX
    return ids, labels, lengths


def _padded_rows(examples: list[Example], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per example, truncated or right-padded to seq_len (pad_id, labels IGNORE_INDEX)."""
    ids = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), seq_len), IGNORE_INDEX, dtype=torch.long)
    for i, e in enumerate(examples):
        n = min(len(e.input_ids), seq_len)
        ids[i, :n] = torch.tensor(e.input_ids[:n], dtype=torch.long)
        labels[i, :n] = torch.tensor(e.labels[:n], dtype=torch.long)
    return ids, labels


def _layout(
    doc_starts: torch.Tensor, first: int, rows: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, doc_ids), each [rows, seq_len], of the stream tokens [first, first + rows * seq_len) laid
    out in rows of seq_len, where the documents start at stream offsets `doc_starts` (ascending, the first 0).
    A token's position counts from the start of its document, or from its row's start for a document that
    began in an earlier row; its doc id is its document's index in the stream."""
    p = torch.arange(first, first + rows * seq_len)
    doc = torch.searchsorted(doc_starts, p, right=True) - 1
    start = torch.maximum(doc_starts[doc], p - p % seq_len)
    return (p - start).view(rows, seq_len), doc.view(rows, seq_len)


def _batch(
    ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, doc_ids: torch.Tensor | None
) -> dict:
    batch = {"input_ids": ids, "labels": labels, "positions": positions}
    if doc_ids is not None:
        batch["doc_ids"] = doc_ids
    batch["num_target_tokens"] = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return batch
