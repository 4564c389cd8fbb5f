"""The runtime's view of the decode engine: partitions keyed by their inference stream, and the load.

The runtime speaks in ladder partitions; the engine in partition keys, each with its own stream and decode
graphs. This adapter maps one to the other, turns trace requests into engine requests, and is the one place
to change when the engine's interface does.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from harli_train.colocate.sm import Partition, is_cuda_stream
from harli_train.engine import DecodeEngine, EngineMetrics, RequestRefused, SamplingParams, StepResult
from harli_train.engine.adapters import AdapterCatalog
from harli_train.engine.load import TraceRequest, synthetic_prompt
from harli_train.engine.runner import DEFAULT_PARTITION
from harli_train.engine.sequence import Sequence
from harli_train.engine.step_work import StepPreview

log = logging.getLogger(__name__)


class EngineAdapter:
    """Wraps a ``DecodeEngine``: partitions keyed by their inference stream, requests, peek, step, profile."""

    def __init__(
        self, engine: DecodeEngine, full: Partition, seed: int = 0, catalog: AdapterCatalog | None = None
    ) -> None:
        # The engine was built with `full`'s inference stream as its default partition; `catalog` resolves
        # the model ids trace requests name (None: every request runs on the base).
        self.engine, self.seed, self.catalog = engine, seed, catalog
        self.vocab_size = engine.model.config.vocab_size
        self._keys: dict[int, str] = {id(full.infer_stream): DEFAULT_PARTITION}
        self._warm: set[str] = set()
        self._prompts: dict[int, np.ndarray] = {}  # id(request) -> its synthetic prompt, made ahead

    # ---- partitions ----------------------------------------------------------------------------------
    def register(self, partitions: Iterable[Partition]) -> None:
        """Prepare a step (and its decode graphs, on a GPU) on each partition's inference stream."""
        for p in partitions:
            if id(p.infer_stream) in self._keys:
                continue
            key = f"sms{p.infer_sms}-{len(self._keys)}"
            stream = p.infer_stream if is_cuda_stream(p.infer_stream) else None
            self.engine.add_partition(key, stream, p.infer_sms)
            self._keys[id(p.infer_stream)] = key

    def warm_up(self, partitions: Iterable[Partition]) -> float:
        """Compile the prefill path on each partition not warmed yet (GPU only: a compile inside a served
        prefill would stall decoding for a second or more); returns the seconds it took."""
        if self.engine.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        for p in partitions:
            key = self.key(p)
            if key not in self._warm:
                self.engine.warm_up(partition=key)
                self._warm.add(key)
        return time.perf_counter() - t0

    def key(self, partition: Partition) -> str:
        return self._keys[id(partition.infer_stream)]

    @property
    def kv_bytes_per_token(self) -> int:
        return self.engine.storage.spec.bytes_per_token

    # ---- load ----------------------------------------------------------------------------------------
    def prepare(self, requests: Iterable[TraceRequest]) -> None:
        """Make the synthetic prompts of `requests` now, before serving: a load generator's work, which
        `submit` would otherwise do between decode steps (~0.2 ms a 1.5k-token prompt, a few at once in a
        burst), where every running request's token interval would count it."""
        for r in requests:
            if r.prompt is None:
                self._prompts[id(r)] = np.asarray(self._synthetic(r), dtype=np.int64)

    def _synthetic(self, request: TraceRequest) -> list[int]:
        salt = zlib.crc32(str(request.request_id).encode())
        return synthetic_prompt(request.prompt_len, self.vocab_size, self.seed + salt)

    def submit(self, request: TraceRequest, arrival_time: float, ignore_eos: bool = True) -> bool:
        """Queue a trace request (a synthetic prompt when it only gives a length, made by `prepare` or
        now) on the model it names; False if refused."""
        prompt: str | list[int]
        if request.prompt is not None:
            prompt = request.prompt
        else:
            made = self._prompts.pop(id(request), None)
            prompt = made.tolist() if made is not None else self._synthetic(request)
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=ignore_eos, seed=self.seed)
        slot = self.catalog.slot(request.model) if self.catalog is not None else 0
        try:
            self.engine.add_request(
                prompt, params, request_id=request.request_id, arrival_time=arrival_time, lora_slot=slot
            )
        except RequestRefused as e:
            log.warning("%s", e)
            return False  # recorded in the engine's metrics
        return True

    def add_request(
        self, prompt, params: SamplingParams, request_id: str, arrival_time: float, lora_slot: int = 0
    ) -> Sequence:
        """Queue a client's request as it came (HTTP), on adapter slot `lora_slot`: RequestRefused when it
        can never run here."""
        return self.engine.add_request(
            prompt, params, request_id=request_id, arrival_time=arrival_time, lora_slot=lora_slot
        )

    def abort(self, seq: Sequence) -> bool:
        """Drop one request now (its client went away); False when it had already finished."""
        return self.engine.abort(seq)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def scheduler(self):
        """The engine's scheduler, read for its queue lengths (waiting, running)."""
        return self.engine.scheduler

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def peek(self) -> StepPreview:
        """The step ``step()`` would run now: its decode rows and the prefill work that may ride with them."""
        return self.engine.peek()

    def running(self) -> list[Sequence]:
        """The requests admitted and not finished (decoding or mid-prefill)."""
        return list(self.engine.scheduler.running)

    def waiting(self) -> list[Sequence]:
        """The requests queued, not yet admitted."""
        return list(self.engine.scheduler.waiting)

    def now(self) -> float:
        """The engine's clock (arrival and token times are on it)."""
        return self.engine.clock()

    def step(
        self, partition: Partition, prefill_tokens: int | None = None, ahead: bool = False
    ) -> StepResult:
        """One engine step on ``partition`` with at most ``prefill_tokens`` prefill tokens riding along; a
        step launched ahead by the call before completes instead, where it was launched. ``ahead``: the step's
        successor is launched on ``partition`` before its tokens are read (``in_flight`` then)."""
        return self.engine.step(self.key(partition), prefill_tokens, ahead)

    @property
    def mixed_prefill(self) -> bool:
        """Whether prefill chunks ride in decode steps (else prefill steps of their own come first)."""
        return self.engine.config.mixed_prefill

    @property
    def in_flight(self) -> str | None:
        """The kind of the step launched ahead that the next ``step`` completes (None: none)."""
        return self.engine.in_flight

    def last_step_event(self) -> Any:
        """An event past every step launched so far (None on a CPU)."""
        return self.engine.last_step_event()

    def wait_before_next(self, event: Any) -> None:
        """The next step launched waits on the GPU for ``event`` (`DecodeEngine.wait_before_next`)."""
        self.engine.wait_before_next(event)

    def close(self) -> None:
        """Release the engine's GPU resources (graphs, staging buffers); see ``DecodeEngine.close``."""
        self.engine.close()

    def abort_all(self) -> int:
        """Drop every queued and running request (their KV blocks are freed), recording each with the tokens
        it drew (a window's end: what its client saw counts); returns how many."""
        return self.engine.abort_all(record=True)

    def reset_metrics(self) -> None:
        self.engine.reset_metrics()

    @property
    def metrics(self) -> EngineMetrics:
        return self.engine.metrics

    def synthetic_decode(self, batch: int, kv_len: int, partition: Partition, lora_slots: int = 0) -> None:
        """One decode step of ``batch`` sequences with ``kv_len`` cached tokens each on ``partition``, its
        rows on ``lora_slots`` adapters, for profiling (launched, not waited for, on a GPU)."""
        self.engine.synthetic_decode(batch, kv_len, self.key(partition), lora_slots)

    def synthetic_mixed(
        self,
        batch: int,
        kv_len: int,
        prefill_tokens: int,
        prefill_context: int,
        partition: Partition,
        lora_slots: int = 0,
    ) -> None:
        """One mixed step (``batch`` decode rows over ``kv_len`` tokens, a prefill chunk of ``prefill_tokens``
        after ``prefill_context``, the rows on ``lora_slots`` adapters) on ``partition``, for profiling
        (launched, not waited for, on a GPU)."""
        self.engine.synthetic_mixed(
            batch, kv_len, prefill_tokens, prefill_context, self.key(partition), lora_slots
        )
