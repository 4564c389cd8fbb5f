"""SavedArena: the tensors a training step's forwards save for backward, in slots of fixed addresses that
every set of the step's CUDA graphs shares (``step_graphs``)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Protocol

import torch

from harli_train.saved_tensors import stays_in_place


class ArenaMemory(Protocol):
    """Where an arena's slots live, and when their pages must be there (``ActivationSwapper``'s contract):
    ``arena_slot`` places a slot of a chunk for good (None: no room), ``arena_before(chunk, backward)`` runs
    before a replay of the chunk's forward or backward is launched, ``arena_after_backward(chunk)`` after its
    backward's, inside ``arena_held()`` every slot is in place and stays there, and ``arena_reset()``
    forgets the slots (the arena is released)."""

    device: torch.device

    def arena_slot(self, chunk: int, shape: Any, dtype: torch.dtype) -> torch.Tensor | None: ...

    def arena_before(self, chunk: int, backward: bool) -> None: ...

    def arena_after_backward(self, chunk: int) -> None: ...

    def arena_held(self) -> contextlib.AbstractContextManager: ...

    def arena_reset(self) -> None: ...


class SlotMissing(RuntimeError):
    """A forward after the first capture saved other tensors than the first pass did (another shape or
    dtype at a place, or more or fewer of them)."""


class SavedArena:
    """What each chunk's forward saves for backward, in buffers of fixed addresses that every set of graphs
    of a shape shares, written through saved-tensor hooks.

    A chunk's forward copies each tensor it saves (except the model's weights, the static tensors and
    parameters: ``stays_in_place``) into the buffer of its (chunk, order) slot, and its backward reads it
    there. Every set saves the same tensors in the same order, so whichever set replays a chunk's forward,
    any set's backward finds them: the trainer may move between sets mid-micro-batch without replaying a
    forward, and a set's own memory pool holds only what its graphs use while they run. Slots are made on
    the eager pass before the first set's capture; from that capture on the arena is ``frozen``: every later
    pass (a capture, another set's eager pass) must save, chunk by chunk, as many tensors of the same shapes
    and dtypes into the very slots the graphs already captured read and write. A pass that would make,
    replace or leave out a slot is a ``SlotMissing`` error (the capture reports it as a
    ``GraphCaptureError``): a slot made while capturing would live in one set's pool, where other sets'
    replays overwrite it, and a slot replaced after a capture would free memory that graph goes on using.

    ``memory`` (an ``ArenaMemory``, e.g. the page pool's ``ActivationSwapper``) places the slots, chunk by
    chunk, where it can give their pages back between a chunk's backward and its next forward; a slot it
    has no room for is an ordinary tensor."""

    def __init__(self, exclude: set[int], memory: ArenaMemory | None = None) -> None:
        self.exclude, self.memory = exclude, memory
        self.slots: dict[tuple[int, int], torch.Tensor] = {}
        self.frozen = False
        self.counts: dict[int, int] = {}  # chunk -> tensors its forward saves into slots
        self._chunk, self._next = 0, 0
        self._seen: dict[int, tuple[Any, int, torch.Tensor]] = {}  # id -> (ref, version, slot) this chunk

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.slots.values())

    @contextlib.contextmanager
    def chunk(self, chunk: int):
        """Save what chunk ``chunk``'s forward saves in its slots."""
        self._chunk, self._next, self._seen = chunk, 0, {}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield
        self._seen = {}
        held = self.counts.get(chunk)
        if not self.frozen:
            self.counts[chunk] = self._next
        elif held != self._next:
            raise SlotMissing(
                f"chunk {chunk}'s forward saved {self._next} tensors where the first pass saved {held}: "
                "the sets of graphs would not share its slots"
            )

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if stays_in_place(t, self.exclude):
            return t.detach()
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]  # the same tensor saved twice (by two ops of the chunk)
        key = (self._chunk, self._next)
        self._next += 1
        slot = self.slots.get(key)
        if slot is None or slot.shape != t.shape or slot.dtype != t.dtype or slot.device != t.device:
            if self.frozen:
                raise SlotMissing(
                    f"chunk {key[0]}'s forward saved a tensor no earlier pass saved at place {key[1]} "
                    f"({tuple(t.shape)}, {t.dtype}): the sets of graphs would not share it"
                )
            slot = self.memory.arena_slot(key[0], t.shape, t.dtype) if self._placed(t) else None
            if slot is None:
                slot = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self.slots[key] = slot
        with torch.no_grad():
            slot.copy_(t)
        self._seen[id(t)] = (weakref.ref(t), t._version, slot)
        return slot

    def _placed(self, t: torch.Tensor) -> bool:
        return self.memory is not None and t.device == self.memory.device


def _unpack(slot: torch.Tensor) -> torch.Tensor:
    return slot
