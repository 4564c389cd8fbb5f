"""Continuous batching: which sequences run in the next step, and what their results do to them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from harli_train.engine.block_manager import BlockManager
from harli_train.engine.engine_config import EngineConfig
from harli_train.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: `num_tokens[i]` new tokens of `seqs[i]` (a prefill chunk, or 1 when decoding)."""

    is_prefill: bool
    seqs: list[Sequence]
    num_tokens: list[int]
    preempted: list[Sequence] = field(default_factory=list)

    def samples(self, i: int) -> bool:
        """Whether seqs[i] draws a token this step: all its tokens are computed once this step is done."""
        return self.num_tokens[i] == self.seqs[i].pending


class Scheduler:
    """FCFS with prefill first (nano-vllm): a step is either prefill (new or continuing chunks, packed up to
    `max_num_batched_tokens`) or decode (every running sequence). Admission needs free blocks for the whole
    prompt; when a decoding sequence needs a block and none is free, the newest sequence is preempted: its
    blocks are freed and it is recomputed later, so the oldest one always progresses."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_ids: set[int]):
        self.config = config
        self.block_manager = block_manager
        self.eos_ids = eos_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch(True, [], [])
        # Chunked prefills already running continue first, then waiting sequences are admitted.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING and seq.pending > 1:
                n = min(seq.pending, budget)
                if self._reserve(seq, seq.num_computed + n, batch):
                    batch.seqs.append(seq)
                    batch.num_tokens.append(n)
                    budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # Blocks for the whole prompt up front: a chunked prefill that stalled half-way for blocks would
            # hold them while prefill-first scheduling kept re-trying it instead of decoding (a livelock).
            if not self.block_manager.can_allocate(seq, len(seq)):
                break
            n = min(seq.pending, budget)
            self.waiting.popleft()
            self.block_manager.allocate(seq, len(seq))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        if batch.seqs:
            return batch
        batch.is_prefill = False
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.pending != 1:
                continue  # preempted earlier in this loop
            if self._reserve(seq, len(seq), batch):
                batch.seqs.append(seq)
                batch.num_tokens.append(1)
        return batch if batch.seqs else None

    def schedule_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after `batch`, a decode step whose tokens are not known yet: the same sequences,
        less those that have ended (`batch` itself may have been launched ahead) or that its token ends by
        length, each one token further (blocks allocated for that token).
        None when `schedule()` could pick differently once the tokens are known: a waiting request would be
        admitted, or blocks are short (a preemption)."""
        bm = self.block_manager
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            if bm.can_allocate(self.waiting[0], len(self.waiting[0])):
                return None
        seqs = [
            s
            for s in batch.seqs
            if s.status is SequenceStatus.RUNNING and s.num_completion_tokens + 1 < s.params.max_tokens
        ]
        if not seqs or sum(bm.blocks_needed(s, len(s) + 1) for s in seqs) > bm.num_free:
            return None
        for seq in seqs:
            bm.allocate(seq, len(seq) + 1)
        return ScheduledBatch(False, seqs, [1] * len(seqs))

    def _prefill_chunk(self) -> list[tuple[Sequence, int, int]]:
        """(sequence, tokens computed, its KV tokens after) of each sequence the next prefill step would
        compute, as `schedule()` would admit them, changing nothing."""
        budget, chunk = self.config.max_num_batched_tokens, []
        for seq in self.running:
            if seq.pending > 1 and budget > 0:
                n = min(seq.pending, budget)
                chunk.append((seq, n, seq.num_computed + n))
                budget -= n
        free, rows = self.block_manager.num_free, len(self.block_manager.free_rows)
        admitted = 0
        for seq in self.waiting:
            need = self.block_manager.blocks_needed(seq, len(seq))
            full = len(self.running) + admitted >= self.config.max_num_seqs
            if budget == 0 or full or need > free or rows == 0:
                break
            n = min(seq.pending, budget)
            chunk.append((seq, n, n))
            admitted, budget = admitted + 1, budget - n
            free, rows = free - need, rows - 1
        return chunk

    def peek(self) -> tuple[str, int, int]:
        """(kind, sequences, KV tokens after it) of the step `schedule()` would make now, changing nothing.
        kind is "prefill", "decode" or "idle"; preemptions a decode step may need are not foreseen."""
        chunk = self._prefill_chunk()
        if chunk:
            return "prefill", len(chunk), sum(kv for _, _, kv in chunk)
        decoding = [s for s in self.running if s.pending == 1]
        if not decoding:
            return "idle", 0, 0
        return "decode", len(decoding), sum(len(s) for s in decoding)

    def peek_decode_after(self) -> tuple[int, int]:
        """(sequences, KV tokens) of the decode step after the prefill `peek()` describes: the sequences
        decoding now and those whose prompts it finishes (each with its first sampled token, or its last prompt
        token left for the decode step when a chunk ends there); the decode step
        `peek()` describes when there is no prefill. What a controller sizes a prefill's neighbours from: the
        batch usually jumps when prompts join."""
        decoding = [s for s in self.running if s.pending == 1]
        batch, kv_tokens = len(decoding), sum(len(s) for s in decoding)
        for seq, n, _ in self._prefill_chunk():
            if n >= seq.pending - 1:  # all but its last token (then computed by a decode step) or all of it
                batch, kv_tokens = batch + 1, kv_tokens + len(seq) + (n == seq.pending)
        return batch, kv_tokens

    def abort_all(self) -> list[Sequence]:
        """Drop every waiting and running sequence (their blocks are freed); returns them."""
        dropped = [*self.running, *self.waiting]
        for seq in dropped:
            self.block_manager.free(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "aborted"
        self.running.clear()
        self.waiting.clear()
        return dropped

    def _reserve(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Blocks for `seq`'s first `num_tokens` tokens, preempting newer unscheduled sequences if needed;
        False when `seq` itself had to be preempted."""
        bm = self.block_manager
        while not bm.can_allocate(seq, num_tokens):
            newer = self.running[self.running.index(seq) + 1 :]
            victims = [s for s in newer if s not in batch.seqs]
            self._preempt(victims[-1] if victims else seq, batch)
            if not victims:
                return False
        bm.allocate(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None], now: float) -> list[Sequence]:
        """Advance each sequence by its computed tokens, append drawn tokens, finish on EOS or length."""
        finished = []
        for seq, n, token in zip(batch.seqs, batch.num_tokens, sampled, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # it ended in the step before this one, which was launched ahead of its tokens
            seq.num_computed += n
            if token is None:
                continue
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if not seq.params.ignore_eos and token in self.eos_ids:
                seq.finish_reason = "eos"
            elif seq.num_completion_tokens >= seq.params.max_tokens:
                seq.finish_reason = "length"
            else:
                continue
            seq.status = SequenceStatus.FINISHED
            seq.finish_time = now
            self.block_manager.free(seq)
            self.running.remove(seq)
            finished.append(seq)
        return finished
