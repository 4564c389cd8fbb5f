"""One optimizer step as a generator of micro-steps, so that a runtime can interleave it with decode steps.

The forward pass of each micro-batch runs in chunks of `layers_per_microstep` layers; each chunk's inputs
are cut from the autograd graph (detached leaves that require grad), so the backward pass can run chunk by
chunk in reverse, carrying the gradient of the boundary tensors by hand. This changes when work is launched,
never what is computed: gradients equal those of one whole-graph backward.

Autograd runs a chunk's backward on the stream its forward ran on. A runtime that has since given that
stream's SMs to someone else asks (``recompute``) for the chunk to be rebuilt instead: its forward runs
again from the saved input, on the current stream, and the backward follows it there (the RNG is replayed,
so dropout draws the same masks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from harli_train.model.attention import DocumentAttention
from harli_train.model.llama import LlamaForCausalLM
from harli_train.train.batch_buffers import BatchBuffers
from harli_train.train.trainer_state import rng_state, set_rng_state

if TYPE_CHECKING:
    from harli_train.train.step_graphs import StepGraphs

IGNORE_INDEX = -100


@dataclass(slots=True)
class MicroStep:
    """What the micro-step just launched: `phase` is fwd, loss, bwd or optim; layers [start, stop)."""

    phase: str
    micro_batch: int
    start: int = 0
    stop: int = 0


@dataclass(slots=True)
class StepResult:
    loss_sum: torch.Tensor  # sum of token losses over the step (fp32, on device)
    target_tokens: int
    input_tokens: int


def _leaf(t: torch.Tensor | None, grad: bool = True) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_(grad)


@contextlib.contextmanager
def _replaying(state: dict | None):
    """Run the block from RNG ``state`` (None: as is), then put the generators back where they were."""
    if state is None:
        yield
        return
    now = rng_state()
    set_rng_state(state)
    try:
        yield
    finally:
        set_rng_state(now)


def model_inputs(
    model: LlamaForCausalLM, batch: dict, device: torch.device, buffers: BatchBuffers | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DocumentAttention | None]:
    """A batch on `device` as the layers take it: (input_ids, labels, cos, sin, attention context), its
    tensors copied into `buffers` when given (else moved as they are).

    `positions` [B, T] and `doc_ids` [B, T] come with a packed batch (`harli_train.data.loader`): the rope
    tables follow the positions, and `doc_ids` give the block-diagonal mask (`DocumentAttention`). A batch
    without them is one sequence per row: positions 0..T-1, plain causal attention.
    """
    if buffers is not None:
        batch = buffers.load(batch)
    ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    positions = batch.get("positions")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
    cos, sin = model.rope(positions.to(device, non_blocking=True))
    doc_ids = batch.get("doc_ids")
    attn = None if doc_ids is None else DocumentAttention(doc_ids.to(device, non_blocking=True))
    return ids, labels, cos, sin, attn


def chunk_bounds(num_layers: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + per_chunk, num_layers)) for s in range(0, num_layers, per_chunk)]


def step_order(num_layers: int, layers_per_microstep: int, micro_batches: int) -> list[MicroStep]:
    """The micro-steps of one training step in the order they run: per micro-batch its forward chunk by
    chunk, its loss, its backward chunk by chunk in reverse; then the optimizer update ("optim", the
    trainer's). `train_step` runs this order; whoever needs to know what comes next asks it."""
    bounds = chunk_bounds(num_layers, layers_per_microstep)
    order: list[MicroStep] = []
    for mb in range(micro_batches):
        order += [MicroStep("fwd", mb, start, stop) for start, stop in bounds]
        order.append(MicroStep("loss", mb, num_layers, num_layers))
        order += [MicroStep("bwd", mb, start, stop) for start, stop in reversed(bounds)]
    order.append(MicroStep("optim", micro_batches - 1))
    return order


class EagerChunks:
    """How `train_step` runs its micro-steps by default: each chunk's forward under autograd from detached
    leaves, its backward by `torch.autograd.backward` from the boundary gradients carried by hand.

    `recompute`, `stash` and `replay` are `train_step`'s; the gradients land in the parameters' `.grad`.
    """

    def __init__(self, model, bounds, autocast, recompute, buffers, stash, total_targets, replay):
        self.model, self.bounds, self.autocast, self.buffers = model, bounds, autocast, buffers
        self.recompute, self.replay, self.total_targets = recompute, replay, total_targets
        self.kept = stash or (lambda chunk: contextlib.nullcontext())
        self.device = model.lm_head.weight.device
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)

    def load(self, batch: dict) -> int:
        """Start a micro-batch; returns its input tokens."""
        self.ids, self.labels, self.cos, self.sin, self.attn = model_inputs(
            self.model, batch, self.device, self.buffers
        )
        self.saved, self.rng = [], []
        self.hidden, self.residual = self.model.embed(self.ids), None
        return self.ids.numel()

    def forward(self, chunk: int) -> None:
        start, stop = self.bounds[chunk]
        # The embedding is frozen: the first chunk needs no gradient for its input.
        h_in, r_in = _leaf(self.hidden, start > 0), _leaf(self.residual)
        if self.replay:
            self.rng.append(rng_state())
        with self.kept(chunk), self.autocast():
            self.hidden, self.residual = self.model.run_layers(
                start, stop, h_in, r_in, self.cos, self.sin, self.attn
            )
        self.saved.append([h_in, r_in, self.hidden, self.residual])

    def loss(self) -> None:
        # Head and loss: the fused kernel never materialises the [tokens, vocab] logits.
        h_in, r_in = _leaf(self.hidden), _leaf(self.residual)
        # The last chunk's graph lives in `saved` alone (a rebuild frees it).
        self.hidden = self.residual = None
        model = self.model
        with self.autocast():
            normed = model.final_norm(h_in, r_in)
            shifted = normed[:, :-1].reshape(-1, normed.shape[-1])
            mb_loss = model.token_loss(shifted, self.labels[:, 1:].reshape(-1), IGNORE_INDEX)
        (mb_loss / self.total_targets).backward()
        self.loss_sum += mb_loss.detach().float()
        self.grads = (h_in.grad, r_in.grad)

    def backward(self, mb: int, i: int) -> None:
        (start, stop), (h_in, r_in, h_out, r_out) = self.bounds[i], self.saved[i]
        if self.recompute is not None and self.recompute(mb, start):
            self.saved[i][2:] = h_out, r_out = None, None  # frees the stranded graph before its rebuild
            with _replaying(self.rng[i] if self.replay else None), self.kept(i), self.autocast():
                h_out, r_out = self.model.run_layers(start, stop, h_in, r_in, self.cos, self.sin, self.attn)
        outs = [h_out] if r_out is None else [h_out, r_out]
        torch.autograd.backward(outs, list(self.grads[: len(outs)]))
        self.grads = (h_in.grad, None if r_in is None else r_in.grad)
        self.saved[i] = h_out = r_out = None

    def end(self) -> torch.Tensor:
        """The step's summed token loss; the gradients are in the parameters' `.grad`."""
        self.saved = self.grads = None
        return self.loss_sum


def train_step(
    model: LlamaForCausalLM,
    batches: list[dict],
    layers_per_microstep: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    recompute: Callable[[int, int], bool] | None = None,
    buffers: BatchBuffers | None = None,
    stash: Callable[[int], contextlib.AbstractContextManager] | None = None,
    graphs: StepGraphs | None = None,
) -> Generator[MicroStep, None, StepResult]:
    """Accumulate gradients of the mean token loss over `batches` (the micro-batches of one step).

    The loss is normalised by the target tokens of the whole step, so gradient accumulation gives the
    same gradient as one large batch. Leaves gradients in the LoRA parameters; the caller steps the optimizer.
    `recompute(micro_batch, start)`, asked just before the backward of the chunk starting at layer `start`,
    says whether to rebuild that chunk's forward graph first (on the stream current at that moment).
    `buffers` (optional) hold each micro-batch's inputs on the device (`BatchBuffers`).
    `stash(i)` (optional) is entered around chunk i's forward (and its rebuild): where the tensors it saves
    for backward are kept (the co-located page pool's ``ActivationSwapper.layer``); it moves bytes, never
    changes them.
    `graphs` (optional, with `buffers`): run each micro-step as replays of CUDA graphs (`StepGraphs`), which
    compute the same; the graphs rebuild a chunk whose backward runs on another stream than its forward by
    themselves, so `recompute` is never asked; `stash` must be None.
    """
    total_targets = sum(int(b["num_target_tokens"]) for b in batches)
    if total_targets == 0:
        raise ValueError("a training step has no target tokens (every label is ignored)")
    bounds = chunk_bounds(model.config.num_layers, layers_per_microstep)
    if graphs is not None:
        if stash is not None or buffers is None:
            raise ValueError("train_step: graphs need the batch buffers, and cannot stash activations")
        run = graphs.step(model, bounds, autocast, buffers, total_targets)
    else:
        # A rebuilt chunk must draw the random numbers its first forward drew (dropout).
        replay = recompute is not None and any(
            getattr(m, "dropout", 0.0) > 0.0 and m.training for m in model.modules()
        )
        run = EagerChunks(model, bounds, autocast, recompute, buffers, stash, total_targets, replay)
    input_tokens = 0
    for ms in step_order(model.config.num_layers, layers_per_microstep, len(batches))[:-1]:
        chunk = ms.start // layers_per_microstep
        if ms.phase == "fwd":
            if chunk == 0:
                input_tokens += run.load(batches[ms.micro_batch])
            run.forward(chunk)
        elif ms.phase == "loss":
            run.loss()
        else:
            run.backward(ms.micro_batch, chunk)
        yield ms
    return StepResult(loss_sum=run.end(), target_tokens=total_targets, input_tokens=input_tokens)


def eval_step(
    model: LlamaForCausalLM,
    batches: list[dict],
    layers_per_microstep: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    buffers: BatchBuffers | None = None,
) -> Generator[MicroStep, None, tuple[float, int]]:
    """The loss of `batches` (an evaluation set), as micro-steps ("eval", one per chunk of layers) that a
    runtime can interleave with decode steps like a training step's; returns (mean token loss, target tokens).

    Runs the model in eval mode (no dropout, so no random numbers are drawn: the training RNG is untouched)
    without autograd, and puts it back in the mode it was in, however the generator ends. Grad mode is
    switched off per chunk, never across a yield (it is the calling thread's state).
    """
    bounds = chunk_bounds(model.config.num_layers, layers_per_microstep)
    device = model.lm_head.weight.device
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    targets = sum(int(b["num_target_tokens"]) for b in batches)
    was_training = model.training
    model.eval()
    try:
        for mb, batch in enumerate(batches):
            ids, labels, cos, sin, attn = model_inputs(model, batch, device, buffers)
            with torch.no_grad():
                hidden, residual = model.embed(ids), None
            for start, stop in bounds:
                with torch.no_grad(), autocast():
                    hidden, residual = model.run_layers(start, stop, hidden, residual, cos, sin, attn)
                yield MicroStep("eval", mb, start, stop)
            with torch.no_grad(), autocast():
                normed = model.final_norm(hidden, residual)
                mb_loss = model.token_loss(
                    normed[:, :-1].reshape(-1, normed.shape[-1]), labels[:, 1:].reshape(-1), IGNORE_INDEX
                )
            loss_sum += mb_loss.float()
    finally:
        model.train(was_training)
    return (loss_sum.item() / targets if targets else float("nan")), targets
