"""Between HTTP handlers and the engine: a ``RequestPort`` (a mailbox of requests and aborts in, every drawn
token out to the request's event queue on the server's event loop) that whoever owns the engine drains
before its steps and publishes after them, and ``EngineLoop``, the engine's own thread when it serves alone
(co-located, the co-location runtime's loop drives the same port). With an ``AdapterCatalog`` a request names
its model id, resolved to an adapter slot when the engine's owner admits it (the request keeps that slot, and
so the adapter's version, to its end); ``call`` runs a change of the catalog (loading an adapter) on the
owner's thread and hands its result back as an asyncio future.

One owner per piece of state: only the engine's owner touches the engine; a handler owns its
``RequestHandle`` and reads the events posted to it (``loop.call_soon_threadsafe``);
``stats()`` is a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harli_train.engine.adapters import AdapterCatalog
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
    status: int = 400  # the HTTP status a refusal answers with
    step: int | None = None  # the optimizer step of the live adapter the request runs on


class RequestHandle:
    """A submitted request as its handler sees it: ``events`` (an asyncio queue) and ``abort()``."""

    def __init__(self, port: RequestPort, aio: asyncio.AbstractEventLoop) -> None:
        self._owner, self.aio = port, aio  # aio: the handler's event loop, where its events are put
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.seq: Sequence | None = None  # set by the engine thread

    def post(self, event: Event) -> None:  # engine thread
        self.aio.call_soon_threadsafe(self.events.put_nowait, event)

    def abort(self) -> None:
        """The client went away or a stop string matched: drop the request now (its blocks are freed)."""
        self._owner.abort(self)


class RequestPort:
    """The mailbox between HTTP handlers (any thread: ``submit``, ``RequestHandle.abort``) and the engine's
    owner (one thread: ``drain`` before a step, ``publish`` after it, ``close`` at the end). ``engine`` is
    anything with ``add_request``, ``abort`` and ``scheduler`` (a DecodeEngine, or the co-location runtime's
    adapter of one); ``catalog`` maps model ids to its adapter slots (None: the base only)."""

    def __init__(self, engine: Any, max_queue: int = 256, catalog: AdapterCatalog | None = None) -> None:
        self.engine, self.max_queue, self.catalog = engine, max_queue, catalog
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._handles: dict[int, RequestHandle] = {}  # by seq_id, owner thread only
        self._sent: dict[int, int] = {}  # tokens already posted, by seq_id
        self._steps: dict[int, int | None] = {}  # the live adapter step each request pinned, by seq_id
        self._pending = 0  # submitted, not yet admitted or refused (guarded)
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {"waiting": 0, "running": 0}
        self.closing_at: float | None = None  # set by a "stop" message: no more admissions, a deadline

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        aio: asyncio.AbstractEventLoop,
        model: str | None = None,
    ) -> RequestHandle:
        """Queue a request for ``model`` (None: the base); its events arrive on the returned handle.
        ``QueueFull`` when too many wait."""
        with self._lock:
            if self._pending + self._snapshot["waiting"] >= self.max_queue:
                raise QueueFull()
            self._pending += 1
        handle = RequestHandle(self, aio)
        self._inbox.put(("submit", (handle, prompt, params, request_id, time.perf_counter(), model)))
        return handle

    def call(self, fn: Callable[[], Any], aio: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Run ``fn()`` on the owner's thread at its next ``drain``; the future gets its result or error."""
        future = aio.create_future()
        self._inbox.put(("call", (fn, future, aio)))
        return future

    def abort(self, handle: RequestHandle) -> None:
        """Drop ``handle``'s request at the owner's next ``drain`` (any thread)."""
        self._inbox.put(("abort", handle))

    def request_stop(self, grace_s: float) -> None:
        """No more admissions; running requests have ``grace_s`` to finish
        (the owner reads ``closing_at``)."""
        self._inbox.put(("stop", time.perf_counter() + grace_s))

    def stats(self) -> dict[str, Any]:
        """A snapshot: requests waiting and running (updated at every ``publish``)."""
        return dict(self._snapshot)

    @property
    def serving(self) -> bool:
        """Whether any request admitted through the port is still running."""
        return bool(self._handles)

    def drain(self, wait_s: float = 0.0) -> None:
        """Apply what the mailbox holds (waiting up to ``wait_s`` for a first message)."""
        block = wait_s > 0
        while True:
            try:
                kind, item = self._inbox.get(timeout=wait_s) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self._admit(*item)
            elif kind == "abort":
                if item.seq is not None and self.engine.abort(item.seq):
                    self._finish(item.seq)
            elif kind == "call":
                self._call(*item)
            else:
                self.closing_at = item

    @staticmethod
    def _call(fn: Callable[[], Any], future: asyncio.Future, aio: asyncio.AbstractEventLoop) -> None:
        try:
            result, error = fn(), None
        except Exception as err:  # handed to the handler, which answers it
            result, error = None, err
        aio.call_soon_threadsafe(_settle, future, result, error)

    def _admit(
        self, handle: RequestHandle, prompt, params, request_id: str, t: float, model: str | None
    ) -> None:
        with self._lock:
            self._pending -= 1
        if self.closing_at is not None:
            handle.post(Event(done=True, finish_reason="refused", error="the server is shutting down"))
            return
        slot, step = 0, None
        if self.catalog is not None:
            try:
                slot, step = self.catalog.slot(model), self.catalog.step(model)
            except KeyError:  # unloaded between the handler's check and now
                error = f"the model '{model}' is no longer served"
                handle.post(Event(done=True, finish_reason="refused", error=error, status=404))
                return
        try:
            seq = self.engine.add_request(
                prompt, params, request_id=request_id, arrival_time=t, lora_slot=slot
            )
        except RequestRefused as err:
            refused = Event(
                done=True, finish_reason="refused", error=str(err), prompt_tokens=err.seq.num_prompt_tokens
            )
            handle.post(refused)
            return
        handle.seq = seq
        self._handles[seq.seq_id] = handle
        self._sent[seq.seq_id] = 0
        self._steps[seq.seq_id] = step

    def publish(self) -> None:
        """Post every token drawn since the last call; end finished requests. One wake-up of each event loop
        carries the step's events for all its requests (a wake-up per request would be a syscall each on
        the engine's thread and a turn of the loop each, host time the co-located trainer's launches lose)."""
        posts: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, Event]]] = {}
        for seq_id, handle in list(self._handles.items()):
            seq = handle.seq
            new = seq.completion_token_ids[self._sent[seq_id] :]
            if new:
                self._sent[seq_id] += len(new)
                event = Event(new, prompt_tokens=seq.num_prompt_tokens, step=self._steps[seq_id])
                posts.setdefault(handle.aio, []).append((handle, event))
            if seq.is_finished:
                done = self._forget(seq)
                if done is not None:
                    posts.setdefault(handle.aio, []).append(done)
        for aio, events in posts.items():
            aio.call_soon_threadsafe(_deliver, events)
        sched = self.engine.scheduler
        self._snapshot = {"waiting": len(sched.waiting), "running": len(sched.running)}

    def _finish(self, seq: Sequence) -> None:
        """End ``seq``'s request now: its final event is posted to its handler."""
        done = self._forget(seq)
        if done is not None:
            done[0].post(done[1])

    def _forget(self, seq: Sequence) -> tuple[RequestHandle, Event] | None:
        """Drop ``seq``'s request from the port; its handle and final event (None: it had no handle)."""
        handle = self._handles.pop(seq.seq_id, None)
        self._sent.pop(seq.seq_id, None)
        step = self._steps.pop(seq.seq_id, None)
        if handle is None:
            return None
        return handle, Event(
            done=True, finish_reason=seq.finish_reason, prompt_tokens=seq.num_prompt_tokens, step=step
        )

    def close(self) -> None:
        """Abort what the port admitted and still runs, and refuse what never reached the engine."""
        self.publish()
        for handle in list(self._handles.values()):
            if handle.seq is not None and self.engine.abort(handle.seq):
                self._finish(handle.seq)
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                item[0].post(Event(done=True, finish_reason="refused", error="the server is shutting down"))
            elif kind == "call":
                _, future, aio = item
                aio.call_soon_threadsafe(_settle, future, None, RuntimeError("the server is shutting down"))


def _deliver(events: list[tuple[RequestHandle, Event]]) -> None:
    """On a handler's event loop: put each event on its request's queue, in order."""
    for handle, event in events:
        handle.events.put_nowait(event)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the handler's loop: hand a ``call``'s outcome over (unless its handler went away)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class EngineLoop:
    """The engine's own thread when it serves alone: drains the port, steps, publishes, until ``stop()``."""

    def __init__(
        self,
        engine: DecodeEngine,
        max_queue: int = 256,
        idle_wait_s: float = 0.01,
        catalog: AdapterCatalog | None = None,
    ) -> None:
        self.engine, self.idle_wait_s = engine, idle_wait_s
        self.port = RequestPort(engine, max_queue, catalog)
        self._thread = threading.Thread(target=self._run, name="harli-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        aio: asyncio.AbstractEventLoop,
        model: str | None = None,
    ) -> RequestHandle:
        return self.port.submit(prompt, params, request_id, aio, model)

    def stats(self) -> dict[str, Any]:
        return self.port.stats()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop admitting; running requests get up to ``grace_s`` to finish, then the rest is aborted."""
        self.port.request_stop(grace_s)
        self._thread.join()

    def _run(self) -> None:
        port, engine = self.port, self.engine
        try:
            while True:
                port.drain(0.0 if engine.has_unfinished() else self.idle_wait_s)
                closing = port.closing_at
                if closing is not None and (not engine.has_unfinished() or time.perf_counter() > closing):
                    break
                if engine.has_unfinished():
                    engine.step()
                    port.publish()
        except Exception:  # a dead engine thread must not leave clients waiting for ever
            log.exception("the engine thread failed")
        finally:
            port.close()
