"""What a recipe asks of this machine and model, checked before a run loads anything big: the device, the
kernels, the sequence length, and how many optimizer steps the run makes."""

from __future__ import annotations

import logging
import math

import torch

from harli_train import kernels
from harli_train.config import RecipeConfig, RecipeError
from harli_train.model import ModelConfig

log = logging.getLogger(__name__)


def resolve_device(name: str, source: str = "config") -> torch.device:
    """``train.device`` as a torch device (``auto``: the GPU when there is one); a RecipeError for a device
    this machine lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError(
            source,
            "train.device",
            "a device this machine has ('auto' or 'cpu' here)",
            "'cuda', but no CUDA GPU is available",
        )
    return torch.device(name)


def check_seq_len(cfg: RecipeConfig, model: ModelConfig) -> None:
    """data.seq_len within the model's context: positions past it were never trained (and its RoPE scaling
    is defined up to it)."""
    context = model.max_position_embeddings
    if cfg.data.seq_len > context:
        expected = (
            f"an integer <= the context of model {cfg.model.name!r} "
            f"({context} tokens, its max_position_embeddings)"
        )
        raise RecipeError(cfg.source, "data.seq_len", expected, repr(cfg.data.seq_len))


def check_kernels(cfg: RecipeConfig, device: torch.device) -> None:
    """train.kernels=triton only where Triton kernels can run on the training device."""
    problem = kernels.triton_unavailable(device.type == "cuda") if cfg.train.kernels == "triton" else None
    if problem is not None:
        expected = (
            "'auto' or 'torch' on this machine (Triton kernels need a GPU, or Triton's CPU interpreter)"
        )
        raise RecipeError(cfg.source, "train.kernels", expected, f"'triton', but {problem}")


def run_length(cfg: RecipeConfig, batches_per_epoch: int) -> int:
    """The run's optimizer steps (``train.steps``, else ``train.epochs`` over the data); clamps
    ``train.warmup_steps`` below them in ``cfg``, with a warning, as other trainers do."""
    if cfg.train.steps is not None:
        total = cfg.train.steps
    else:
        total = max(1, math.ceil(cfg.train.epochs * batches_per_epoch / cfg.train.grad_accum))
    if cfg.train.warmup_steps >= total:
        log.warning(
            "train.warmup_steps (%d) is not below the run's %d steps: warming up for %d instead",
            cfg.train.warmup_steps,
            total,
            total - 1,
        )
        cfg.train.warmup_steps = total - 1
    return total


def check_cuda_graphs(cfg: RecipeConfig) -> None:
    """train.cuda_graphs with what it needs: no LoRA dropout
    (a graph replays the random masks differently)."""
    if cfg.train.cuda_graphs and cfg.lora.dropout > 0:
        raise RecipeError(
            cfg.source,
            "train.cuda_graphs",
            "false while lora.dropout > 0 "
            "(a captured step would draw other dropout masks than the eager one)",
            f"true with lora.dropout {cfg.lora.dropout}",
        )
