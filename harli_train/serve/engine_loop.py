"""The engine's own thread for serving: HTTP handlers hand it requests and aborts through a mailbox; it steps
the engine and hands every drawn token back to the request's event queue on the server's event loop.

One owner per piece of state: only this thread touches the engine; a handler owns its ``RequestHandle`` and
reads the events the thread posts to it (``loop.call_soon_threadsafe``); ``stats()`` is a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from harli_train.engine.engine import DecodeEngine, RequestRefused
from harli_train.engine.sampling_params import SamplingParams
from harli_train.engine.sequence import Sequence

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are waiting than the server admits (``max_queue``)."""


@dataclass(slots=True)
class Event:
    """What a request's handler receives: new token ids, then one final event (``done``)."""

    tokens: list[int] = field(default_factory=list)
    done: bool = False
    finish_reason: str | None = None  # the engine's: eos, stop, length, aborted, refused
    error: str | None = None  # why a refused request was refused
    prompt_tokens: int = 0


class RequestHandle:
    """A submitted request as its handler sees it: ``events`` (an asyncio queue) and ``abort()``."""

    def __init__(self, loop_: EngineLoop, aio: asyncio.AbstractEventLoop) -> None:
        self._owner, self._aio = loop_, aio
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.seq: Sequence | None = None  # set by the engine thread

    def post(self, event: Event) -> None:  # engine thread
        self._aio.call_soon_threadsafe(self.events.put_nowait, event)

    def abort(self) -> None:
        """The client went away or a stop string matched: drop the request now (its blocks are freed)."""
        self._owner._inbox.put(("abort", self))


class EngineLoop:
    """Runs ``engine`` on a thread of its own until ``stop()``; ``submit`` from any thread."""

    def __init__(self, engine: DecodeEngine, max_queue: int = 256, idle_wait_s: float = 0.01) -> None:
        self.engine, self.max_queue, self.idle_wait_s = engine, max_queue, idle_wait_s
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._handles: dict[int, RequestHandle] = {}  # by seq_id, engine thread only
        self._sent: dict[int, int] = {}  # tokens already posted, by seq_id
        self._pending = 0  # submitted, not yet admitted or refused (any thread: guarded)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harli-engine", daemon=True)
        self.started_at = time.time()
        self._snapshot: dict[str, Any] = {"waiting": 0, "running": 0}

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, aio: asyncio.AbstractEventLoop
    ) -> RequestHandle:
        """Queue a request; its events arrive on the returned handle. ``QueueFull`` when too many wait."""
        with self._lock:
            if self._pending + self._snapshot["waiting"] >= self.max_queue:
                raise QueueFull()
            self._pending += 1
        handle = RequestHandle(self, aio)
        self._inbox.put(("submit", (handle, prompt, params, request_id, time.perf_counter())))
        return handle

    def stats(self) -> dict[str, Any]:
        """A snapshot: requests waiting and running (updated by the engine thread every step)."""
        return dict(self._snapshot)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop admitting; running requests get up to ``grace_s`` to finish, then the rest is aborted."""
        self._inbox.put(("stop", time.perf_counter() + grace_s))
        self._thread.join()

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        deadline: float | None = None
        try:
            while True:
                block = not self.engine.has_unfinished()
                deadline = self._drain(block, deadline)
                if deadline is not None and (
                    not self.engine.has_unfinished() or time.perf_counter() > deadline
                ):
                    break
                if self.engine.has_unfinished():
                    self.engine.step()
                    self._publish()
        except Exception:  # a dead engine thread must not leave clients waiting for ever
            log.exception("the engine thread failed")
        finally:
            self._abort_all()

    def _drain(self, block: bool, deadline: float | None) -> float | None:
        """Apply what the mailbox holds (waiting for something when the engine is idle)."""
        while True:
            try:
                kind, item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
            except queue.Empty:
                return deadline
            block = False
            if kind == "submit":
                self._admit(*item, refuse=deadline is not None)
            elif kind == "abort":
                if item.seq is not None and self.engine.abort(item.seq):
                    self._finish(item.seq)
            else:
                deadline = item

    def _admit(self, handle: RequestHandle, prompt, params, request_id: str, t: float, refuse: bool) -> None:
        with self._lock:
            self._pending -= 1
        if refuse:
            handle.post(Event(done=True, finish_reason="refused", error="the server is shutting down"))
            return
        try:
            seq = self.engine.add_request(prompt, params, request_id=request_id, arrival_time=t)
        except RequestRefused as err:
            handle.post(
                Event(
                    done=True,
                    finish_reason="refused",
                    error=str(err),
                    prompt_tokens=err.seq.num_prompt_tokens,
                )
            )
            return
        handle.seq = seq
        self._handles[seq.seq_id] = handle
        self._sent[seq.seq_id] = 0

    def _publish(self) -> None:
        """Post every token drawn since the last step; end finished requests."""
        for seq_id, handle in list(self._handles.items()):
            seq = handle.seq
            new = seq.completion_token_ids[self._sent[seq_id] :]
            if new:
                self._sent[seq_id] += len(new)
                handle.post(Event(tokens=new, prompt_tokens=seq.num_prompt_tokens))
            if seq.is_finished:
                self._finish(seq)
        sched = self.engine.scheduler
        self._snapshot = {"waiting": len(sched.waiting), "running": len(sched.running)}

    def _finish(self, seq: Sequence) -> None:
        handle = self._handles.pop(seq.seq_id, None)
        self._sent.pop(seq.seq_id, None)
        if handle is not None:
            handle.post(
                Event(done=True, finish_reason=seq.finish_reason, prompt_tokens=seq.num_prompt_tokens)
            )

    def _abort_all(self) -> None:
        for handle in list(self._handles.values()):
            if handle.seq is not None and self.engine.abort(handle.seq):
                self._finish(handle.seq)
        while True:  # submissions that never reached the engine
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                item[0].post(Event(done=True, finish_reason="refused", error="the server is shutting down"))
