"""How one request is decoded: length limit, stop rule and sampling."""

from __future__ import annotations

from dataclasses import dataclass

from harli_train.engine.engine_config import EngineError


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 is greedy; otherwise softmax(logits / temperature) cut to the `top_k` most likely tokens
    (0: all) and to the top-p nucleus. A request ends at `max_tokens`, at EOS (unless `ignore_eos`) or at one
    of its `stop_token_ids` (the token is kept, as EOS is).

    A request with a `seed` draws the same tokens whatever else shares its batches (the random numbers are
    a hash of seed, position and token id); without one the engine derives a seed from its own and the
    request id.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise EngineError(f"sampling params: max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise EngineError(f"sampling params: temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"sampling params: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineError(f"sampling params: top_k must be >= 0 (0: no cut), got {self.top_k}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
