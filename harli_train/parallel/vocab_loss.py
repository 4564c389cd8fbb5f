"""Cross-entropy through a vocab-parallel LM head: no rank ever holds the whole [tokens, vocab] logits.

Rank r holds head rows [r V/N, (r+1) V/N) (padding rows past the vocabulary masked out). Per chunk of tokens:
local logits z = h W_r^T in fp32; the row max and the sum of exp(z - max) are combined over the ranks (a max
and a sum all-reduce), and so is the target's logit (only its owner has it, the others add 0). The loss of a
token is logsumexp - z_target. Backward recomputes z per chunk: dL/dz = softmax(z) - onehot(target) on each
rank's columns, dL/dh = dL/dz W_r is a partial sum, summed over the ranks (the head's input is replicated).
The head is frozen: no weight gradient. Equals ``kernels.linear_cross_entropy`` up to the order of fp32 sums.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from harli_train.parallel.collectives import all_reduce

CHUNK_TOKENS = 2048  # tokens per chunk: [CHUNK_TOKENS, V/N] fp32 logits at a time


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, valid: int) -> torch.Tensor:
    z = h.float() @ weight.float().t()
    if valid < z.shape[1]:
        z[:, valid:] = float("-inf")  # vocabulary padding
    return z


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, start: int, valid: int, ignore_index: int, group: Any):
        lses, total = [], torch.zeros((), dtype=torch.float32, device=hidden.device)
        for i in range(0, hidden.shape[0], CHUNK_TOKENS):
            h, y = hidden[i : i + CHUNK_TOKENS], labels[i : i + CHUNK_TOKENS]
            z = _chunk_logits(h, weight, valid)
            m = all_reduce(z.max(dim=1).values, group, dist.ReduceOp.MAX)
            s = all_reduce(torch.exp(z - m[:, None]).sum(dim=1), group)
            local = y - start
            mine = (local >= 0) & (local < valid)
            target = torch.where(mine, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
            target = all_reduce(target, group)
            lse = m + torch.log(s)
            keep = y != ignore_index
            total += torch.where(keep, lse - target, 0.0).sum()
            lses.append(lse)
        ctx.save_for_backward(hidden, weight, labels, torch.cat(lses) if lses else hidden.new_zeros(0))
        ctx.args = (start, valid, ignore_index, group)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, lse = ctx.saved_tensors
        start, valid, ignore_index, group = ctx.args
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        w = weight.float()
        for i in range(0, hidden.shape[0], CHUNK_TOKENS):
            h, y = hidden[i : i + CHUNK_TOKENS], labels[i : i + CHUNK_TOKENS]
            p = torch.exp(_chunk_logits(h, weight, valid) - lse[i : i + CHUNK_TOKENS, None])
            local = y - start
            mine = (local >= 0) & (local < valid)
            rows = torch.nonzero(mine)[:, 0]
            p[rows, local[rows]] -= 1.0
            p *= (y != ignore_index).float()[:, None] * grad_total
            grad_h[i : i + CHUNK_TOKENS] = p @ w
        return all_reduce(grad_h, group).to(hidden.dtype), None, None, None, None, None, None


def vocab_parallel_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    start: int,
    valid: int,
    group: Any,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sum of token losses (fp32) of hidden [N, H] through this rank's head rows ``weight`` [V/N, H], whose
    first ``valid`` rows are the vocabulary ids from ``start`` on; labels [N] already shifted."""
    return _VocabParallelCE.apply(hidden, weight, labels, start, valid, ignore_index, group)
