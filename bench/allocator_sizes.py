"""bench_allocator's sizes (the GPU's and the dry run's), and the helpers its sections share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harli_train.memory import PagePool

MIB = 1 << 20


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class EngineLoad:
    """The decode engine's load: `prompts` prompts of ragged lengths arriving in bursts of `burst`, one burst
    every `gap` engine steps, each decoding `new_tokens` tokens greedily."""

    preset: str
    dtype: torch.dtype
    prompts: int
    prompt_lens: tuple[int, int]  # least and most tokens
    new_tokens: int
    burst: int
    gap: int


@dataclass(frozen=True)
class Sizes:
    backend: str
    device: str
    page: int  # the host backend's page; on CUDA the pool reports the driver's (2 MiB on the H200)
    cost_pages: int  # pages mapped one by one for the per-page figures
    run_pages: int  # one run of consecutive pages: 64 x 2 MiB = 128 MiB on the GPU
    kv_spec: KVSpec
    kv_groups: int
    mlp: tuple[int, int, int, int]  # layers, width, hidden, tokens
    mlp_dtype: torch.dtype
    reclaim_bytes: int
    reps: int
    steps: int  # training steps of the loss comparison
    engine: EngineLoad


GPU = Sizes(
    backend="cuda", device="cuda", page=2 * MIB, cost_pages=256, run_pages=64,
    kv_spec=KVSpec(32, (16, 8, 128), torch.bfloat16), kv_groups=9,  # Llama-3-8B KV: 128 MiB per group
    mlp=(12, 4096, 8192, 4096), mlp_dtype=torch.bfloat16, reclaim_bytes=1024 * MIB, reps=5, steps=8,
    engine=EngineLoad("llama-1b", torch.bfloat16, prompts=16, prompt_lens=(64, 2048), new_tokens=64,
                      burst=2, gap=30),  # 128 blocks (2048 tokens) per 2 MiB page
)  # fmt: skip
DRY = Sizes(
    backend="host", device="cpu", page=64 * 1024, cost_pages=32, run_pages=16,
    kv_spec=KVSpec(2, (16, 2, 64), torch.float32), kv_groups=5,
    mlp=(8, 256, 512, 256), mlp_dtype=torch.float32, reclaim_bytes=4 * MIB, reps=2, steps=3,
    engine=EngineLoad("tiny", torch.float32, prompts=8, prompt_lens=(16, 160), new_tokens=12, burst=2, gap=8),
)  # fmt: skip


def make_pool(sz: Sizes, budget: int) -> PagePool:
    pool = PagePool(budget, backend=sz.backend, host_page_bytes=sz.page)
    if pool.page_bytes != sz.page:
        raise RuntimeError(f"the pool's page is {pool.page_bytes} bytes, these sizes assume {sz.page}")
    return pool


def delta(before: dict, after: dict, call: str) -> tuple[float, int]:
    return after[f"{call}_us"] - before[f"{call}_us"], after[f"{call}_calls"] - before[f"{call}_calls"]
