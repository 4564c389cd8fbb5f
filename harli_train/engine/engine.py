"""The decode engine: requests in, one scheduled step at a time, tokens out."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from harli_train.data.tokenization import prompt_ids
from harli_train.engine.block_manager import BlockManager
from harli_train.engine.engine_config import EngineConfig, EngineError, capped_to_context
from harli_train.engine.kv_cache import KVCacheSpec, KVStorage, TensorKVStorage, kv_cache_blocks
from harli_train.engine.metrics import EngineMetrics, StepRecord
from harli_train.engine.runner import DEFAULT_PARTITION, LaunchedStep, ModelRunner
from harli_train.engine.sampling_params import SamplingParams
from harli_train.engine.scheduler import Scheduler
from harli_train.engine.sequence import Sequence, SequenceStatus
from harli_train.engine.step_result import RequestRefused, StepResult
from harli_train.engine.step_work import StepPreview
from harli_train.engine.warm_up import WARMUP_PROMPT_LENS, warm_up_prefill
from harli_train.model import LlamaForCausalLM

log = logging.getLogger(__name__)


def _eos_ids(model: LlamaForCausalLM) -> set[int]:
    """The tokens that end a request: the model's EOS ids (config.json's and generation_config.json's)."""
    eos = model.config.eos_token_id
    return set() if eos is None else set(eos) if isinstance(eos, (list, tuple)) else {eos}


class DecodeEngine:
    """Serves `model` (frozen, no adapter attached) from a paged KV cache with continuous batching.

    With `config.max_loras` it also serves adapters, unmerged: `load_lora` puts one in a slot, a request
    names its slot (`add_request(lora_slot=...)`) and keeps it to its end; one step batches rows of any
    slots (the base's included). The engine adds forward hooks to `model`'s projections for that.

    Drive it with `add_request` + `step()` (one prefill or decode step per call, on the partition named),
    or `generate()` / `run_until_done()`. `stream` is where steps run (a green-context stream for a partial
    GPU); `add_partition` registers more streams, each with its own decode graphs.

    With `config.overlap` a decode step's successor is launched before its tokens are read back, so the
    host's bookkeeping runs while the GPU computes: each `step()` call still completes exactly one step and
    leaves at most one launched. The successor is the step the scheduler would pick then, up to what the
    host cannot know yet (`Scheduler.schedule_ahead`): its decode rows are the sequences that draw a token
    in the step, one token further; with mixed prefill, chunks continue past what the step computes and
    prompts waiting are admitted (against the blocks free before the step's enders free theirs). Prefill-
    first, only decode steps follow decode steps. A sequence that its token ends by EOS rides the successor
    once more and that token is dropped. `peek` then previews the step after the one in flight.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
        num_sms: int | None = None,
        storage: KVStorage | None = None,
        tokenizer=None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.model, self.tokenizer, self.clock = model, tokenizer, clock
        self.context = model.config.max_position_embeddings
        self.config = cfg = capped_to_context(config or EngineConfig(), self.context)
        if any(m.has_lora for m in model.lora_modules().values()):
            raise EngineError(
                "the engine serves the base model: pass a model object with no LoRA adapter "
                "attached (it may share its weight tensors with the trainer's)"
            )
        self.device = model.lm_head.weight.device
        on_gpu = self.device.type == "cuda"
        # As in harli_train.kernels: "auto" is Triton on a GPU and the torch reference on the CPU, where the
        # interpreter would be slow; "triton" on the CPU needs TRITON_INTERPRET=1.
        self.use_triton = cfg.kernels == "triton" or (cfg.kernels == "auto" and on_gpu)
        if on_gpu and not self.use_triton and not cfg.enforce_eager:
            raise EngineError("engine config: kernels='torch' on a GPU needs enforce_eager=True (no graphs)")
        spec = KVCacheSpec.for_model(model.config, cfg.block_size, model.lm_head.weight.dtype)
        if storage is None:
            storage = TensorKVStorage(spec, kv_cache_blocks(model, cfg, spec), self.device)
        self.storage = storage
        self.block_manager = BlockManager(
            storage.num_blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_blocks_per_seq
        )
        self.scheduler = Scheduler(cfg, self.block_manager, _eos_ids(model))
        self.runner = ModelRunner(model, cfg, self.block_manager, storage, self.use_triton, seed=cfg.seed)
        self.lora = self.runner.lora  # the adapter slots (None without max_loras)
        self.runner.add_partition(DEFAULT_PARTITION, stream, num_sms)
        self.overlap = self.runner.use_graphs if cfg.overlap is None else cfg.overlap
        self._inflight: LaunchedStep | None = None  # launched ahead, not completed yet
        # Entered around each step's wait for its tokens: the co-location runtime opens its host-priority gate
        # there (harli_train.colocate.host_priority).
        self.host_yield: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.num_launched_ahead = 0  # decode steps launched before their predecessor's tokens were read
        # The most blocks the cache could hold (a pooled cache that other tenants can give pages to: the
        # co-located page pool sets it); None: the storage's `max_blocks`, or the blocks it has.
        self.kv_capacity: Callable[[], int] | None = None
        self.kv_refusals = 0  # requests refused because the whole cache could not hold them
        self.closed = False
        self.metrics = EngineMetrics(clock())
        self._next_id = 0
        log.info(
            "decode engine: %d KV blocks of %d tokens (%.2f GiB), %s kernels, %s%s",
            storage.num_blocks,
            cfg.block_size,
            storage.num_blocks * spec.bytes_per_block / 2**30,
            "triton" if self.use_triton else "torch",
            "CUDA graphs" if self.runner.use_graphs else "eager",
            ", overlapped decode" if self.overlap else "",
        )

    def add_partition(self, key: str, stream: torch.cuda.Stream | None, num_sms: int | None = None) -> None:
        """Make `step(partition=key)` run on `stream` (`num_sms` SMs); captures that partition's graphs."""
        self.runner.add_partition(key, stream, num_sms)

    def grow_kv_blocks(self, num_blocks: int) -> None:
        """The storage now holds `num_blocks` blocks (it mapped more pages): hand the new ones out."""
        self.block_manager.grow(num_blocks)

    def shrink_kv_blocks(self, num_blocks: int) -> bool:
        """Stop using blocks >= `num_blocks` so the storage may unmap them; False (nothing changed) when one
        of them holds a live sequence's K/V. Call between steps, before unmapping."""
        if self._inflight is not None:
            self._inflight.wait()  # it may still write K/V of a sequence that ended into freed blocks
        return self.block_manager.shrink(num_blocks)

    # ---- requests -----------------------------------------------------------------------------------------
    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineError("a text prompt needs an engine built with a tokenizer (or pass token ids)")
            return prompt_ids(self.tokenizer, prompt)
        return [int(t) for t in prompt]

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        lora_slot: int = 0,
    ) -> Sequence:
        """Queue a request: token ids, or a text that the engine's tokenizer encodes as a prompt
        (`harli_train.data.tokenization.prompt_ids`: with the tokenizer's own special tokens), on adapter
        slot `lora_slot` (0: the base; EngineError for a slot that holds no adapter). Raises
        RequestRefused (others are untouched, the refusal is recorded in the metrics) if it could never run
        here: longer than `max_model_len` (at most the model's context) or than the whole KV cache."""
        params = params or SamplingParams()
        if lora_slot and (
            self.lora is None or not 0 < lora_slot < self.lora.num_slots or not self.lora.ranks[lora_slot]
        ):
            raise EngineError(f"adapter slot {lora_slot} holds no adapter (load one with load_lora first)")
        ids = self._encode(prompt)
        seq = Sequence(
            self._next_id,
            ids,
            params,
            self.clock() if arrival_time is None else arrival_time,
            request_id,
            lora_slot,
        )
        self._next_id += 1
        problem = self._refusal(seq)
        if problem is not None:
            seq.status, seq.finish_reason, seq.error = SequenceStatus.FINISHED, "refused", problem
            seq.finish_time = self.clock()
            self.metrics.add_finished(seq)
            raise RequestRefused(problem, seq)
        self.scheduler.add(seq)
        return seq

    def _refusal(self, seq: Sequence) -> str | None:
        cfg, n, m = self.config, seq.num_prompt_tokens, seq.params.max_tokens
        where = f"request {seq.request_id} refused"
        if n == 0:
            return f"{where}: the prompt is empty"
        if n + m > cfg.max_model_len:
            limit = f"max_model_len {cfg.max_model_len}"
            if cfg.max_model_len == self.context:
                limit = f"the model's context of {self.context} tokens (max_position_embeddings)"
            return f"{where}: its prompt of {n} tokens + max_tokens {m} = {n + m} exceeds {limit}"
        need = self.block_manager.blocks_for(n + m - 1)  # the last drawn token is never cached
        # A pooled cache can grow (to max_blocks, or as far as its pool lets it); only a request beyond
        # that cannot run.
        ceiling = self.kv_capacity() if self.kv_capacity else getattr(self.storage, "max_blocks", 0)
        capacity = max(self.block_manager.num_blocks, ceiling)
        if need > capacity:
            self.kv_refusals += 1
            return (
                f"{where}: it needs {need} KV blocks ({n + m - 1} tokens, {cfg.block_size} per block) "
                f"but the whole cache has {capacity}"
            )
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- adapters -----------------------------------------------------------------------------------------
    def slot_busy(self, slot: int) -> bool:
        """Whether a queued or running request runs on adapter slot `slot` (its weights must stay)."""
        sched = self.scheduler
        return any(s.lora_slot == slot for s in (*sched.waiting, *sched.running))

    def load_lora(self, slot: int, pairs, rank: int, scale: float) -> None:
        """Put an adapter in `slot` (1..max_loras): `pairs` maps module paths to (A [r, in], B [out, r]),
        `scale` is its alpha / r. EngineError when the slot is in use or the adapter does not fit. Waits for
        the steps in flight (one of them may read the slot's old weights), so call it between steps."""
        if self.lora is None:
            raise EngineError("this engine has no adapter slots (engine config max_loras is 0)")
        if self.slot_busy(slot):
            raise EngineError(f"adapter slot {slot} is in use by running requests")
        try:
            self.lora.check_fits(slot, rank)
        except ValueError as err:
            raise EngineError(str(err)) from None
        self.quiesce()
        self.lora.write(slot, pairs, rank, scale)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # in place before any later step reads it

    def last_step_event(self) -> torch.cuda.Event | None:
        """An event past every step launched so far (None on a CPU): what a writer of a slot waits for."""
        return self.runner.last_event()

    def wait_before_next(self, event: torch.cuda.Event | None) -> None:
        """The next step launched (by this call's `step` or a later one) starts on the GPU only once
        ``event``, recorded on another stream, is reached (None: nothing to wait for)."""
        self.runner.wait_before_next(event)

    @property
    def in_flight(self) -> str | None:
        """The kind ("decode" or "mixed") of the step launched ahead that the next `step()` completes; None
        when there is none."""
        return None if self._inflight is None else self._inflight.batch.kind

    def quiesce(self) -> None:
        """Wait until no launched step is running on the device (the slots may then be written)."""
        if self._inflight is not None:
            self._inflight.wait()
        event = self.runner.last_event()
        if event is not None:
            event.synchronize()

    def peek(self) -> StepPreview:
        """The step `step()` would run now, without running it (`StepPreview`: its decode rows and the
        prefill work that may ride with them): what a controller sizes the next step's partition and prefill
        budget from; it says how long the oldest prompt with prefill pending has waited."""
        return self.scheduler.peek(self.clock(), None if self._inflight is None else self._inflight.batch)

    def abort(self, seq: Sequence) -> bool:
        """Drop one request now (a client went away): its KV blocks are freed at once and it is recorded with
        the tokens it drew; False when it had already finished. Call between steps."""
        if self._inflight is not None and seq in self._inflight.batch.seqs:
            self._inflight.wait()  # its launched-ahead step may still write the sequence's blocks
            self._inflight = None
        if not self.scheduler.abort(seq, self.clock()):
            return False
        self.metrics.add_finished(seq)
        return True

    def abort_all(self, record: bool = False) -> int:
        """Drop every queued and running request (blocks freed, finish_reason 'aborted'); returns how many.
        With `record`, each is recorded in the metrics with the tokens it drew so far (a window's end: what
        its clients saw counts). The requests are dropped even when waiting for a step in flight fails (a
        device error), which is then raised."""
        inflight, self._inflight = self._inflight, None
        try:
            if inflight is not None:
                inflight.wait()
        finally:
            dropped = self.scheduler.abort_all(self.clock())
            if record:
                for seq in dropped:
                    self.metrics.add_finished(seq)
        return len(dropped)

    def close(self) -> None:
        """Wait for a step launched ahead and free the decode graphs and pinned staging buffers; the engine
        cannot step afterwards. Call before destroying the contexts of the streams it ran on. Idempotent."""
        if self._inflight is not None:
            self._inflight.wait()
            self._inflight = None
        self.runner.close()
        self.closed = True

    def reset_metrics(self) -> None:
        """Start the metrics afresh (e.g. after a warm-up)."""
        self.metrics = EngineMetrics(self.clock())

    def synthetic_decode(
        self, batch: int, kv_len: int, partition: str = DEFAULT_PARTITION, lora_slots: int = 0
    ) -> None:
        """A decode step of `batch` x `kv_len` that touches no request and no cached value, its rows on
        `lora_slots` adapter slots: for profiling step latency (launched, not waited for, on a GPU)."""
        self.runner.synthetic_decode(batch, kv_len, partition, lora_slots)

    @property
    def num_adapter_slots(self) -> int:
        """How many adapters one step can serve (0: the engine has no adapter slots)."""
        return 0 if self.runner.lora is None else self.runner.lora.num_slots - 1

    @property
    def mixed_token_buckets(self) -> tuple[int, ...]:
        """The token counts a mixed step is padded to (its CUDA graphs' buckets, ascending); () where mixed
        steps run eagerly, unpadded."""
        graphs = self.runner.mixed_graphs
        return () if graphs is None else tuple(graphs.buckets)

    def synthetic_mixed(
        self,
        batch: int,
        kv_len: int,
        prefill_tokens: int,
        prefill_context: int = 0,
        partition: str = DEFAULT_PARTITION,
        lora_slots: int = 0,
    ) -> None:
        """A mixed step (`batch` decode rows over `kv_len` tokens each, one prefill piece of `prefill_tokens`
        after `prefill_context` cached ones, the rows on `lora_slots` adapter slots in turn) that touches no
        request and no cached value: for profiling."""
        self.runner.synthetic_mixed(batch, kv_len, prefill_tokens, prefill_context, partition, lora_slots)

    # ---- stepping -----------------------------------------------------------------------------------------
    def step(
        self, partition: str = DEFAULT_PARTITION, prefill_tokens: int | None = None, ahead: bool | None = None
    ) -> StepResult:
        """Schedule and run one step on `partition`; returns what happened. With mixed prefill,
        `prefill_tokens` caps the prefill tokens riding with the decode rows (None: the config's
        `prefill_chunk_tokens`, or `max_num_batched_tokens` when nothing decodes).

        A step launched ahead by the call before completes first, whatever `partition` says (it runs where
        it was launched). `ahead` (None: `config.overlap`) says whether the step's successor may be
        launched, on `partition`, before the step's tokens are read (`Scheduler.schedule_ahead`). The
        prefill budget `prefill_tokens` caps every step the call launches: the one scheduled now and its
        successor, or the successor of the step in flight. A successor with prefill whose shape the mixed
        graphs do not take is not launched ahead: launched eagerly (tens of milliseconds of host time for a
        long prompt), it would hold back the tokens of the step before it."""
        if self.closed:
            raise EngineError("the engine is closed: it released its graphs and buffers")
        if partition not in self.runner.partitions:  # checked before scheduling changes any state
            raise EngineError(f"unknown partition {partition!r} (known: {', '.join(self.runner.partitions)})")
        t0 = self.clock()
        launched, self._inflight = self._inflight, None
        if launched is None:
            batch = self.scheduler.schedule(prefill_tokens)
            if batch is None:
                return StepResult("idle")
            launched = self.runner.launch(batch, partition)
        batch = launched.batch
        if self.overlap if ahead is None else ahead:
            ahead = self.scheduler.schedule_ahead(batch, prefill_tokens, self.runner.replays_varlen)
            if ahead is not None:
                self._inflight = self.runner.launch(ahead, partition, after=launched)
                self.num_launched_ahead += 1
        kv_tokens = sum(s.num_computed + n for s, n in zip(batch.seqs, batch.num_tokens, strict=True))
        with self.host_yield():  # waiting for the GPU: other threads may have the host meanwhile
            tokens = launched.read()
        now = self.clock()
        finished = self.scheduler.postprocess(batch, tokens, now)
        if self._inflight is not None and not any(s.status is SequenceStatus.RUNNING for s in ahead.seqs):
            self._inflight = None  # every sequence it continues has ended: nothing to complete
        kind = batch.kind
        result = StepResult(
            kind,
            len(batch.seqs),
            sum(batch.num_tokens),
            kv_tokens,
            batch.num_decode,
            batch.prefill_tokens,
            now - t0,
            finished,
            batch.preempted,
            launched.gpu_s(),
            launched.launch_s,
            sum(1 for s in batch.seqs if s.lora_slot),
            launched.forward_s,
        )
        self.metrics.add_step(
            StepRecord(
                len(self.metrics.steps),
                t0 - self.metrics.t0,
                kind,
                launched.partition or partition,  # a step launched ahead ran where the call before put it
                result.num_seqs,
                result.num_tokens,
                kv_tokens,
                result.latency_s * 1e3,
                self.block_manager.num_free,
                len(batch.preempted),
            )
        )
        for seq in finished:
            self.metrics.add_finished(seq)
        return result

    def warm_up(
        self, prompt_lens: tuple[int, ...] = WARMUP_PROMPT_LENS, partition: str = DEFAULT_PARTITION
    ) -> int:
        """Compile what prefill steps launch for the shapes traffic brings, before it does
        (`engine.warm_up.warm_up_prefill` has the contract); returns how many requests ran. Needs an idle
        engine."""
        return warm_up_prefill(self, prompt_lens, partition)

    def run_until_done(self, partition: str = DEFAULT_PARTITION) -> list[Sequence]:
        """Step until every queued request has finished; returns them in finishing order."""
        done: list[Sequence] = []
        while self.has_unfinished():
            result = self.step(partition)
            if result.kind == "idle":
                raise EngineError("engine: requests are queued but none can be scheduled (cache too small?)")
            done.extend(result.finished)
        return done

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Sequence]:
        """Run `prompts` to completion; returns their sequences in prompt order (refused ones finished with
        finish_reason 'refused' and `error` set, the others unaffected)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        seqs: list[Sequence] = []
        for prompt, p in zip(prompts, plist, strict=True):
            try:
                seqs.append(self.add_request(prompt, p))
            except RequestRefused as e:
                log.warning("%s", e)
                seqs.append(e.seq)
        self.run_until_done()
        return seqs

    def decode_text(self, seq: Sequence) -> str:
        """The completion of `seq` as text (needs the tokenizer)."""
        if self.tokenizer is None:
            raise EngineError("decode_text needs an engine built with a tokenizer")
        return self.tokenizer.decode(seq.completion_token_ids)
