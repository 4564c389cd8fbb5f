"""Whole decode steps (all layers and the LM head) captured as CUDA graphs, one per (partition, batch bucket).

A graph replays on the SMs of the stream it was captured on (a green context's stream confines it), so each
SM partition gets its own set. All graphs read one set of static input buffers and write one logits buffer;
a step copies its inputs in (padding rows get slot -1 and context 0, which the kernels skip), replays, and
samples from the logits before the next step can overwrite them (steps are ordered on the device). A step
launched ahead of the host gathers its input ids on the device from the previous step's tokens.

With adapter slots (`lora`) each bucket has a second graph, captured with the LoRA kernels reading static
rows-by-slot buffers (`LoRAStepMeta` over them, its grid sized for the bucket, the padding rows on the
base): a step with adapter rows stages its layout there and replays that graph; a step without replays the
base graph and pays nothing.
The adapters' weights are read by address, so writing a slot needs no re-capture.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from harli_train.engine.attention import AttentionMetadata, PagedAttention
from harli_train.engine.engine_config import EngineConfig
from harli_train.engine.graph_capture import capture_buckets
from harli_train.engine.lora_ops import lora_layout
from harli_train.engine.lora_slots import LoRASlots, LoRAStepMeta
from harli_train.model import LlamaForCausalLM


class DecodeGraphs:
    """The graphs and the static buffers they read: `capture` per partition, `replay` per step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: PagedAttention,
        config: EngineConfig,
        device: torch.device,
        decode_forward=None,
        lora: LoRASlots | None = None,
    ):
        self.model, self.attn, self.lora = model, attn, lora
        self.decode_forward = decode_forward  # a DecodeForward, or None: the model's own forward
        self.buckets = config.graph_batch_sizes
        max_bs, width = self.buckets[-1], config.max_blocks_per_seq
        # Pinned host staging and its device copy: int64 rows (input ids, positions, slots, and the rows of
        # the previous step whose tokens are the input ids, when launched ahead) and int32 rows (context
        # length, then the block table), so a step's inputs go over in two copies. Two sets of staging
        # buffers: a step fills one while the copy out of the other may still be queued.
        self.host_i64 = [torch.zeros((4, max_bs), dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.host_i32 = [
            torch.zeros((max_bs, width + 1), dtype=torch.int32, pin_memory=True) for _ in range(2)
        ]
        self.num_replays = 0
        self.dev_i64 = torch.zeros((4, max_bs), dtype=torch.int64, device=device)
        self.dev_i32 = torch.zeros((max_bs, width + 1), dtype=torch.int32, device=device)
        self.block_tables = self.dev_i32[:, 1:]  # row stride width + 1; the kernels take strides
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)  # kernels want it dense
        self.logits = torch.empty(
            (max_bs, model.config.vocab_size), dtype=model.lm_head.weight.dtype, device=device
        )
        self.graphs: dict[tuple[str, int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None
        if lora is not None:
            # [sorted ids (max_bs), slot starts (slots + 1)], staged like the other inputs.
            n = max_bs + lora.num_slots + 1
            self.host_lora = [torch.zeros(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self.dev_lora = torch.zeros(n, dtype=torch.int32, device=device)

    def close(self) -> None:
        """Drop the graphs, their memory pool and the pinned staging buffers."""
        self.graphs.clear()
        self.pool = None
        self.host_i64.clear()
        self.host_i32.clear()
        if self.lora is not None:
            self.host_lora.clear()

    def bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def _metadata(self, bs: int, num_sms: int) -> AttentionMetadata:
        return AttentionMetadata(
            False, self.dev_i64[2, :bs], self.block_tables[:bs], self.context_lens[:bs], num_sms=num_sms
        )

    def _lora_meta(self, bs: int) -> LoRAStepMeta:
        max_bs = self.buckets[-1]
        return LoRAStepMeta(self.dev_lora[:bs], self.dev_lora[max_bs:], None, bs)

    def _forward(self, bs: int, num_sms: int, with_lora: bool = False) -> None:
        if with_lora:
            self.lora.meta = self._lora_meta(bs)
        try:
            self._forward_base(bs, num_sms)
        finally:
            if self.lora is not None:
                self.lora.meta = None

    def _forward_base(self, bs: int, num_sms: int) -> None:
        self.attn.meta = self._metadata(bs, num_sms)
        ids, pos = self.dev_i64[0, :bs, None], self.dev_i64[1, :bs, None]
        if self.decode_forward is not None:
            hidden = self.decode_forward(ids, pos, self.attn)
            self.decode_forward.logits(hidden, out=self.logits[:bs])
            return
        hidden = self.model(ids, pos, self.attn)
        if self.model.tensor_parallel > 1:  # a slice's head holds its rows of the vocabulary: gathered
            self.logits[:bs].copy_(self.model.logits(hidden[:, 0]))
            return
        torch.mm(hidden[:, 0], self.model.lm_head.weight.t(), out=self.logits[:bs])

    @torch.inference_mode()
    def capture(self, key: str, stream: torch.cuda.Stream, num_sms: int) -> None:
        """Capture every bucket on `stream` (largest first, so smaller graphs reuse its memory)."""
        self.dev_i64.zero_()
        self.dev_i64[2].fill_(-1)  # slot -1: the warm-up and capture runs write nothing to the cache
        self.context_lens.zero_()
        if self.lora is not None:
            self.dev_lora.zero_()  # every slot empty: the LoRA programs return at once
        torch.cuda.synchronize()  # the zeroing above (and the cache's) ran on another stream
        variants = (False, True) if self.lora is not None else (False,)
        forward = lambda n, with_lora: self._forward(n, num_sms, with_lora)  # noqa: E731
        self.pool = capture_buckets(self.graphs, key, self.buckets, variants, forward, stream, self.pool)
        self.attn.meta = None

    def replay(
        self,
        key: str,
        input_ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        feed: tuple[torch.Tensor, np.ndarray] | None = None,
        adapters: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Run one decode step of n = len(input_ids) sequences on partition `key`; returns logits [n, V]
        (a view of the shared buffer: read it before the next replay). Call on the partition's stream.
        With `feed` = (tokens, rows), the input ids are tokens[rows] (on the device) instead. `adapters`:
        each row's adapter slot (None or all 0: the base graph)."""
        n = len(input_ids)
        bs = self.bucket(n)
        parity = self.num_replays % 2
        with_lora = adapters is not None and bool(np.any(adapters))
        if with_lora:
            # The bucket's padding rows run on the base (slot 0): every row of the graph is in a slot, so
            # a LoRA delta kernel writes all of them (zeros on the base's).
            padded = np.zeros(bs, dtype=np.int64)
            padded[:n] = adapters
            sorted_ids, slot_start = lora_layout(padded, self.lora.num_slots)
            staged = self.host_lora[parity].numpy()
            max_bs = self.buckets[-1]
            staged[:bs], staged[bs:max_bs], staged[max_bs:] = sorted_ids, 0, slot_start
            self.dev_lora.copy_(self.host_lora[parity], non_blocking=True)
        # The staging set used two replays ago: its copy was queued before that step, which has finished
        # (the host read its tokens before launching more than one step past it).
        host_i64, host_i32 = self.host_i64[parity], self.host_i32[parity]
        self.num_replays += 1
        host = host_i64.numpy()
        host[0, :n] = input_ids
        host[1, :n] = positions
        host[2, :n] = slots
        host[:, n:bs] = 0
        host[2, n:bs] = -1
        if feed is not None:
            host[3, :n] = feed[1]
        tables = host_i32.numpy()
        tables[:n, 0] = context_lens
        tables[n:bs, 0] = 0
        tables[:n, 1 : 1 + block_tables.shape[1]] = block_tables
        self.dev_i64.copy_(host_i64, non_blocking=True)
        self.dev_i32[:bs].copy_(host_i32[:bs], non_blocking=True)
        self.context_lens[:bs].copy_(self.dev_i32[:bs, 0])
        if feed is not None:
            torch.index_select(feed[0], 0, self.dev_i64[3, :n], out=self.dev_i64[0, :n])
        self.graphs[(key, bs, with_lora)].replay()
        return self.logits[:n]
