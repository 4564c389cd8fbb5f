"""ShapeGraphs: the static tensors and CUDA graphs of one batch shape of a training step, one set of graphs
per (stream, SM budget) the trainer launches on.

The graphs of one batch shape form a chain over static tensors allocated once:

- ``fwd[0]`` reads the batch buffers (`BatchBuffers`: token ids, labels, positions, document ids) and writes
  the embeddings, rope tables and attention mask to static tensors, then runs chunk 0;
- ``fwd[i]`` runs chunk i from the static boundary tensors ``h[i], r[i]`` under autograd and copies its
  outputs into ``h[i+1], r[i+1]``; the tensors it saves for backward are copied into the saved-tensor
  arena's slots of chunk i (`SavedArena`);
- ``loss`` takes ``h[C], r[C]`` through the final norm and the fused head loss, divides by the step's target
  tokens (a static tensor) and writes the boundary gradients ``gh[C], gr[C]`` and the summed loss;
- ``bwd[i]`` is autograd's backward of chunk i, captured: it reads ``gh[i+1], gr[i+1]`` and the saved
  tensors, writes ``gh[i], gr[i]`` and adds the adapter gradients of its layers to static gradient buffers.

A graph runs on the SMs of the stream it was captured on (a green context's stream confines it), and its
kernels keep the grids of the SM budget it was captured under. So there is one set of graphs per (stream,
SM budget) the trainer launches on: a partition's stream, or a side stream for the default one. The sets of
one shape share the static tensors, one memory pool and the arena. Within a set, every replay order is its
capture order (fwd 0..C-1, loss, bwd C-1..0 per micro-batch). Every set saves the same tensors into the same
slots, so a chunk's backward may run on another set than its forward (the trainer's SMs moved mid-micro-batch)
and read what that forward saved; a set's pool holds only what its graphs use while they run. Without the
arena (``StepGraphs(arena=False)``) a set keeps its forwards' saved tensors in the shared pool, where
another set's replays may reuse their memory, so such a backward is rebuilt first: that set's forward of the
chunk again, from the static boundary tensors, then its backward (`GraphedChunks`). (Sets never keep a
chunk's saved tensors at the same addresses by chance: torch's allocator reuses a freed block only on the
stream that freed it, and every set captures on its own stream.) The numbers equal the eager path's
(`EagerChunks`) under the same budget: the same kernels on the same inputs, the adapter gradients
accumulated micro-batch by micro-batch in the same order.

A set is captured the first time its (stream, budget) is met: an eager pass over the current micro-batch
(it compiles the kernels and sets up cuBLAS on that stream; the static tensors and sums it touches are put
back), then one capture per micro-step on that stream, which no other thread may launch onto meanwhile
(the co-location warm-up captures every rung's set before serving; temporal's trainer shares decode's
stream). A capture that fails, or a batch shape the graphs cannot take, raises `GraphCaptureError`: the
trainer then goes on without graphs. A recipe with LoRA dropout is refused (`check_cuda_graphs`: a graph
would replay its random masks differently from the eager path). The adapter's masters are cast to the
compute dtype inside the graphs (`kernels.lora_linear`), so every replay reads them as the optimizer left
them. On a CPU the graphs are stand-ins that run the captured function again over the same static tensors,
one set per SM budget, each replay (without the arena) dropping what another set's forwards left
(`_StandIn`): the chain, the accumulation, the order, the arena's slots and the rebuilds are what the CPU
tests check.

"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from harli_train import kernels
from harli_train.cuda_capture import capturing
from harli_train.model.attention import DocumentAttention
from harli_train.model.llama import LlamaForCausalLM
from harli_train.saved_tensors import storages
from harli_train.train.saved_arena import ArenaMemory, SavedArena
from harli_train.train.step import IGNORE_INDEX, model_inputs


class GraphCaptureError(RuntimeError):
    """The trainer's step cannot run on graphs: a capture failed, or a batch shape the graphs cannot take
    (the trainer goes on without graphs: `Trainer.drop_graphs`)."""


class _StandIn:
    """A CPU stand-in for a captured CUDA graph of set ``key``: `replay()` runs the captured function again.

    Without the saved-tensor arena, like a real replay it may overwrite the memory where another set keeps
    its saved tensors: it drops every chunk output another set's forward left (`ShapeGraphs.outs`), so that
    a backward replayed without its rebuild fails on the CPU as it would compute garbage on the GPU."""

    def __init__(self, fn: Callable[[], None], shape: ShapeGraphs, key: tuple[int, int]) -> None:
        self.fn, self.shape, self.key = fn, shape, key

    def replay(self) -> None:
        shape = self.shape
        if shape.arena is None:  # the sets' saved tensors share no memory: another set's are lost
            for chunk, key in enumerate(shape.outs_key):
                if key is not None and key != self.key:
                    shape.outs[chunk] = shape.outs_key[chunk] = None
        shape.replaying = self.key
        self.fn()


def _grads_or_zeros(grads, inputs) -> list[torch.Tensor]:
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs, strict=True)]


class ShapeGraphs:
    """The static tensors and graphs of one batch shape (see the module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        bounds: list[tuple[int, int]],
        autocast: Callable[[], contextlib.AbstractContextManager],
        inputs: dict,
        grads: dict[int, torch.Tensor],
        arena: bool = True,
        memory: ArenaMemory | None = None,
        capture: Callable[[], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        self.model, self.bounds, self.autocast, self.inputs = model, bounds, autocast, inputs
        self.ptrs = _pointers(inputs)
        device = model.lm_head.weight.device
        chunks = len(bounds)
        with torch.no_grad():  # one eager chunk: the dtypes and shapes of what the graphs pass along
            hidden, cos, sin, mask = self._prologue_values()
            h1, r1 = self._run(0, hidden, None, cos, sin, None if mask is None else _attention(mask))
        self.cos, self.sin = torch.empty_like(cos), torch.empty_like(sin)
        self.mask = None if mask is None else torch.empty_like(mask)
        self.attn = None if mask is None else _attention(self.mask)
        # Boundary i is chunk i's input; boundary C the loss's. The first chunk's input needs no gradient.
        self.h = [torch.empty_like(hidden)] + [torch.empty_like(h1).requires_grad_() for _ in range(chunks)]
        self.r: list[torch.Tensor | None] = [None] + [
            torch.empty_like(r1).requires_grad_() for _ in range(chunks)
        ]
        self.gh = [None] + [torch.empty_like(h1) for _ in range(chunks)]
        self.gr = [None] + [torch.empty_like(r1) for _ in range(chunks)]
        self.targets = torch.ones((), dtype=torch.float32, device=device)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.params = [
            [p for layer in model.model.layers[start:stop] for p in layer.parameters() if p.requires_grad]
            for start, stop in bounds
        ]
        self.grads = [[grads[id(p)] for p in ps] for ps in self.params]
        self.outs: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * chunks
        # CPU stand-ins: the set whose forward left each chunk's outputs, and the set replaying now.
        self.outs_key: list[tuple[int, int] | None] = [None] * chunks
        self.replaying: tuple[int, int] | None = None
        self.sets: dict[tuple[int, int], dict[str, Any]] = {}  # (stream, SM budget) -> name -> graph
        self.pool: Any = None  # the memory pool every set of this shape captures into
        self.capture = capture  # around each capture, yields the pool to capture into (None: a new pool)
        weights = [*model.parameters(), *model.buffers()]
        self.memory = memory if arena else None  # where the arena's slots live (None: torch's allocator)
        self.arena = SavedArena(storages([*weights, *self._static()]), self.memory) if arena else None

    # ---- what the graphs run -------------------------------------------------------------------------
    def _prologue_values(self):
        """The embeddings, rope tables and mask of the batch buffers, as `model_inputs` makes them."""
        model = self.model
        ids, _, cos, sin, attn = model_inputs(model, self.inputs, model.lm_head.weight.device)
        return model.embed(ids), cos, sin, None if attn is None else attn.mask

    def _run(self, chunk, hidden, residual, cos, sin, attn):
        start, stop = self.bounds[chunk]
        with self.autocast():
            return self.model.run_layers(start, stop, hidden, residual, cos, sin, attn)

    def run_forward(self, chunk: int) -> None:
        if chunk == 0:
            with torch.no_grad():
                hidden, cos, sin, mask = self._prologue_values()
                self.h[0].copy_(hidden)
                self.cos.copy_(cos)
                self.sin.copy_(sin)
                if mask is not None:
                    self.mask.copy_(mask)
        saving = contextlib.nullcontext() if self.arena is None else self.arena.chunk(chunk)
        with torch.enable_grad(), saving:
            out = self._run(chunk, self.h[chunk], self.r[chunk], self.cos, self.sin, self.attn)
        self.outs[chunk], self.outs_key[chunk] = out, self.replaying
        with torch.no_grad():
            self.h[chunk + 1].copy_(out[0])
            self.r[chunk + 1].copy_(out[1])

    def run_loss(self) -> None:
        model, last = self.model, len(self.bounds)
        h_in, r_in = self.h[last], self.r[last]
        with torch.enable_grad():
            with self.autocast():
                normed = model.final_norm(h_in, r_in)
                shifted = normed[:, :-1].reshape(-1, normed.shape[-1])
                labels = self.inputs["labels"][:, 1:].reshape(-1)
                mb_loss = model.token_loss(shifted, labels, IGNORE_INDEX)
            gh, gr = _grads_or_zeros(
                torch.autograd.grad(mb_loss / self.targets, [h_in, r_in], allow_unused=True), [h_in, r_in]
            )
        with torch.no_grad():
            self.gh[last].copy_(gh)
            self.gr[last].copy_(gr)
            self.loss_sum.add_(mb_loss.detach().float())

    def run_backward(self, chunk: int) -> None:
        (h_out, r_out), self.outs[chunk] = self.outs[chunk], None
        inputs = ([self.h[chunk], self.r[chunk]] if chunk > 0 else []) + self.params[chunk]
        with torch.enable_grad():
            grads = torch.autograd.grad(
                [h_out, r_out], inputs, [self.gh[chunk + 1], self.gr[chunk + 1]], allow_unused=True
            )
        grads = _grads_or_zeros(grads, inputs)
        with torch.no_grad():
            if chunk > 0:
                self.gh[chunk].copy_(grads[0])
                self.gr[chunk].copy_(grads[1])
                grads = grads[2:]
            if grads:
                torch._foreach_add_(self.grads[chunk], grads)

    def order(self) -> list[tuple[str, Callable[[], None]]]:
        """The micro-steps of one micro-batch, in the order they run (and are captured)."""
        chunks = range(len(self.bounds))
        fwd = [(f"fwd{i}", lambda i=i: self.run_forward(i)) for i in chunks]
        bwd = [(f"bwd{i}", lambda i=i: self.run_backward(i)) for i in reversed(chunks)]
        return [*fwd, ("loss", self.run_loss), *bwd]

    # ---- capture -------------------------------------------------------------------------------------
    def set_for(self, key: tuple[int, int]) -> dict[str, Any]:
        """The graphs of (stream, SM budget) ``key``, captured now if new (see the module docstring)."""
        found = self.sets.get(key)
        if found is None:
            if self.model.lm_head.weight.device.type != "cuda":
                found = {name: _StandIn(fn, self, key) for name, fn in self.order()}
            else:
                found = self._capture_cuda(key)
            self.sets[key] = found
        return found

    def _static(self) -> list[torch.Tensor]:
        tensors = [*self.h, *self.r[1:], *self.gh[1:], *self.gr[1:], self.cos, self.sin, self.loss_sum]
        return [*tensors, *([] if self.mask is None else [self.mask]), *(g for gs in self.grads for g in gs)]

    def _capture_cuda(self, key: tuple[int, int]) -> dict[str, Any]:
        try:
            return self._capture_cuda_set(key[1])
        except torch.OutOfMemoryError:
            raise  # the runtime's memory recovery handles it
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else ""
            raise GraphCaptureError(
                f"capturing the trainer's step as CUDA graphs on {key[1]} SMs failed "
                f"({type(err).__name__}: {first})"
            ) from err

    def _capture_cuda_set(self, sms: int) -> dict[str, Any]:
        current = torch.cuda.current_stream()
        # A legacy default stream cannot capture: a side stream of the same (primary) context can.
        stream = current if current.cuda_stream != 0 else torch.cuda.Stream()
        held = self.memory.arena_held() if self.memory is not None else contextlib.nullcontext()
        with held, kernels.sm_budget(sms), torch.cuda.stream(stream):
            stream.wait_stream(current)
            kept = [t.detach().clone() for t in self._static()]
            for _, fn in self.order():  # warm-up, eager: compiles the kernels, sets up cuBLAS on `stream`
                fn()
            with torch.no_grad():
                torch._foreach_copy_([t.detach() for t in self._static()], kept)
            del kept
            if self.arena is not None:  # from the first capture on, no pass may change the slots
                self.arena.frozen = True
            with self.capture() if self.capture is not None else contextlib.nullcontext() as pool:
                if self.pool is None:
                    self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
                graphs = self._capture_each()
        current.wait_stream(stream)
        if stream is not current:  # the side stream's cache (the eager pass's working set) is of no more use
            stream.synchronize()
            torch.cuda.empty_cache()
        return graphs

    def _capture_each(self) -> dict[str, Any]:
        """One graph per micro-step of ``order()``, captured on the current stream into the shape's pool."""
        graphs: dict[str, Any] = {}
        for name, fn in self.order():
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):  # thread_local: the decode thread goes on meanwhile
                fn()
            graphs[name] = graph
        return graphs

    def release(self) -> None:
        """Let go of the graphs, their pool, the arena's slots and the static tensors (`StepGraphs.clear`)."""
        self.sets.clear()
        self.pool = None
        if self.arena is not None:
            self.arena.slots.clear()
            if self.memory is not None:
                self.memory.arena_reset()
        self.outs = [None] * len(self.outs)
        self.h, self.r, self.gh, self.gr = [], [], [], []

    def fits(self, inputs: dict) -> bool:
        """Whether ``inputs`` are the very buffers these graphs read."""
        return _pointers(inputs) == self.ptrs


def set_key() -> tuple[int, int]:
    """(stream, SM budget) of the launches made now: which set of graphs replays them."""
    stream = torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else 0
    return stream, kernels.num_sms()


def _attention(mask: torch.Tensor) -> DocumentAttention:
    attn = DocumentAttention.__new__(DocumentAttention)
    attn.mask = mask
    return attn


def _pointers(inputs: dict) -> tuple:
    return tuple(
        (key, t.data_ptr(), tuple(t.shape))
        for key, t in sorted(inputs.items())
        if isinstance(t, torch.Tensor)
    )
