"""One request's state inside the engine: its tokens, its KV blocks and its timestamps."""

from __future__ import annotations

from enum import Enum, auto

from harli_train.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request: prompt plus generated tokens.

    `num_computed` tokens have their K/V in the cache; a step computes the next `pending` tokens (a prefill
    chunk, or the one newest token when decoding) and samples a token once nothing is pending. A preempted
    sequence drops its blocks (num_computed = 0) and is recomputed, generated tokens included, on return.
    """

    def __init__(
        self,
        seq_id: int,
        token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        request_id: str | None = None,
        lora_slot: int = 0,
    ):
        self.seq_id = seq_id
        self.request_id = request_id if request_id is not None else str(seq_id)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.lora_slot = lora_slot  # the adapter slot the request runs on, for all its steps (0: the base)
        self.status = SequenceStatus.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        self.row = -1  # row of the block manager's table while the sequence holds blocks
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.token_times: list[float] = []  # when each generated token was drawn (the client's clock)
        self.finish_time: float | None = None
        self.finish_reason: str | None = None  # "eos", "length", "refused"
        self.error: str | None = None  # why a refused request was refused
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={len(self)}, "
            f"computed={self.num_computed}, blocks={len(self.block_table)})"
        )

    @property
    def pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
