"""The OpenAI-compatible HTTP front end (aiohttp): routes, authentication, streaming, errors.

Routes: POST /v1/completions, POST /v1/chat/completions (both with ``stream: true`` as server-sent events),
GET /v1/models, GET /health (200 once the engine thread serves), GET /metrics (Prometheus text). A handler
turns a body into an engine request (``protocol``), hands it to the engine thread (``EngineLoop``) and turns
the tokens it gets back into text: decoded whole each time (so a multi-byte character cut between tokens comes
out once complete), stop strings cut it and abort the request. A client that disconnects aborts its request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from harli_train.data.dataset import DataError
from harli_train.data.tokenization import chat_prompt_ids
from harli_train.serve import protocol
from harli_train.serve.engine_loop import QueueFull, RequestHandle, RequestPort
from harli_train.serve.prometheus import ServerMetrics

log = logging.getLogger(__name__)


class Server:
    """What the routes share: the request port into the engine, the tokenizer, the model ids served, the
    metrics. ``alive()`` says whether the engine's owner serves (``/health``); ``extra_metrics()`` adds gauges
    (the co-located trainer's figures)."""

    def __init__(
        self,
        port: RequestPort,
        tokenizer: Any,
        max_model_len: int,
        models: list[str],
        api_key: str | None = None,
        alive: Callable[[], bool] = lambda: True,
        extra_metrics: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.port, self.tokenizer, self.max_model_len = port, tokenizer, max_model_len
        self.models, self.api_key, self.alive = models, api_key, alive
        self.started = time.time()
        self.metrics = ServerMetrics()
        self.extra_metrics = extra_metrics

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth])
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.list_models),
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
            ]
        )
        return app

    # ---- middleware ----------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except protocol.APIError as err:
            self.metrics.count_error(err.status)
            return web.json_response(err.body(), status=err.status)
        except web.HTTPException as err:
            if err.status >= 400:
                body = protocol.APIError(err.status, err.reason or "not found").body()
                return web.json_response(body, status=err.status)
            raise

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_key and request.path.startswith("/v1/"):
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                raise protocol.APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                                        "authentication_error", code="invalid_api_key")  # fmt: skip
        return await handler(request)

    # ---- routes --------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.alive():
            return web.json_response({"status": "engine not running"}, status=503)
        return web.json_response({"status": "ok"})

    async def list_models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": int(self.started), "owned_by": "harli-train"}
                for m in self.models]  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    async def prometheus(self, request: web.Request) -> web.Response:
        extra = self.extra_metrics() if self.extra_metrics else {}
        text = self.metrics.render(self.port.stats(), extra)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = protocol.parse_completion(await self._json(request), self.models, self.max_model_len)
        return await self._serve(request, req)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        req = protocol.parse_chat(body, self.models, self.max_model_len, self._render_chat)
        return await self._serve(request, req)

    # ---- serving one request -------------------------------------------------------------------------
    async def _json(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise protocol.APIError(400, f"the request body is not valid JSON: {err}") from None

    def _render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation's prompt ids, by the one tokenization module the trainer and generate use."""
        try:
            return chat_prompt_ids(self.tokenizer, messages)
        except DataError as err:
            raise protocol.APIError(
                400, f"{err}: use /v1/completions", param="messages", code="no_chat_template"
            ) from None

    async def _serve(self, request: web.Request, req: protocol.APIRequest) -> web.StreamResponse:
        import asyncio

        try:
            handle = self.port.submit(req.prompt, req.params, req.object_id, asyncio.get_running_loop())
        except QueueFull:
            self.metrics.count_error(429)
            body = protocol.APIError(429, "the server's queue is full: retry later", "rate_limit_error",
                                     code="queue_full").body()  # fmt: skip
            return web.json_response(body, status=429, headers={"Retry-After": "1"})
        self.metrics.started(req.kind)
        reader = _TextReader(self.tokenizer, req.stop)
        if not req.stream:
            try:
                return await self._whole(req, handle, reader)
            finally:
                if handle.seq is not None and not handle.seq.is_finished:
                    handle.abort()  # the handler was cancelled: the client went away
        return await self._streamed(request, req, handle, reader)

    async def _whole(self, req, handle: RequestHandle, reader: _TextReader) -> web.Response:
        t0, first, n_tokens, prompt_tokens = time.perf_counter(), None, 0, 0
        while True:
            event = await handle.events.get()
            prompt_tokens = event.prompt_tokens or prompt_tokens
            if event.done:
                if event.finish_reason == "refused":
                    raise protocol.APIError(400, event.error or "the request was refused",
                                            code="context_length_exceeded")  # fmt: skip
                break
            n_tokens += len(event.tokens)
            first = first or time.perf_counter()
            reader.feed(event.tokens)
            if reader.stopped:
                handle.abort()
                break
        reader.finish()
        reason = "stop" if reader.stopped else protocol.finish_reason(event.finish_reason)
        self.metrics.finished(req.kind, prompt_tokens, n_tokens, t0, first, time.perf_counter())
        text = reader.text
        if req.echo and isinstance(req.prompt, str):
            text = req.prompt + text
        return web.json_response(
            protocol.response(req, text, reason, protocol.usage(prompt_tokens, n_tokens))
        )

    async def _streamed(self, request, req, handle: RequestHandle, reader: _TextReader) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        t0, first, n_tokens, prompt_tokens, sent_first = time.perf_counter(), None, 0, 0, False
        try:
            event = await handle.events.get()
            if event.done and event.finish_reason == "refused":  # refused before any byte went out
                raise protocol.APIError(
                    400, event.error or "the request was refused", code="context_length_exceeded"
                )
            await resp.prepare(request)
            while True:
                prompt_tokens = event.prompt_tokens or prompt_tokens
                if event.done:
                    break
                n_tokens += len(event.tokens)
                first = first or time.perf_counter()
                # One chunk per step that drew tokens, its text possibly empty (held back, or special tokens):
                # a client sees every token's arrival, as it would from the engine.
                piece = reader.feed(event.tokens)
                await _send(resp, protocol.chunk(req, piece, None, first=not sent_first))
                sent_first = True
                if reader.stopped:
                    handle.abort()
                    break
                event = await handle.events.get()
            rest = reader.finish()  # what was held back rides in the last chunk, with the finish reason
            reason = "stop" if reader.stopped else protocol.finish_reason(event.finish_reason)
            await _send(resp, protocol.chunk(req, rest, reason, first=not sent_first))
            if req.include_usage:
                await _send(
                    resp, protocol.chunk(req, None, None, used=protocol.usage(prompt_tokens, n_tokens))
                )
            await resp.write(b"data: [DONE]\n\n")
            self.metrics.finished(req.kind, prompt_tokens, n_tokens, t0, first, time.perf_counter())
            return resp
        except (ConnectionResetError, ConnectionError):
            handle.abort()  # the client went away: free its KV now
            self.metrics.count_error(499)
            return resp
        finally:
            if handle.seq is not None and not handle.seq.is_finished:
                handle.abort()


async def _send(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


class _TextReader:
    """The completion's text as tokens arrive: decoded whole each time and only what is new handed out; a
    trailing U+FFFD (a multi-byte character not complete yet) and, with stop strings, the last few characters
    (a stop string may be cut between tokens) are held back until ``finish``; cut at the first stop string."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text, self.stopped = "", False  # text: what was handed out
        self._hold = max((len(s) for s in stop), default=1) - 1

    def _decoded(self) -> str:
        full = self.tokenizer.decode(self.ids)
        cuts = [at for at in (full.find(s) for s in self.stop) if at >= 0]
        if cuts:
            self.stopped = True
            return full[: min(cuts)]
        return full

    def _hand_out(self, final: str) -> str:
        if not final.startswith(self.text) or len(final) <= len(self.text):
            return ""
        piece, self.text = final[len(self.text) :], final
        return piece

    def feed(self, tokens: list[int]) -> str:
        """Add tokens; returns the text that is final now (nothing more once a stop string matched)."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        full = self._decoded()
        if not self.stopped:
            full = full.rstrip("\ufffd")
            full = full[: len(full) - self._hold] if self._hold else full
        return self._hand_out(full)

    def finish(self) -> str:
        """The rest of the text, at the end of the request."""
        return self._hand_out(self._decoded())
