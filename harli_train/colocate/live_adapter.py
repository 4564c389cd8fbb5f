"""The adapter being trained, served live under the run's name from two adapter slots (double-buffered).

Two threads take part, each with its own state and a mailbox to the other (nothing else is shared):
  * the trainer side (`after_optimizer_step`, on whichever thread launches the trainer's work, the trainer's
    stream current): once `every` optimizer steps have passed since the last refresh and the engine side
    has handed it a free buffer, it copies the fp32 masters into that buffer on the trainer's stream (after
    the optimizer's update, in stream order; after the last decode step that read the buffer, by the event
    that came with it), records an event and posts (buffer, step, event). With no free buffer (requests still
    run on both versions) the refresh waits for the next optimizer step.
  * the engine side (`poll`, on the decode thread between steps): a posted buffer becomes the one new
    requests for the run's id run on (the catalog's live slot) once its event has been reached, so a decode
    step never waits on the GPU for the copy, nor for the trainer's work queued ahead of it (on the H200 a
    decode step that did waited 8-46 ms at every optimizer step); the buffer it replaces is handed back once
    no request runs on it, with an event past every step launched.
A request thus runs on one version from its first token to its last, and no step reads a buffer being
written. Once training is over the trainer side never runs again and `publish_final` (engine side) serves
the final adapter if the last refresh could not.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from typing import Any

import torch

from harli_train.engine.adapters import AdapterCatalog
from harli_train.engine.engine import DecodeEngine
from harli_train.model import LlamaForCausalLM

log = logging.getLogger(__name__)


class LiveAdapter:
    """`model`'s attached adapter (the trainer's masters), served as model id `name` on `engine` from two
    slots reserved in `catalog`; `step` is the optimizer step the masters hold now."""

    def __init__(
        self,
        engine: DecodeEngine,
        catalog: AdapterCatalog,
        name: str,
        model: LlamaForCausalLM,
        step: int,
        every: int = 1,
    ) -> None:
        self.engine, self.catalog, self.name, self.every = engine, catalog, name, every
        self.model = model
        self.modules = {path: m for path, m in model.lora_modules().items() if m.has_lora}
        first = next(iter(self.modules.values()))
        self.buffers = catalog.reserve(2)
        pairs = {path: (m.lora_A.detach(), m.lora_B.detach()) for path, m in self.modules.items()}
        for slot in self.buffers:  # both laid out for this adapter; the second is refreshed later
            engine.load_lora(slot, pairs, first.rank, first.scale)
        self._to_trainer: queue.SimpleQueue = queue.SimpleQueue()  # (slot, event): a buffer to write
        self._to_engine: queue.SimpleQueue = queue.SimpleQueue()  # (slot, step, event): a buffer written
        # Engine side.
        self.current, self.step = self.buffers[0], step
        self._retired = [self.buffers[1]]  # not current, not yet handed to the trainer side
        self._posted: deque[tuple[int, int, Any]] = deque()  # written buffers whose copy may still run
        self.refreshes = 0
        # Trainer side.
        self._free: list[tuple[int, torch.cuda.Event | None]] = []
        self._published = step
        catalog.set_live(name, self.current, step)
        self.poll()

    def follow(self, model: LlamaForCausalLM, step: int) -> None:
        """Serve another trainer's adapter from now on (a fresh trainer of the same recipe: a bench window).
        Between runs only: no request in flight, neither side running. Its masters are copied into the live
        slot at once."""
        self._gather()
        for _, _, done in self._posted:  # between runs: the copies end before the buffers are rewritten
            if done is not None:
                done.synchronize()
        self.poll()
        self.model = model
        self.modules = {path: m for path, m in model.lora_modules().items() if m.has_lora}
        self.engine.lora.copy_from(self.current, self.modules)
        if self.engine.device.type == "cuda":
            torch.cuda.current_stream(self.engine.device).synchronize()
        self.step = self._published = step
        self.catalog.set_live(self.name, self.current, step)

    # ---- trainer side -------------------------------------------------------------------------------
    def after_optimizer_step(self, step: int) -> None:
        """The optimizer has updated the masters to step `step` (queued on the current stream)."""
        if step - self._published >= self.every:
            self._refresh(step)

    def _refresh(self, step: int) -> bool:
        while True:
            try:
                self._free.append(self._to_trainer.get_nowait())
            except queue.Empty:
                break
        if not self._free:
            return False
        slot, last_read = self._free.pop(0)
        done = None
        if self.engine.device.type == "cuda":
            stream = torch.cuda.current_stream(self.engine.device)
            if last_read is not None:
                stream.wait_event(last_read)
            self.engine.lora.copy_from(slot, self.modules)
            done = torch.cuda.Event()
            done.record(stream)
        else:
            self.engine.lora.copy_from(slot, self.modules)
        self._published = step
        self._to_engine.put((slot, step, done))
        return True

    # ---- engine side --------------------------------------------------------------------------------
    def _gather(self) -> None:
        while True:
            try:
                self._posted.append(self._to_engine.get_nowait())
            except queue.Empty:
                return

    def poll(self) -> None:
        """Serve the newest posted buffer whose copy has completed (its event reached: the next decode step
        then waits for nothing); hand back the buffers no request runs on any more."""
        self._gather()
        while self._posted and (self._posted[0][2] is None or self._posted[0][2].query()):
            slot, step, done = self._posted.popleft()
            self.engine.lora.wait_before_next_step(done)  # reached: orders the streams at no cost
            self._retired.append(self.current)
            self.current, self.step = slot, step
            self.catalog.set_live(self.name, slot, step)
            self.refreshes += 1
        for slot in list(self._retired):
            if not self.engine.slot_busy(slot):
                self._retired.remove(slot)
                self._to_trainer.put((slot, self.engine.last_step_event()))

    def publish_final(self, step: int) -> bool:
        """Training is over at optimizer step `step` (the trainer side never runs again, its last update is
        complete): serve that adapter if the live one is older. False while no buffer is free yet (requests
        run on both versions) or its copy is still running: call again after later steps."""
        self.poll()
        if self.step >= step:
            return True
        if self._published < step and not self._refresh(step):
            return False
        self.poll()
        if self.step < step:
            return False  # its copy still runs on the trainer's stream
        log.info("serving the final adapter (step %d) as %s", step, self.name)
        return True
