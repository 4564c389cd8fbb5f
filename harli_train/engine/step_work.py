"""What one engine step computes: the batch the scheduler made (``ScheduledBatch``), and the step it would
make now (``StepPreview``, with the prompt chunks waiting as ``PrefillPiece``s), which the co-location
policies plan from without changing the scheduler's state."""

from __future__ import annotations

from dataclasses import dataclass, field

from harli_train.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: `num_tokens[i]` new tokens of `seqs[i]`. The first `num_decode` rows are decoding
    sequences (one token each); the rest are prefill pieces (a prompt's chunk). `is_prefill` steps (any
    prefill piece) run through the varlen path; pure decode steps replay the decode graphs."""

    is_prefill: bool
    seqs: list[Sequence]
    num_tokens: list[int]
    preempted: list[Sequence] = field(default_factory=list)
    num_decode: int = 0
    # A step launched ahead (`Scheduler.schedule_ahead`): per row, the tokens of its sequence the step in
    # flight before it computes, which the host does not know are computed yet (None: none).
    ahead: list[int] | None = None

    def ahead_of(self, i: int) -> int:
        """The tokens of seqs[i] computed by the step in flight before this one (0 unless launched ahead)."""
        return 0 if self.ahead is None else self.ahead[i]

    def samples(self, i: int) -> bool:
        """Whether seqs[i] draws a token this step: a decode row always, a prefill piece once all its tokens
        are computed."""
        return i < self.num_decode or self.num_tokens[i] == self.seqs[i].pending - self.ahead_of(i)

    @property
    def kind(self) -> str:
        """ "decode" (decode rows only), "mixed" (decode rows and prefill pieces) or "prefill"."""
        if not self.is_prefill:
            return "decode"
        return "mixed" if self.num_decode else "prefill"

    @property
    def prefill_tokens(self) -> int:
        return sum(self.num_tokens[self.num_decode :])


@dataclass(frozen=True, slots=True)
class PrefillPiece:
    """Part of a prompt a step would compute: `tokens` new tokens after `context` cached ones, `left` still
    pending after it (0: the sequence draws its first token in that step), on adapter slot `lora_slot` (0:
    the base)."""

    tokens: int
    context: int
    left: int
    lora_slot: int = 0


@dataclass(frozen=True, slots=True)
class StepPreview:
    """The step `schedule()` would make now, changing nothing (preemptions are not foreseen).

    `decode_seqs` sequences decode one token each, reading `decode_kv_tokens` cached tokens (the new ones
    included); `pieces` is the prefill work waiting, in the order `schedule()` takes it, before any prefill
    budget cuts it (at most `max_num_batched_tokens` with the decode rows). `mixed`: the pieces ride in the
    decode step; otherwise they run first, in a prefill step of their own."""

    decode_seqs: int = 0
    decode_kv_tokens: int = 0
    pieces: tuple[PrefillPiece, ...] = ()
    mixed: bool = False
    decode_adapters: frozenset[int] = frozenset()  # the decode rows' adapter slots (0 left out)
    prefill_waits: tuple[float, ...] = ()  # how long each piece's request has waited (peek's `now` given)

    @property
    def lora_slots(self) -> int:
        """Distinct adapters the decode rows run on (0: the base only)."""
        return len(self.decode_adapters)

    @property
    def prefill_wait_s(self) -> float | None:
        """How long the first piece's request has waited (None: no wait known, or nothing pending)."""
        return self.prefill_waits[0] if self.prefill_waits else None

    @property
    def prefill_tokens(self) -> int:
        return sum(p.tokens for p in self.pieces)

    @property
    def kind(self) -> str:
        """ "idle", "decode", "mixed" or "prefill": the kind of the step `schedule()` would make."""
        if self.pieces:
            return "mixed" if self.mixed and self.decode_seqs else "prefill"
        return "decode" if self.decode_seqs else "idle"

    def take(self, budget: int | None) -> tuple[PrefillPiece, ...]:
        """The pieces a step with a prefill budget of `budget` tokens computes
        (the last one cut; None: all)."""
        if budget is None:
            return self.pieces
        out, room = [], budget
        for p in self.pieces:
            if room <= 0:
                break
            n = min(p.tokens, room)
            out.append(PrefillPiece(n, p.context, p.left + p.tokens - n, p.lora_slot))
            room -= n
        return tuple(out)

    def adapters(self, budget: int | None = None) -> int:
        """Distinct adapters a step with a prefill budget of `budget` tokens runs: the decode rows' and
        those of the chunks it takes."""
        if not any(p.lora_slot for p in self.pieces):  # the common case: no prompt on an adapter
            return len(self.decode_adapters)
        return len(self.decode_adapters | ({p.lora_slot for p in self.take(budget)} - {0}))

    def decode_after(self, budget: int | None = None) -> tuple[int, int]:
        """(sequences, KV tokens) of the decode step after this one with a prefill budget of `budget`: the
        decode rows one token further (unless this is a prefill-first step, which they wait out), and each
        prompt this step finishes or leaves one token short of its end (that token is then decoded)."""
        batch = self.decode_seqs
        kv = self.decode_kv_tokens + (self.decode_seqs if self.kind != "prefill" else 0)
        for p in self.take(budget):
            if p.left <= 1:
                batch, kv = batch + 1, kv + p.context + p.tokens + 1
        return batch, kv
