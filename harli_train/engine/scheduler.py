"""Continuous batching: which sequences run in the next step, and what their results do to them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from harli_train.engine.block_manager import BlockManager
from harli_train.engine.engine_config import EngineConfig
from harli_train.engine.sequence import Sequence, SequenceStatus
from harli_train.engine.step_work import PrefillPiece, ScheduledBatch, StepPreview


class Scheduler:
    """FCFS continuous batching with chunked prefill.

    Mixed (stall-free, `config.mixed_prefill`, the Sarathi-Serve idea): every step gives each decoding
    sequence its next token, and prefill work rides in the same step up to a token budget (chunks of prompts
    already admitted first, then new admissions), so a long prompt never stalls the running requests; only a
    step with nothing to decode is a pure prefill step. Prefill-first (nano-vllm, `mixed_prefill=False`): a
    step is either prefill (new or continuing chunks) or decode.

    Admission needs free blocks for the whole prompt and, with `decode_reserve_tokens`, for the next tokens of
    every running sequence (the new one included; `reach`), unless nothing runs; when a decoding sequence
    needs a block and none is free, the newest sequence is preempted: its blocks are freed and it is
    recomputed later, so the oldest one always progresses."""

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

    def reach(self, seq: Sequence, tokens: int | None = None) -> int:
        """The tokens whose KV slots `seq` is kept room for: those it has (`tokens`, default `len(seq)`) and
        `decode_reserve_tokens` more, never past its last computed token (its last drawn token never is)."""
        tokens = len(seq) if tokens is None else tokens
        last = seq.num_prompt_tokens + seq.params.max_tokens - 1
        return max(tokens, min(tokens + self.config.decode_reserve_tokens, last))

    def _reserved_blocks(self, planned: dict[int, int] | None = None) -> int:
        """Blocks the running sequences still need to `reach` their reserve (0 without one), beyond those they
        hold and those the step being planned gives them (`planned`: id(sequence) -> its tokens after it)."""
        if not self.config.decode_reserve_tokens:
            return 0
        bm, planned = self.block_manager, planned or {}
        total = 0
        for s in self.running:
            if s.status is SequenceStatus.RUNNING:
                tokens = planned.get(id(s), len(s))
                have = max(len(s.block_table), bm.blocks_for(planned.get(id(s), 0)))
                total += max(0, bm.blocks_for(self.reach(s, tokens)) - have)
        return total

    def _decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.status is SequenceStatus.RUNNING and s.pending == 1]

    def _budget(self, num_decode: int, prefill_tokens: int | None) -> int:
        """Prefill tokens a step with `num_decode` decode rows may take (the caller's budget, capped)."""
        cap = self.config.max_num_batched_tokens - num_decode
        if prefill_tokens is None:  # a pure prefill step stalls nothing: it may take the whole cap
            prefill_tokens = self.config.prefill_chunk_tokens if num_decode else cap
        return max(0, min(cap, prefill_tokens))

    def _prefill_plan(
        self,
        budget: int,
        free_blocks: int,
        free_rows: int,
        ahead: dict[int, int] | None = None,
        planned: dict[int, int] | None = None,
    ) -> list[tuple[Sequence, int, bool]]:
        """(sequence, tokens, admitted now) of each prefill piece a step with `budget` prefill tokens takes:
        continuing chunks first, then waiting prompts in order while blocks for the whole prompt (and the
        reserve: the class's rule), a table row and a batch slot are free. Changes nothing: `schedule` applies
        it, `peek` describes it. `ahead` (id(sequence) -> tokens): what a step in flight computes of each of
        its sequences; a chunk continues after them. `planned` (id(sequence) -> tokens): the decode rows'
        lengths after the step, where their blocks are not allocated yet (`free_blocks` is net of them)."""
        plan: list[tuple[Sequence, int, bool]] = []
        ahead = ahead or {}
        for seq in self.running:
            if budget <= 0:
                return plan
            if seq.status is not SequenceStatus.RUNNING:
                continue
            done = ahead.get(id(seq))
            left = seq.pending if done is None else seq.pending - done
            if left > (1 if done is None else 0):  # (one token left and nothing in flight: it decodes)
                n = min(left, budget)
                plan.append((seq, n, False))
                budget -= n
        bm = self.block_manager
        running = len(self.running)
        reserved = self._reserved_blocks(planned)
        for seq in self.waiting:
            if budget <= 0 or running >= self.config.max_num_seqs or free_rows <= 0:
                break
            # Blocks for the whole prompt up front: a chunked prefill that stalled half-way for blocks would
            # hold them while it was re-tried instead of decoding (a livelock).
            need = bm.blocks_needed(seq, len(seq))
            grows = bm.blocks_needed(seq, self.reach(seq)) - need  # its own reserve, after the prompt
            if need > free_blocks or (running and need + grows + reserved > free_blocks):
                break
            n = min(seq.pending, budget)
            plan.append((seq, n, True))
            budget, free_blocks, free_rows, running = (
                budget - n,
                free_blocks - need,
                free_rows - 1,
                running + 1,
            )
            reserved += grows
        return plan

    def schedule(self, prefill_tokens: int | None = None) -> ScheduledBatch | None:
        """The next step. Mixed: every decoding sequence, then prefill pieces up to `prefill_tokens` (None:
        `config.prefill_chunk_tokens`, or up to `max_num_batched_tokens` when nothing decodes). Prefill-first:
        the prefill pieces alone (as many as fit `max_num_batched_tokens`) when there are any, else the decode
        rows."""
        batch = ScheduledBatch(False, [], [])
        if self.config.mixed_prefill:
            self._add_decode(batch)
            self._add_prefill(batch, self._budget(batch.num_decode, prefill_tokens))
        elif not self._add_prefill(batch, self._budget(0, None)):
            self._add_decode(batch)
        return batch if batch.seqs else None

    def _add_decode(self, batch: ScheduledBatch) -> None:
        """Every decoding sequence, one token each (blocks reserved, preempting newer sequences if short)."""
        for seq in self._decoding():
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._reserve(seq, len(seq), batch):
                batch.seqs.append(seq)
                batch.num_tokens.append(1)
        batch.num_decode = len(batch.seqs)

    def _add_prefill(self, batch: ScheduledBatch, budget: int) -> bool:
        """Append the prefill pieces of `_prefill_plan` (admitting waiting prompts);
        whether there were any."""
        bm = self.block_manager
        return self._apply_prefill(batch, self._prefill_plan(budget, bm.num_free, len(bm.free_rows)))

    def _apply_prefill(self, batch: ScheduledBatch, plan: list[tuple[Sequence, int, bool]]) -> bool:
        """Append the pieces of `plan` (a `_prefill_plan` made against the blocks and rows free now),
        admitting its waiting prompts; whether there were any."""
        bm = self.block_manager
        for seq, n, admit in plan:
            if admit:
                self.waiting.remove(seq)
                bm.allocate(seq, len(seq))
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
        batch.is_prefill = batch.is_prefill or bool(plan)
        return bool(plan)

    def peek(self, now: float | None = None, after: ScheduledBatch | None = None) -> StepPreview:
        """The step `schedule()` would make now, changing nothing (see `StepPreview`); with `now` (the clock
        of the sequences' arrival times), how long each request with prefill pending has waited. With
        `after` (a step launched, its tokens not read yet): the step after it, as `schedule_ahead` would
        make it."""
        bm = self.block_manager
        mixed = self.config.mixed_prefill
        if after is None:
            ahead, decoding, kv = None, self._decoding(), 0
        else:
            ahead, decoding, kv = self._after(after), self._continuing(after), 1  # each one token further
        need = sum(bm.blocks_needed(s, len(s) + kv) for s in decoding) if mixed else 0
        budget = self._budget(len(decoding) if mixed else 0, self.config.max_num_batched_tokens)
        planned = {id(s): len(s) + kv for s in decoding} if mixed else None
        plan = self._prefill_plan(budget, max(bm.num_free - need, 0), len(bm.free_rows), ahead, planned)
        done = ahead or {}
        pieces = tuple(
            PrefillPiece(
                n, s.num_computed + done.get(id(s), 0), s.pending - done.get(id(s), 0) - n, s.lora_slot
            )
            for s, n, _ in plan
        )
        adapters = frozenset(s.lora_slot for s in decoding) - {0}
        waits = () if now is None else tuple(now - s.arrival_time for s, _, _ in plan)
        kv_tokens = sum(len(s) + kv for s in decoding)
        return StepPreview(len(decoding), kv_tokens, pieces, mixed, adapters, waits)

    @staticmethod
    def _after(batch: ScheduledBatch) -> dict[int, int]:
        """id(sequence) -> the tokens `batch` (launched, its tokens not read) computes of it: each of its rows
        starts where the host's sequence stands (`schedule_ahead` keeps it so)."""
        return {id(s): n for s, n in zip(batch.seqs, batch.num_tokens, strict=True)}

    @staticmethod
    def _continuing(batch: ScheduledBatch) -> list[Sequence]:
        """The sequences that decode in the step after `batch`: those that draw a token in it (decode rows,
        prompts it finishes) and that token does not end by length."""
        return [
            s
            for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
            if s.status is SequenceStatus.RUNNING
            and n == s.pending
            and s.num_completion_tokens + 1 < s.params.max_tokens
        ]

    def schedule_ahead(
        self,
        batch: ScheduledBatch,
        prefill_tokens: int | None = None,
        launchable: Callable[[int, int], bool] | None = None,
    ) -> ScheduledBatch | None:
        """The step after `batch`, a step whose tokens are not known yet: every sequence that draws a token
        in it and goes on (not ended, by that token's length), each one token further (blocks allocated for
        that token, its input the token drawn); with mixed prefill also the prefill pieces
        `schedule(prefill_tokens)` would add (a chunk `batch` leaves unfinished continues after it, waiting
        prompts are admitted while blocks, rows and batch slots are free: those of the sequences `batch`
        ends are not free yet). Its `ahead` says, per row, what `batch` computes before it.
        None when `schedule()` could pick differently once the tokens are known: prefill-first, after a
        prefill step, with a chunk continuing or a prompt to admit; or blocks are short (a preemption); or
        it has prefill pieces and `launchable(tokens, rows)` says a step of its shape may not be launched
        ahead (nothing is changed then)."""
        bm = self.block_manager
        mixed = self.config.mixed_prefill
        if not mixed:
            if batch.is_prefill or any(
                s.status is SequenceStatus.RUNNING and s.pending > 1 for s in self.running
            ):
                return None
            if self.waiting and len(self.running) < self.config.max_num_seqs:
                if bm.can_allocate(self.waiting[0], len(self.waiting[0])):
                    return None
        seqs = self._continuing(batch)
        need = sum(bm.blocks_needed(s, len(s) + 1) for s in seqs)
        if need > bm.num_free:
            return None
        computed = self._after(batch)
        plan: list[tuple[Sequence, int, bool]] = []  # against the blocks the decode rows leave free
        if mixed:
            budget = self._budget(len(seqs), prefill_tokens)
            planned = {id(s): len(s) + 1 for s in seqs}
            plan = self._prefill_plan(budget, bm.num_free - need, len(bm.free_rows), computed, planned)
            tokens = len(seqs) + sum(n for _, n, _ in plan)
            if plan and launchable is not None and not launchable(tokens, len(seqs) + len(plan)):
                return None
        for seq in seqs:
            bm.allocate(seq, len(seq) + 1)
        out = ScheduledBatch(False, seqs, [1] * len(seqs), num_decode=len(seqs))
        self._apply_prefill(out, plan)
        if not out.seqs:
            return None
        out.ahead = [computed.get(id(s), 0) for s in out.seqs]
        return out

    def abort_all(self, now: float | None = None) -> list[Sequence]:
        """Drop every waiting and running sequence (their blocks are freed, finish_reason 'aborted', finish
        time `now`); returns them."""
        dropped = [*self.running, *self.waiting]
        for seq in dropped:
            self.block_manager.free(seq)
            seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, "aborted", now
        self.running.clear()
        self.waiting.clear()
        return dropped

    def abort(self, seq: Sequence, now: float | None = None) -> bool:
        """Drop one waiting or running sequence (its blocks freed, finish_reason 'aborted'); False when it
        had already finished."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return False
        self.block_manager.free(seq)
        seq.status, seq.finish_reason, seq.finish_time = SequenceStatus.FINISHED, "aborted", now
        return True

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
            seq.token_times.append(now)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if not seq.params.ignore_eos and token in self.eos_ids:
                seq.finish_reason = "eos"
            elif token in seq.params.stop_token_ids:
                seq.finish_reason = "stop"
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
