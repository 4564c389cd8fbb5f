"""StepGraphs: a training step's micro-steps as CUDA graphs,
one graph per micro-step, captured once per shape.

Launched eagerly, a micro-step costs the host a launch per kernel plus autograd's bookkeeping; co-located,
that host time is what the trainer's GPU work waits behind. Replayed, a micro-step is one graph launch.

Each batch shape has its own graphs (`ShapeGraphs`: the chain of micro-step graphs over static tensors, one
set per stream and SM budget, the saved-tensor arena); `StepGraphs` keeps up to ``MAX_SHAPES`` of them and
the adapter's gradient buffers, and `GraphedChunks` runs one step on them micro-step by micro-step, as
`train_step` asks, rebuilding a chunk's forward before its backward where no arena keeps what it saved.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from harli_train.kernels.launch_config import launch_gate
from harli_train.train.batch_buffers import KEYS, BatchBuffers
from harli_train.train.saved_arena import ArenaMemory
from harli_train.train.shape_graphs import GraphCaptureError, ShapeGraphs, set_key

log = logging.getLogger(__name__)
# Graph sets kept (one per batch shape; each holds one micro-batch's activations): loaders give one shape.
MAX_SHAPES = 2


class StepGraphs:
    """The CUDA graphs of a trainer's steps (per batch shape, one set per stream and SM budget) and the
    adapter's gradient buffers.

    `step(...)` hands `train_step` the executor of one step. The adapter's gradients are accumulated in
    buffers of their own and handed to the parameters' ``.grad`` when the step's last backward has been
    launched; the buffers are zeroed at the next step's start, so the caller may clip, step and set the
    gradients to None as usual. ``arena`` (this class's default; the trainer passes ``trainer.GRAPHS_ARENA``):
    what the forwards save lives in a ``SavedArena`` every set shares, so no forward is ever replayed twice;
    without it ``rebuilds`` counts the chunks whose forward was replayed again before their backward (their
    forward ran on another set).
    """

    def __init__(self, params: list[torch.nn.Parameter], arena: bool = True) -> None:
        self.params = list(params)
        self.grads = {id(p): torch.zeros_like(p) for p in self.params}
        self.shapes: dict[tuple, ShapeGraphs] = {}
        self.rebuilds = 0
        self.arena = arena
        self.memory: ArenaMemory | None = None
        self.capture: Callable[[], contextlib.AbstractContextManager] | None = None

    def use_memory(
        self,
        memory: ArenaMemory | None,
        capture: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        """Place the arena's slots in ``memory`` (None: torch's allocator) and enter ``capture()`` around each
        capture, which yields the memory pool to capture into (``TrainerMemory.capture``; None: a pool of
        the graphs' own), from the next step on; the graphs made so far are dropped (call with none of their
        replays queued)."""
        self.clear()
        self.memory, self.capture = memory, capture

    def clear(self) -> None:
        """Drop every shape's graphs, static tensors and arena, also where a step in flight still refers to
        its shape (that step cannot go on); the next step captures afresh."""
        for shape in self.shapes.values():
            shape.release()
        self.shapes.clear()

    @property
    def rebuilds_on_move(self) -> bool:
        """Whether a backward on another set than its chunk's forward replays that forward first (without
        the saved-tensor arena); with it the trainer may move between sets mid-micro-batch for free."""
        return not self.arena

    @property
    def arena_bytes(self) -> int:
        """Bytes of the saved-tensor arenas (one per batch shape)."""
        return sum(s.arena.nbytes for s in self.shapes.values() if s.arena is not None)

    @property
    def captures(self) -> int:
        """Sets of graphs made so far."""
        return sum(len(shape.sets) for shape in self.shapes.values())

    def step(self, model, bounds, autocast, buffers: BatchBuffers, total_targets: int) -> GraphedChunks:
        return GraphedChunks(self, model, bounds, autocast, buffers, total_targets)

    def shape_graphs(self, model, bounds, autocast, inputs: dict) -> ShapeGraphs:
        """The static tensors (and sets of graphs) that read ``inputs``; new buffers start afresh."""
        key = (tuple(bounds), tuple((k, tuple(t.shape)) for k, t in sorted(inputs.items())))
        found = self.shapes.get(key)
        if found is not None and found.fits(inputs):
            return found
        if found is None and len(self.shapes) >= MAX_SHAPES:
            raise GraphCaptureError(
                f"a batch of a new shape after {MAX_SHAPES} (each shape keeps its own graphs and activations)"
            )
        self.shapes[key] = found = ShapeGraphs(
            model, bounds, autocast, inputs, self.grads, self.arena, self.memory, self.capture
        )
        log.info(
            "trainer step as CUDA graphs: %d micro-steps a micro-batch (batch %s)", len(found.order()), key[1]
        )
        return found


class GraphedChunks:
    """`train_step`'s executor over `StepGraphs`: each call replays graphs of the set of the stream and SM
    budget current at the call (the eager one: `EagerChunks`)."""

    def __init__(self, owner: StepGraphs, model, bounds, autocast, buffers: BatchBuffers, total_targets):
        self.owner, self.model, self.bounds, self.autocast = owner, model, bounds, autocast
        self.buffers, self.total_targets = buffers, total_targets
        self.shape: ShapeGraphs | None = None
        self.key: tuple[int, int] | None = None  # the set the last replay came from
        self.saved: set[int] = set()  # chunks whose saved tensors that set holds

    def load(self, batch: dict) -> int:
        """Copy a micro-batch into the static buffers; returns its input tokens."""
        loaded = self.buffers.load(batch)
        inputs = {k: loaded[k] for k in KEYS if loaded.get(k) is not None}
        shape = self.owner.shape_graphs(self.model, self.bounds, self.autocast, inputs)
        if self.shape is None:  # the step's first micro-batch: fresh sums
            torch._foreach_zero_(list(self.owner.grads.values()))
            shape.loss_sum.zero_()
            shape.targets.fill_(float(self.total_targets))
        elif shape is not self.shape:
            raise GraphCaptureError("the micro-batches of one step differ in shape")
        self.shape = shape
        return loaded["input_ids"].numel()

    def _graphs(self) -> dict[str, Any]:
        key = set_key()
        graphs = self.shape.set_for(key)
        if key != self.key:
            self.key = key
            if self.shape.arena is None:  # another set's replays may have reused the saved tensors' memory
                self.saved = set()
        launch_gate()
        return graphs

    def forward(self, chunk: int) -> None:
        graphs = self._graphs()
        if self.shape.memory is not None:
            self.shape.memory.arena_before(chunk, False)
        graphs[f"fwd{chunk}"].replay()
        self.saved.add(chunk)

    def loss(self) -> None:
        self._graphs()["loss"].replay()

    def backward(self, mb: int, chunk: int) -> None:
        graphs = self._graphs()
        if chunk not in self.saved:  # its forward ran on another set: run it again here
            graphs[f"fwd{chunk}"].replay()
            self.owner.rebuilds += 1
        memory = self.shape.memory
        if memory is not None:
            memory.arena_before(chunk, True)
        graphs[f"bwd{chunk}"].replay()
        if memory is not None:
            memory.arena_after_backward(chunk)
        self.saved.discard(chunk)

    def end(self) -> torch.Tensor:
        """The step's summed token loss (a copy); the gradients are handed to the parameters' `.grad`."""
        for p in self.owner.params:
            p.grad = self.owner.grads[id(p)]
        return self.shape.loss_sum.clone()
