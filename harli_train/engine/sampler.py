"""Next-token choice on the device: greedy, or temperature + top-p with per-request seeds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from harli_train.engine.sequence import Sequence

_MASK32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on 32-bit values held in int64 (products stay below 2**63).
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1), a pure function of (seed, position, token id): a request's draws do not
    depend on its batch-mates, nor change when it is preempted and recomputed."""
    seed_bits = ((seeds & 0x7FFFFFFF) * 0x9E3779B1) & _MASK32
    row = _fmix32(seed_bits ^ (((positions & 0x7FFFFFFF) * 0x85EBCA77) & _MASK32))
    cols = (torch.arange(vocab, device=seeds.device, dtype=torch.int64) * 0xC2B2AE3D) & _MASK32
    x = _fmix32(_fmix32((row[:, None] + cols[None, :]) & _MASK32))
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling inputs of one step (device tensors); None rows-wide means all greedy."""

    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_ps: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: index of the token being drawn
    any_top_p: bool
    top_ks: torch.Tensor | None = None  # [B] int64, 0 = no cut; None: no row cuts
    max_top_k: int = 0  # the largest of them (host side: no device sync to size the cut)


def sampling_batch(
    seqs: list[Sequence],
    offsets: list[int],
    seed: int,
    to_device: Callable[[list, torch.dtype], torch.Tensor],
) -> SamplingBatch | None:
    """The sampling inputs of `seqs`, each drawing the token at index len(seq) + its offset (1: a row
    launched ahead of the token before it), made device tensors by `to_device`; None when every one is
    greedy. A request without a seed draws from the engine's `seed` and its sequence id."""
    if all(s.params.greedy for s in seqs):
        return None
    seeds = [s.params.seed if s.params.seed is not None else seed * 1_000_003 + s.seq_id for s in seqs]
    return SamplingBatch(
        temperatures=to_device([s.params.temperature for s in seqs], torch.float32),
        top_ps=to_device([s.params.top_p for s in seqs], torch.float32),
        seeds=to_device(seeds, torch.int64),
        positions=to_device([len(s) + off for s, off in zip(seqs, offsets, strict=True)], torch.int64),
        any_top_p=any(s.params.top_p < 1.0 for s in seqs),
        top_ks=to_device([s.params.top_k for s in seqs], torch.int64)
        if any(s.params.top_k for s in seqs)
        else None,
        max_top_k=max(s.params.top_k for s in seqs),
    )


# The cuts `_largest` takes: torch's top-k launches other kernels as k grows, and a kernel's first launch
# in a context waits for the device's queued work, so every k of a bucket runs the bucket's (warmed-up)
# kernels; a k above the last bucket sorts the whole row, as top-p does.
TOP_K_BUCKETS = (64, 1024)


def _largest(probs: torch.Tensor, k: int) -> torch.Tensor:
    """[B, >= k] each row's largest values of ``probs`` in descending order (at least the k largest)."""
    vocab = probs.shape[-1]
    cut = next((b for b in TOP_K_BUCKETS if k <= b), None)
    if cut is None or cut >= vocab:
        return probs.sort(dim=-1, descending=True).values
    return probs.topk(cut, dim=-1).values


class Sampler:
    """logits [B, V] -> token ids [B] (int64, on the logits' device)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch | None) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if batch is None:
            return greedy
        temps = batch.temperatures
        is_greedy = temps == 0
        probs = torch.softmax(logits.float() / torch.where(is_greedy, 1.0, temps)[:, None], dim=-1)
        if batch.top_ks is not None:
            probs = self._top_k(probs, batch.top_ks, batch.max_top_k)
        if batch.any_top_p:
            probs = self._top_p(probs, batch.top_ps)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) draws token i with probability p_i.
        noise = -torch.log(hashed_uniform(batch.seeds, batch.positions, logits.shape[-1]))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def _top_k(probs: torch.Tensor, top_ks: torch.Tensor, k_max: int) -> torch.Tensor:
        # Keep each row's k most likely tokens (ties at the k-th kept too); k = 0 keeps every token.
        kth = _largest(probs, k_max)
        threshold = kth.gather(-1, (top_ks.clamp(min=1, max=kth.shape[-1]) - 1)[:, None])
        threshold = torch.where(top_ks[:, None] > 0, threshold, torch.zeros_like(threshold))
        return probs.masked_fill(probs < threshold, 0.0)

    @staticmethod
    def _top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always stays).
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before > top_ps[:, None], 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
