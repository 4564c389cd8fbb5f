"""Runs one scheduled batch: builds the model inputs and attention metadata, runs the model, samples."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from harli_train.engine import synthetic
from harli_train.engine.attention import AttentionMetadata, PagedAttention
from harli_train.engine.block_manager import BlockManager
from harli_train.engine.decode_graphs import DecodeGraphs
from harli_train.engine.engine_config import EngineConfig
from harli_train.engine.graph_capture import load_gather_kernels
from harli_train.engine.kv_cache import KVStorage
from harli_train.engine.launched_step import LaunchedStep, Partition
from harli_train.engine.lora_slots import LoRASlots, adapter_slots
from harli_train.engine.mixed_graphs import MixedGraphs
from harli_train.engine.sampler import Sampler, sampling_batch
from harli_train.engine.sequence import Sequence
from harli_train.engine.step_inputs import StepInputs
from harli_train.engine.step_work import ScheduledBatch
from harli_train.model import LlamaForCausalLM

DEFAULT_PARTITION = "default"
CPU_NUM_SMS = 132  # sizes the decode grid under the interpreter, as on an H200


def _sm_budget(num_sms: int) -> contextlib.AbstractContextManager:
    # The model's own Triton ops size their grids by the trainer kernels' SM budget, when that module exists.
    try:
        from harli_train.kernels.launch_config import sm_budget
    except ImportError:
        return contextlib.nullcontext()
    return sm_budget(num_sms)


class ModelRunner:
    """Prefill steps run eagerly; decode steps replay the CUDA graph of (partition, batch bucket) on a GPU
    unless `enforce_eager`, and run eagerly on the CPU.

    `launch` queues a step and returns at once; the host waits only in `LaunchedStep.read`. A decode step
    may be launched `ahead`, before the previous step's tokens are read: its input ids are gathered on the
    device from that step's tokens. Each launch waits (on the device) for the one before it, so
    consecutive steps may run on different partitions' streams.

    With `config.max_loras`, `lora` holds the adapter slots: each step's rows-by-slot metadata is prepared
    once (`LoRASlots.prepare`) and every projection adds its rows' deltas; a step with no adapter row does
    no LoRA work (its graphs were captured without it).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig,
        block_manager: BlockManager,
        storage: KVStorage,
        use_triton: bool,
        seed: int = 0,
    ):
        self.model, self.config, self.block_manager = model, config, block_manager
        self.device = model.lm_head.weight.device
        self.attn = PagedAttention(storage, model.config.head_dim, use_triton)
        self.sampler = Sampler()
        self.seed = seed
        self.lora: LoRASlots | None = None
        if config.max_loras:
            dtype = model.lm_head.weight.dtype
            self.lora = LoRASlots(
                model.config,
                config.max_loras,
                config.max_lora_rank,
                dtype,
                self.device,
                use_triton,
                config.lora_kernel,
            )
            self.lora.install_hooks(model)
        self.decode_forward = None
        if config.decode_gemv and use_triton:
            from harli_train.engine.decode_forward import DecodeForward  # imports triton

            if DecodeForward.supports(model):
                self.decode_forward = DecodeForward(model, self.lora)
        # What varlen steps run: the decode kernels (see EngineConfig.varlen_decode_kernels), or the model's.
        self.varlen_forward = self.decode_forward if config.varlen_decode_kernels else None
        self.split_rows = config.varlen_decode_kernels
        self.use_graphs = self.device.type == "cuda" and use_triton and not config.enforce_eager
        self.graphs = (
            DecodeGraphs(model, self.attn, config, self.device, self.decode_forward, self.lora)
            if self.use_graphs
            else None
        )
        # Varlen steps replay graphs too where they are frequent (mixed steps, which ride every decode step
        # while prefill work waits); prefill-first steps stay eager.
        self.mixed_graphs = (
            MixedGraphs(
                model,
                self.attn,
                config,
                self.device,
                lora=self.lora,
                decode_forward=self.varlen_forward,
                split_rows=self.split_rows,
            )
            if self.use_graphs and config.mixed_prefill
            else None
        )
        self.partitions: dict[str, Partition] = {}
        on_gpu = self.device.type == "cuda"
        # Two pinned token buffers: a step's read-back lands in one while the previous step's is read.
        self._token_host = [
            torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)
        ]
        self._num_launched = 0
        self._last: tuple[torch.cuda.Stream, torch.cuda.Event] | None = None
        self._waits: list[torch.cuda.Event] = []  # what the next launched step waits for (wait_before_next)
        # Tensor parallelism: rank 0's runner hands every forward's inputs here before running it, so the
        # other ranks run the same forward (`follow`); None on one GPU.
        self.publish: Callable[[StepInputs], None] | None = None

    def add_partition(self, key: str, stream: torch.cuda.Stream | None, num_sms: int | None = None) -> None:
        """Register a place to run steps; on a GPU this captures its decode graphs (on `stream`)."""
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(self.device).multi_processor_count
                if self.device.type == "cuda"
                else CPU_NUM_SMS
            )
        if self.graphs is not None and stream is None:
            stream = torch.cuda.Stream(self.device)  # capture needs a side stream; steps then run on it
        self.partitions[key] = Partition(stream, num_sms)
        if self.publish is not None:
            self.publish(StepInputs("partition", key, num_sms=num_sms))
        if self.graphs is not None:
            with _sm_budget(num_sms):
                self.graphs.capture(key, stream, num_sms)
                if self.mixed_graphs is not None:
                    self.mixed_graphs.pool = self.graphs.pool  # one pool: steps never overlap on the device
                    self.mixed_graphs.capture(key, stream, num_sms)
                # The gather a fed step's tokens are staged with in either kind of graph's `replay`.
                rows = max(self.graphs.buckets[-1], self.mixed_graphs.max_rows if self.mixed_graphs else 0)
                with torch.cuda.stream(stream):
                    load_gather_kernels(self.device, rows)
                stream.synchronize()

    def close(self) -> None:
        """Drop every partition, its graphs and the pinned token buffers (see ``DecodeEngine.close``)."""
        if self.graphs is not None:
            self.graphs.close()
        if self.mixed_graphs is not None:
            self.mixed_graphs.close()
        self.partitions.clear()
        self._token_host.clear()
        self._last = None

    @contextlib.contextmanager
    def _on(self, partition: Partition) -> Iterator[None]:
        stream_ctx = (
            torch.cuda.stream(partition.stream) if partition.stream is not None else contextlib.nullcontext()
        )
        with stream_ctx, _sm_budget(partition.num_sms), torch.inference_mode():
            yield

    def wait_before_next(self, event: torch.cuda.Event | None) -> None:
        """The next step launched starts on the GPU only once ``event`` (recorded on another stream) is
        reached; its start event, and so its GPU span, come after the wait. None: nothing to wait for."""
        if event is not None:
            self._waits.append(event)

    def run(self, batch: ScheduledBatch, partition: str = DEFAULT_PARTITION) -> list[int | None]:
        """Compute the batch; returns the drawn token of each sequence that samples, else None."""
        return self.launch(batch, partition).read()

    def launch(
        self, batch: ScheduledBatch, partition: str = DEFAULT_PARTITION, after: LaunchedStep | None = None
    ) -> LaunchedStep:
        """Queue the batch's step. With `after` (a step whose tokens are not read yet), `batch` is the step
        that follows it (`Scheduler.schedule_ahead`): each of its decode rows (the first `batch.num_decode`)
        computes the token `after` draws for its sequence, beyond what the host knows, and its prefill pieces
        start past what `after` computes of them (`batch.ahead`)."""
        part = self.partitions[partition]
        sampling = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        ahead = after is not None
        feed = None
        if ahead:
            drawn = {id(after.batch.seqs[r]): k for k, r in enumerate(after.sampling)}  # its tokens' order
            fed = batch.seqs[: batch.num_decode]
            feed = (after.tokens, np.array([drawn[id(s)] for s in fed], dtype=np.int64))
        waits, self._waits = self._waits, []
        with self._on(part):
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            if stream is not None and self._last is not None and self._last[0] != stream:
                stream.wait_event(self._last[1])  # the previous step ran on another partition's stream
            if stream is not None and self.lora is not None:
                for event in self.lora.take_waits():  # an adapter written on another stream
                    stream.wait_event(event)
            for event in waits:  # work of another stream this step must follow (`wait_before_next`)
                if stream is not None:
                    stream.wait_event(event)
            start = launch_s = forward_s = None
            if stream is not None:
                start = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                t_start = time.perf_counter()
            if batch.is_prefill:
                logits = self._prefill(batch, sampling, partition, part, feed)
            else:
                logits = self._decode(batch.seqs, partition, part, feed)
            if stream is not None:
                forward_s = time.perf_counter() - t_start
            tokens = host = event = None
            if sampling:
                seqs = [batch.seqs[i] for i in sampling]
                # The index of the token each row draws, past the host's last (a fed decode row's: one).
                offsets = [
                    s.num_computed + batch.ahead_of(i) + batch.num_tokens[i] - len(s)
                    for i, s in zip(sampling, seqs, strict=True)
                ]
                tokens = self.sampler(logits, sampling_batch(seqs, offsets, self.seed, self._to_device))
            if stream is not None:
                if tokens is not None:
                    host = self._token_host[self._num_launched % 2]
                    host[: tokens.shape[0]].copy_(tokens, non_blocking=True)
                event = torch.cuda.Event(enable_timing=True)
                event.record(stream)
                launch_s = time.perf_counter() - t_start
                self._last = (stream, event)
        self._num_launched += 1
        return LaunchedStep(batch, sampling, tokens, host, event, start, launch_s, partition, forward_s)

    def replays_varlen(self, num_tokens: int, num_rows: int) -> bool:
        """Whether a varlen step of ``num_tokens`` packed tokens in ``num_rows`` rows launches as cheaply as
        the runner's other steps: it replays a mixed graph, or no step does (eager runners: CPU,
        ``enforce_eager``, prefill-first)."""
        return self.mixed_graphs is None or self.mixed_graphs.fits(num_tokens, num_rows)

    def last_event(self) -> torch.cuda.Event | None:
        """An event past every step launched so far (None on a CPU, or before the first step)."""
        return self._last[1] if self._last is not None else None

    def _to_device(self, array: np.ndarray | list, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(array), dtype=dtype).to(self.device, non_blocking=True)

    def _fed_ids(self, feed: tuple[torch.Tensor, np.ndarray]) -> torch.Tensor:
        """The input ids of a step launched ahead's fed rows: ``feed[0][feed[1]]``, the tokens of the step
        before, gathered on the device (eager steps; the graphs gather into their static buffers)."""
        return feed[0][self._to_device(feed[1], torch.int64)]

    def _prefill(
        self,
        batch: ScheduledBatch,
        sampling: list[int],
        key: str,
        part: Partition,
        feed: tuple[torch.Tensor, np.ndarray] | None = None,
    ) -> torch.Tensor:
        """A varlen step (prefill pieces, with decode rows when mixed): every row's new tokens packed in one
        row, attending over its cache; returns the logits of the rows that sample. `feed`: the step is
        launched ahead (`launch`'s `after`): each row starts past what the step before computes of it
        (`batch.ahead`), and its decode rows' input ids are `feed[0][feed[1]]` on the device."""
        bm = self.block_manager
        ids, positions, slots, context_lens = [], [], [], []
        fed = 0 if feed is None else batch.num_decode
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            start = seq.num_computed + batch.ahead_of(i)
            ids.extend(seq.token_ids[start : start + n] if i >= fed else [0])
            positions.append(np.arange(start, start + n))
            slots.append(bm.slots(seq, start, start + n))
            context_lens.append(start + n)
        tables = bm.tables[[s.row for s in batch.seqs], : bm.blocks_for(max(context_lens))]
        positions_np, slots_np = np.concatenate(positions), np.concatenate(slots)
        adapters = adapter_slots(batch.seqs, batch.num_tokens) if self.lora is not None else None
        return self._varlen_forward(
            ids, positions_np, slots_np, context_lens, batch.num_tokens, tables, sampling, key, part,
            adapters, feed,
        )  # fmt: skip

    def _varlen_forward(
        self,
        ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        context_lens: list[int],
        num_tokens: list[int],
        tables: np.ndarray,
        sampling: list[int],
        key: str,
        part: Partition,
        adapters: np.ndarray | None = None,
        feed: tuple[torch.Tensor, np.ndarray] | None = None,
    ) -> torch.Tensor:
        """The model over packed rows (`num_tokens[i]` new tokens of row i, cached context after it
        `context_lens[i]`); logits of the last token of each row in `sampling`. `adapters`: each token's
        adapter slot (None: all the base). `feed` = (tokens, rows): the first len(rows) packed tokens' ids are
        tokens[rows] (on the device) instead. A step that fits the mixed graphs replays its bucket's graph;
        others run eagerly."""
        if self.publish is not None:
            assert feed is None, "a tensor-parallel engine launches no step ahead"
            self.publish(StepInputs("varlen", key, ids, positions, slots, np.asarray(context_lens), tables,
                                    list(num_tokens), list(sampling)))  # fmt: skip
        graphs = self.mixed_graphs
        if graphs is not None and graphs.fits(len(ids), len(num_tokens)):
            return graphs.replay(
                key, ids, positions, slots, context_lens, num_tokens, tables, sampling, part.num_sms,
                adapters, feed,
            )  # fmt: skip
        cu = np.zeros(len(num_tokens) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(num_tokens)
        self.attn.meta = AttentionMetadata(
            True,
            self._to_device(slots, torch.int64),
            self._to_device(tables, torch.int32),
            self._to_device(context_lens, torch.int32),
            self._to_device(cu, torch.int32),
            max_q_len=max(num_tokens),
            num_sms=part.num_sms,
            split_rows=self.split_rows,
        )
        input_ids = self._to_device(ids, torch.int64)
        if feed is not None:
            input_ids[: len(feed[1])] = self._fed_ids(feed)
        positions_t = self._to_device(positions, torch.int64)
        last_rows = self._to_device(cu[1:][sampling] - 1, torch.int64)
        with self._adapters(adapters):
            if self.varlen_forward is not None:  # the decode kernels over every packed token
                hidden = self.varlen_forward(input_ids[:, None], positions_t[:, None], self.attn)
                self.attn.meta = None
                return self.varlen_forward.logits(hidden[last_rows])
            hidden = self.model(input_ids[None], positions_t[None], self.attn)
        self.attn.meta = None
        return self.model.logits(hidden[0, last_rows])

    def _decode(
        self,
        seqs: list[Sequence],
        key: str,
        part: Partition,
        feed: tuple[torch.Tensor, np.ndarray] | None = None,
    ) -> torch.Tensor:
        # feed: (device tokens of the step before, row of each sequence in it) for a step launched ahead:
        # every sequence is then one token longer than its token_ids.
        bm = self.block_manager
        rows = np.fromiter((s.row for s in seqs), dtype=np.int64, count=len(seqs))
        lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        if feed is not None:
            lens += 1
        positions = lens - 1
        ids = [0] * len(seqs) if feed is not None else [s.token_ids[-1] for s in seqs]
        width = bm.blocks_for(int(lens.max()))
        tables = bm.tables[rows, :width]
        slots = tables[np.arange(len(seqs)), positions // bm.block_size].astype(np.int64) * bm.block_size
        slots += positions % bm.block_size
        adapters = adapter_slots(seqs) if self.lora is not None else None
        if self.publish is not None:
            assert feed is None, "a tensor-parallel engine launches no step ahead"
            self.publish(StepInputs("decode", key, ids, positions, slots, lens, tables))
        if self.graphs is not None:
            return self.graphs.replay(key, ids, positions, slots, lens, tables, feed, adapters)
        ids_t = self._to_device(ids, torch.int64) if feed is None else self._fed_ids(feed)
        with self._adapters(adapters):
            return self._eager_decode(ids_t, positions, slots, lens, tables, part)

    def _adapters(self, token_slots: np.ndarray | None) -> contextlib.AbstractContextManager:
        if self.lora is None or token_slots is None:
            return contextlib.nullcontext()
        return self.lora.active(token_slots)

    def _eager_decode(
        self,
        ids_t: torch.Tensor,
        positions: np.ndarray,
        slots: np.ndarray,
        lens: np.ndarray,
        tables: np.ndarray,
        part: Partition,
    ) -> torch.Tensor:
        self.attn.meta = AttentionMetadata(
            False,
            self._to_device(slots, torch.int64),
            self._to_device(tables, torch.int32),
            self._to_device(lens, torch.int32),
            num_sms=part.num_sms,
        )
        ids_t = ids_t[:, None]
        pos_t = self._to_device(positions, torch.int64)[:, None]
        if self.decode_forward is not None:
            logits = self.decode_forward.logits(self.decode_forward(ids_t, pos_t, self.attn))
        else:
            logits = self.model.logits(self.model(ids_t, pos_t, self.attn)[:, 0])
        self.attn.meta = None
        return logits

    def synthetic_decode(
        self, batch: int, kv_len: int, partition: str = DEFAULT_PARTITION, lora_slots: int = 0
    ) -> None:
        """One decode step for timing (``synthetic.decode_step``: existing blocks, no K/V written, nothing
        drawn); on a GPU the graph is launched on the partition's stream and not waited for."""
        slots_have = 0 if self.lora is None else self.lora.num_slots
        step = synthetic.decode_step(batch, kv_len, self.config, self.block_manager, lora_slots, slots_have)
        part = self.partitions[partition]
        if self.publish is not None:
            self.publish(StepInputs("decode", partition, step.ids, step.positions, step.slots,
                                    step.context_lens, step.tables))  # fmt: skip
        with self._on(part):
            if self.graphs is not None:
                self.graphs.replay(partition, step.ids, step.positions, step.slots, step.context_lens,
                                   step.tables, None, step.adapters)  # fmt: skip
                return
            ids_t = self._to_device(step.ids, torch.int64)
            with self._adapters(step.adapters):
                self._eager_decode(ids_t, step.positions, step.slots, step.context_lens, step.tables, part)

    def synthetic_mixed(
        self,
        batch: int,
        kv_len: int,
        prefill_tokens: int,
        prefill_context: int,
        partition: str,
        lora_slots: int = 0,
    ) -> None:
        """One mixed step for timing (``synthetic.mixed_step``, its rows on ``lora_slots`` adapters) on the
        varlen path, as a served mixed step runs, the LM head over every row; launched on the partition's
        stream and not waited for on a GPU."""
        slots_have = 0 if self.lora is None else self.lora.num_slots
        step = synthetic.mixed_step(
            batch,
            kv_len,
            prefill_tokens,
            prefill_context,
            self.config,
            self.block_manager,
            lora_slots,
            slots_have,
        )
        part = self.partitions[partition]
        with self._on(part):
            rows = list(range(batch + 1))
            self._varlen_forward(step.ids, step.positions, step.slots, step.context_lens.tolist(),
                                 step.num_tokens, step.tables, rows,
                                 partition, part, step.adapters)  # fmt: skip

    def follow(self, inputs: StepInputs, stream: torch.cuda.Stream | None = None) -> None:
        """Run the forward rank 0 published (its logits unused: rank 0 samples); 'partition' registers
        one on ``stream``. Steps on different partitions' streams run in order, as `launch` keeps them."""
        if inputs.kind == "partition":
            self.add_partition(inputs.partition, stream, inputs.num_sms)
            return
        part = self.partitions[inputs.partition]
        with self._on(part):
            current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            if current is not None and self._last is not None and self._last[0] != current:
                current.wait_event(self._last[1])
            if inputs.kind == "varlen":
                self._varlen_forward(inputs.ids, inputs.positions, inputs.slots, list(inputs.context_lens),
                                     inputs.num_tokens, inputs.tables, inputs.sampling,
                                     inputs.partition, part)  # fmt: skip
            elif self.graphs is not None:
                self.graphs.replay(inputs.partition, inputs.ids, inputs.positions, inputs.slots,
                                   inputs.context_lens, inputs.tables)  # fmt: skip
            else:
                ids = self._to_device(inputs.ids, torch.int64)
                self._eager_decode(
                    ids, inputs.positions, inputs.slots, inputs.context_lens, inputs.tables, part
                )
            if current is not None:
                event = torch.cuda.Event()
                event.record(current)
                self._last = (current, event)
