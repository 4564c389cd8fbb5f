"""Decode engine settings: KV cache geometry, batch limits, graphs and kernels."""

from __future__ import annotations

from dataclasses import dataclass, replace

# decode_linear's bandwidth-shaped GEMV serves steps of up to this many rows (tokens); past it cuBLAS does,
# and an adapter's deltas take launches of their own (decode_forward.LoRAAdds).
MAX_GEMV_ROWS = 64

GIB = 1 << 30
KERNEL_BACKENDS = ("auto", "triton", "torch")
LORA_KERNELS = ("gemv", "fused", "split")


class EngineError(ValueError):
    """An engine setting or request the engine cannot use; the message names the setting and the limit."""


@dataclass(slots=True)
class EngineConfig:
    """Settings of one `DecodeEngine`.

    The KV cache holds `num_kv_blocks` blocks of `block_size` tokens; when `num_kv_blocks` is None it gets
    `kv_cache_bytes` if set (refused past the memory free for it), else it is sized from the memory left
    after the weights and a warm-up (GPU: `gpu_memory_utilization` of the device, less what every process
    already holds there; CPU: `cpu_kv_bytes`). Either way never more than `max_num_seqs` sequences of
    `max_model_len` tokens can use. A step computes at most `max_num_batched_tokens` tokens; longer prompts
    are prefilled in chunks. With `mixed_prefill` (stall-free) prefill chunks ride in decode steps, at most
    `prefill_chunk_tokens` of them per step unless the caller of `step()` names another budget; a step with
    nothing to decode is a pure prefill step. Without it a step is either prefill or decode (prefill first).
    With `max_loras` > 0 each request may name an adapter slot (1..max_loras; 0 is the base model).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # The KV cache's own size (vLLM's kv_cache_memory_bytes): a fixed figure for engines that share a GPU.
    kv_cache_bytes: int | None = None
    cpu_kv_bytes: int = 256 << 20
    max_model_len: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Off for an engine of its own (prefill first, nano-vllm's order); the co-located assembly turns it on
    # (`colocation.mixed_prefill`), where each mixed step's chunk is sized to the objective by the predictor.
    mixed_prefill: bool = False
    prefill_chunk_tokens: int = 512
    # KV slots kept free for every running sequence's next this many tokens (never past its last): a prompt
    # is admitted only when its blocks and, after it, those are free, so that the running sequences grow that
    # far without a preemption (while a pooled cache grows, or others finish). 0: admit while the prompt fits.
    decode_reserve_tokens: int = 0
    enforce_eager: bool = False
    kernels: str = "auto"  # "triton", "torch" (references), or "auto": triton on a GPU, torch on the CPU
    graph_batch_sizes: tuple[int, ...] = ()  # derived from max_num_seqs when empty
    # Decode steps run the projections through the engine's bandwidth-shaped GEMV kernels (DecodeForward)
    # whenever Triton kernels are on; False keeps the model's own forward (cuBLAS) for comparison.
    decode_gemv: bool = True
    # Varlen (mixed and prefill) steps run the decode step's kernels over their packed tokens: the GEMV
    # projections (with decode_gemv) and, for one-token rows, the split decode attention. False runs them
    # through the model's own forward and the prefill attention kernel alone, for comparison (bench_mixed).
    varlen_decode_kernels: bool = True
    seed: int = 0  # seeds sampling of requests that bring no seed of their own
    # Overlap the host's work with the GPU's: while decode step N runs, step N+1 (the same sequences, fed
    # N's tokens on the device) is launched before N's tokens are read back. None: on with CUDA graphs.
    overlap: bool | None = None
    # Adapter slots (besides the base model) that requests may name, each of rank <= max_lora_rank;
    # 0 allocates nothing and the engine serves the base only.
    max_loras: int = 0
    max_lora_rank: int = 16
    # How a decode step's projection computes its adapters' delta (Triton kernels only): before it, as an
    # fp32 addend, with "split" (a shrink and an expand launch) or "fused" (one launch: each program shrinks
    # over the whole K, then expands); or "gemv", inside the projection's own launches (the shrink as extra
    # row tiles of the GEMV, the expand in its split-sum kernel on tiles of rows grouped by slot). gemv costs
    # the least over the base TPOT (docs/design.md, "Measured facts behind the defaults").
    lora_kernel: str = "gemv"

    def __post_init__(self) -> None:
        names = (
            "block_size",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_tokens",
        )
        for name in names:
            if getattr(self, name) < 1:
                raise EngineError(f"engine config: {name} must be >= 1, got {getattr(self, name)}")
        if self.decode_reserve_tokens < 0:
            raise EngineError(
                f"engine config: decode_reserve_tokens must be >= 0, got {self.decode_reserve_tokens}"
            )
        if self.max_loras < 0:
            raise EngineError(f"engine config: max_loras must be >= 0, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 256:
            raise EngineError(f"engine config: max_lora_rank must be in 1..256, got {self.max_lora_rank}")
        if self.block_size & (self.block_size - 1):
            raise EngineError(f"engine config: block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise EngineError(f"engine config: num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise EngineError(f"engine config: kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineError(
                f"engine config: gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.lora_kernel not in LORA_KERNELS:
            raise EngineError(
                f"engine config: lora_kernel is one of {LORA_KERNELS}, got {self.lora_kernel!r}"
            )
        if self.kernels not in KERNEL_BACKENDS:
            raise EngineError(f"engine config: kernels is one of {KERNEL_BACKENDS}, got {self.kernels!r}")
        if not self.graph_batch_sizes:
            # nano-vllm's ladder: small powers of two, then steps of 16.
            sizes = [b for b in (1, 2, 4, 8) if b < self.max_num_seqs]
            sizes += list(range(16, self.max_num_seqs, 16))
            self.graph_batch_sizes = (*sizes, self.max_num_seqs)
        self.graph_batch_sizes = tuple(sorted(set(self.graph_batch_sizes)))
        if self.graph_batch_sizes[-1] < self.max_num_seqs:
            raise EngineError(
                f"engine config: the largest graph batch size ({self.graph_batch_sizes[-1]}) must cover "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def capped_to_context(config: EngineConfig, context: int) -> EngineConfig:
    """`config` with `max_model_len` no longer than the model's `context` (its max_position_embeddings), as
    nano-vllm caps it: positions past the context were never trained, and sizing for a longer request than
    the model takes would let one trace line size buffers (and a prefill) past memory. A longer request is
    refused instead. Returns `config` itself when it already fits."""
    if config.max_model_len <= context:
        return config
    return replace(config, max_model_len=context)


def gib_bytes(gib: float | None) -> int | None:
    """A size given in GiB (a command-line option) as bytes; None stays None."""
    return None if gib is None else int(gib * GIB)
