"""Varlen steps (decode rows plus prefill chunks, or prefill alone) as CUDA graphs, one per (partition, token
bucket), so a mixed step costs one replay on the host where eagerly it launches hundreds of kernels.

A step's rows are packed into static buffers padded to a bucket of `T` tokens and `S` = max_num_seqs rows:
padding tokens get slot -1 (nothing stored) and belong to no row; padding rows have no tokens and no
context, so the attention kernel's programs for them return at once. The dense layers treat tokens one by
one, so a padding token's (unused) values never reach a real one. The logits of the rows that sample are
gathered inside the graph into one static buffer; read them before the next replay (steps are ordered on
the device). Without graphs (a CPU, or a partition not captured) `replay` runs the same forward over the same
buffers eagerly, which is how the padding is tested off the GPU. With adapter slots, each bucket has a second
graph with the LoRA adds over static rows-by-slot buffers (padding tokens run on the base), replayed only by
steps with adapter tokens (see `DecodeGraphs`).

The dense layers treat every packed token as a decode step treats its rows, so with a `DecodeForward` they
run its kernels (the bandwidth-shaped GEMV up to MAX_GEMV_ROWS tokens, fused SwiGLU and add + norm
epilogues): a mixed step of a few prefill tokens streams the weights as the decode step does. In attention
the one-token rows go to the split decode kernel and the chunks' rows to the prefill kernel
(`AttentionMetadata.split_rows`); a small step also splits a short chunk's keys between programs.
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

BUCKET_STEP = 64  # tokens between buckets past the small ones: a step pads at most 63 tokens
# The GEMV's row tiles up to 64 (a small step streams the weights as decode does), then 96: the first step
# past the GEMV's rows, halfway to 128. A mixed step's chunk is sized to fill the TPOT budget, and at light
# load on the whole GPU that budget can fall between the 64- and the 128-token graphs (docs/design.md,
# "Measured facts behind the defaults").
SMALL_BUCKETS = (16, 32, 64, 96)


def token_buckets(config: EngineConfig) -> tuple[int, ...]:
    """Token counts a graph is captured for: the small buckets, then multiples of BUCKET_STEP past them, up
    to the first that holds the most a mixed step carries (every decoding row plus the default chunk, capped
    by max_num_batched_tokens)."""
    top = min(config.max_num_batched_tokens, config.max_num_seqs + config.prefill_chunk_tokens)
    first = (SMALL_BUCKETS[-1] // BUCKET_STEP + 1) * BUCKET_STEP  # the first multiple past the small ones
    past = range(first, top + BUCKET_STEP, BUCKET_STEP)
    buckets = []
    for size in (*SMALL_BUCKETS, *past):
        buckets.append(size)
        if size >= top:
            break
    return tuple(buckets)


class MixedGraphs:
    """Static buffers, the graphs that read them, and `replay` (stage a step's rows, run its bucket)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: PagedAttention,
        config: EngineConfig,
        device,
        pool=None,
        lora: LoRASlots | None = None,
        decode_forward=None,
        split_rows: bool = True,
    ):
        self.model, self.attn, self.lora = model, attn, lora
        self.decode_forward = decode_forward  # a DecodeForward, or None: the model's own forward
        self.split_rows = split_rows
        self.buckets = token_buckets(config)
        t_max, s_max, width = self.buckets[-1], config.max_num_seqs, config.max_blocks_per_seq
        self.max_tokens, self.max_rows = t_max, s_max
        pin = device.type == "cuda"
        # Host staging (two sets: a step fills one while the copy out of the other may be queued) and its
        # device copy. int64 rows: input ids, positions, slots, the packed row of each sampling row's last
        # token, and for a step launched ahead the row of each fed token in the tokens of the step before.
        # int32 rows: [context length, end of the row's tokens (cu_seqlens[i + 1]), block table].
        self.host_i64 = [torch.zeros((5, t_max), dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host_i32 = [torch.zeros((s_max, width + 2), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.dev_i64 = torch.zeros((5, t_max), dtype=torch.int64, device=device)
        self.dev_i32 = torch.zeros((s_max, width + 2), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(s_max, dtype=torch.int32, device=device)  # the kernels want it dense
        self.cu_seqlens = torch.zeros(s_max + 1, dtype=torch.int32, device=device)
        # A row has a token at least: a step samples at most min(rows, tokens) of them.
        self.logits = torch.empty(
            (min(s_max, t_max), model.config.vocab_size), dtype=model.lm_head.weight.dtype, device=device
        )
        self.graphs: dict[tuple[str, int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self.num_replays = 0
        if lora is not None:  # [sorted ids (t_max), slot starts (slots + 1)]
            n = t_max + lora.num_slots + 1
            self.host_lora = [torch.zeros(n, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
            self.dev_lora = torch.zeros(n, dtype=torch.int32, device=device)

    def fits(self, num_tokens: int, num_rows: int) -> bool:
        return num_tokens <= self.max_tokens and num_rows <= self.max_rows

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def _forward(self, t: int, num_sms: int, with_lora: bool = False) -> None:
        """The model over the first `t` packed tokens; logits of the rows `dev_i64[3]` names; `with_lora`:
        the projections add the adapter deltas the static LoRA buffers lay out."""
        if with_lora:
            sorted_ids, slot_start = self.dev_lora[:t], self.dev_lora[self.max_tokens :]
            self.lora.meta = LoRAStepMeta(sorted_ids, slot_start, None, t)
        try:
            self._forward_base(t, num_sms)
        finally:
            if self.lora is not None:
                self.lora.meta = None

    def _forward_base(self, t: int, num_sms: int) -> None:
        self.attn.meta = AttentionMetadata(
            True,
            self.dev_i64[2, :t],
            self.dev_i32[:, 2:],
            self.context_lens,
            self.cu_seqlens,
            max_q_len=t,
            num_sms=num_sms,
            split_rows=self.split_rows,
            decode_rows=min(t, self.max_rows),  # a row with a token has one of the bucket's t
        )
        ids, positions, last = self.dev_i64[0, :t], self.dev_i64[1, :t], self.dev_i64[3, : len(self.logits)]
        if self.decode_forward is not None:
            hidden = self.decode_forward(ids[:, None], positions[:, None], self.attn)
            self.attn.meta = None
            self.decode_forward.logits(hidden[last], out=self.logits)
            return
        hidden = self.model(ids[None], positions[None], self.attn)
        self.attn.meta = None
        torch.mm(hidden[0, last], self.model.lm_head.weight.t(), out=self.logits)

    @torch.inference_mode()
    def capture(self, key: str, stream: torch.cuda.Stream, num_sms: int) -> None:
        """Capture every bucket on `stream` (largest first, so smaller graphs reuse its memory)."""
        self.dev_i64.zero_()
        self.dev_i64[2].fill_(-1)  # slot -1: the warm-up and capture runs write nothing to the cache
        self.dev_i32.zero_()
        self.context_lens.zero_()
        self.cu_seqlens.zero_()  # no row has a token: the attention programs return at once
        if self.lora is not None:
            self.dev_lora.zero_()  # every slot empty: the LoRA programs return at once
        torch.cuda.synchronize()
        variants = (False, True) if self.lora is not None else (False,)
        forward = lambda n, with_lora: self._forward(n, num_sms, with_lora)  # noqa: E731
        self.pool = capture_buckets(self.graphs, key, self.buckets, variants, forward, stream, self.pool)

    def replay(
        self,
        key: str,
        ids: list[int],
        positions: np.ndarray,
        slots: np.ndarray,
        context_lens: list[int],
        num_tokens: list[int],
        tables: np.ndarray,
        sampling: list[int],
        num_sms: int,
        adapters: np.ndarray | None = None,
        feed: tuple[torch.Tensor, np.ndarray] | None = None,
    ) -> torch.Tensor:
        """Run one varlen step on partition `key` (call on its stream): row i has `num_tokens[i]` new tokens,
        `context_lens[i]` cached after the step and block table `tables[i]`; returns the logits
        [len(sampling), V] of the last token of each row in `sampling` (a view of the shared buffer).
        `adapters`: each token's adapter slot (None or all 0: the base graph). With `feed` = (tokens, rows),
        the first len(rows) packed tokens' ids are tokens[rows] (on the device) instead."""
        total, rows = len(ids), len(num_tokens)
        t = self.bucket(total)
        parity = self.num_replays % 2
        with_lora = adapters is not None and bool(np.any(adapters))
        if with_lora:
            sorted_ids, slot_start = lora_layout(adapters, self.lora.num_slots)
            staged = self.host_lora[parity].numpy()
            top = self.max_tokens
            staged[:total], staged[total:top], staged[top:] = sorted_ids, 0, slot_start
            self.dev_lora.copy_(self.host_lora[parity], non_blocking=True)
        host_i64, host_i32 = self.host_i64[parity], self.host_i32[parity]
        self.num_replays += 1
        h = host_i64.numpy()
        h[0, :total], h[1, :total], h[2, :total] = ids, positions, slots
        h[0, total:t], h[1, total:t], h[2, total:t] = 0, 0, -1
        ends = np.cumsum(num_tokens)
        h[3, : len(sampling)] = ends[sampling] - 1
        h[3, len(sampling) : self.max_rows] = 0
        fed = 0 if feed is None else len(feed[1])
        if fed:
            h[4, :fed] = feed[1]
        r = host_i32.numpy()
        r[:rows, 0], r[:rows, 1] = context_lens, ends
        r[rows:, 0], r[rows:, 1] = 0, total
        r[:rows, 2 : 2 + tables.shape[1]] = tables
        self.dev_i64.copy_(host_i64, non_blocking=True)
        self.dev_i32.copy_(host_i32, non_blocking=True)
        self.context_lens.copy_(self.dev_i32[:, 0])
        self.cu_seqlens[1:].copy_(self.dev_i32[:, 1])
        if fed:
            torch.index_select(feed[0], 0, self.dev_i64[4, :fed], out=self.dev_i64[0, :fed])
        graph = self.graphs.get((key, t, with_lora))
        if graph is not None:
            graph.replay()
        else:
            self._forward(t, num_sms, with_lora)
        return self.logits[: len(sampling)]

    def close(self) -> None:
        """Drop the graphs, their memory pool and the pinned staging buffers."""
        self.graphs.clear()
        self.pool = None
        self.host_i64.clear()
        self.host_i32.clear()
        if self.lora is not None:
            self.host_lora.clear()
