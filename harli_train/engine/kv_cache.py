"""Where the paged KV cache lives, behind a small interface: one tensor now, the VMM page pool later."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from harli_train.engine.engine_config import GIB, EngineConfig, EngineError
from harli_train.model import LlamaForCausalLM, ModelConfig


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Geometry of the cache. Each layer's K (and V) is [num_blocks, block_size, num_kv_heads, head_dim],
    contiguous, so a block of one layer is one run of `block_size * num_kv_heads * head_dim` elements."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        mc = model_config
        return cls(mc.num_layers, mc.num_kv_heads, mc.head_dim, block_size, dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


@runtime_checkable
class KVStorage(Protocol):
    """What the engine needs from cache storage.

    `k_cache(layer)` / `v_cache(layer)` are [num_blocks, *spec.block_shape] tensors whose data pointers and
    strides stay fixed for the storage's life (CUDA graphs bake them in); a storage that grows keeps its
    base address and only extends `num_blocks` (the block manager's `grow`/`shrink` follow it).
    """

    spec: KVCacheSpec

    @property
    def num_blocks(self) -> int: ...

    def k_cache(self, layer: int) -> torch.Tensor: ...

    def v_cache(self, layer: int) -> torch.Tensor: ...


class TensorKVStorage:
    """The whole cache as one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str):
        self.spec = spec
        self._num_blocks = num_blocks
        self.data = torch.empty(
            (spec.num_layers, 2, num_blocks, *spec.block_shape), dtype=spec.dtype, device=device
        )
        # Stale values are never read (kernels mask by context length), but NaN garbage times a zero
        # softmax weight would still poison fp math in the torch reference path.
        self.data.zero_()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def k_cache(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]


def blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    return max(0, budget_bytes // spec.bytes_per_block)


def kv_cache_blocks(model: LlamaForCausalLM, config: EngineConfig, spec: KVCacheSpec) -> int:
    """How many blocks the cache gets: `num_kv_blocks` if set; else `kv_cache_bytes` if set (on a GPU refused
    past what is free after the weights and a measured warm-up); else on a GPU what `gpu_memory_utilization`
    of the device leaves after everything allocated there, the weights and the warm-up (nano-vllm's rule),
    on the CPU `cpu_kv_bytes`. Never more than `max_num_seqs` full-length sequences can use."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    useful = config.max_num_seqs * config.max_blocks_per_seq
    device = model.lm_head.weight.device
    if device.type != "cuda":
        return max(1, min(useful, blocks_for_budget(spec, config.kv_cache_bytes or config.cpu_kv_bytes)))
    free, total = torch.cuda.mem_get_info(device)
    peak = _activation_peak(model, config)
    if config.kv_cache_bytes is not None:
        if config.kv_cache_bytes > free - peak:
            raise EngineError(
                f"engine: a KV cache of {config.kv_cache_bytes / GIB:.2f} GiB does not fit: "
                f"{max(0, free - peak) / GIB:.2f} GiB are free on the GPU after the weights and a prefill's "
                "activations; give a smaller KV cache size"
            )
        budget, what = config.kv_cache_bytes, f"a KV cache of {config.kv_cache_bytes / GIB:.2f} GiB"
    else:
        budget = int(total * config.gpu_memory_utilization) - (total - free) - peak
        what = f"gpu_memory_utilization={config.gpu_memory_utilization}"
    blocks = min(useful, blocks_for_budget(spec, budget))
    if blocks < config.max_blocks_per_seq:
        raise EngineError(
            f"engine: only {blocks} KV blocks fit in {what} "
            f"(one max_model_len={config.max_model_len} sequence needs {config.max_blocks_per_seq}); raise "
            "the memory, lower max_model_len or max_num_batched_tokens, or set num_kv_blocks"
        )
    return blocks


@torch.inference_mode()
def _activation_peak(model: LlamaForCausalLM, config: EngineConfig) -> int:
    """Bytes beyond the weights that a prefill of max_num_batched_tokens needs, plus the decode logits buffer.
    Measured with the model's own SDPA path; the paged path allocates no more. Leaves the allocator's cache
    empty so that free memory is what the driver reports."""
    device = model.lm_head.weight.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    n = min(config.max_num_batched_tokens, config.max_model_len)
    hidden = model(torch.zeros((1, n), dtype=torch.int64, device=device))
    model.logits(hidden[:, -config.max_num_seqs :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden
    torch.cuda.empty_cache()
    logits_buf = config.max_num_seqs * model.config.vocab_size * model.lm_head.weight.element_size()
    return peak + logits_buf
