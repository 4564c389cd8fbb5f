"""The OpenAI-compatible HTTP front end (aiohttp): routes, authentication, streaming, errors.

Routes: POST /v1/completions, POST /v1/chat/completions (both with ``stream: true`` as server-sent events),
GET /v1/models, GET /health (200 once the engine thread serves), GET /metrics (Prometheus text). A handler
turns a body into an engine request (``protocol``), hands it to the engine thread (``EngineLoop``) and turns
the tokens it gets back into text: decoded whole each time (so a multi-byte character cut between tokens comes
out once complete), stop strings cut it and abort the request. A client that disconnects aborts its request.

With an ``AdapterCatalog`` the served ids are the base and its adapters (``/v1/models`` lists them, a live
adapter with its ``step``), and a request names one in ``model``; ``allow_runtime_lora`` adds vLLM's
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (bodies ``{"lora_name", "lora_path"}``). A response
from a live adapter names the optimizer step it ran on in ``system_fingerprint`` (``step-N``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from harli_train.adapter import AdapterError
from harli_train.data.dataset import DataError
from harli_train.data.tokenization import chat_prompt_ids
from harli_train.engine.adapters import AdapterCatalog
from harli_train.serve import protocol
from harli_train.serve.engine_loop import QueueFull, RequestHandle, RequestPort
from harli_train.serve.prometheus import ServerMetrics
from harli_train.serve.text_reader import TextReader

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
        models: list[str] | AdapterCatalog,
        api_key: str | None = None,
        alive: Callable[[], bool] = lambda: True,
        extra_metrics: Callable[[], dict[str, float]] | None = None,
        allow_runtime_lora: bool = False,
    ) -> None:
        self.port, self.tokenizer, self.max_model_len = port, tokenizer, max_model_len
        self.catalog = models if isinstance(models, AdapterCatalog) else None
        self._fixed = None if self.catalog is not None else list(models)
        self.api_key, self.alive, self.allow_runtime_lora = api_key, alive, allow_runtime_lora
        self.started = time.time()
        self.metrics = ServerMetrics()
        self.extra_metrics = extra_metrics

    @property
    def models(self) -> list[str]:
        """The model ids served now."""
        return self.catalog.ids() if self.catalog is not None else list(self._fixed)

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
        if self.allow_runtime_lora:
            app.add_routes(
                [
                    web.post("/v1/load_lora_adapter", self.load_lora_adapter),
                    web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
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
        cards = self.catalog.cards if self.catalog is not None else ()
        data = [{"id": m, "object": "model", "created": int(self.started), "owned_by": "harli-train"}
                for m in (self._fixed or [])]  # fmt: skip
        for card in cards:
            entry = {"id": card.id, "object": "model", "created": int(self.started),
                     "owned_by": "harli-train", "root": card.root or card.id,
                     "parent": card.parent}  # fmt: skip
            if card.step is not None:
                entry["step"] = card.step  # the optimizer step the live adapter reflects
            data.append(entry)
        return web.json_response({"object": "list", "data": data})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's route: read the adapter (off the engine's thread), then put it in a slot (on it)."""
        import asyncio

        name, path = self._lora_body(await self._json(request), need_path=True)
        aio = asyncio.get_running_loop()
        try:
            weights = await aio.run_in_executor(None, self.catalog.read, path)
            await self.port.call(lambda: self.catalog.add(name, weights, path), aio)
        except AdapterError as err:
            raise protocol.APIError(400, str(err), param="lora_path") from None
        log.info("loaded adapter %s from %s", name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        import asyncio

        name, _ = self._lora_body(await self._json(request), need_path=False)
        try:
            await self.port.call(lambda: self.catalog.remove(name), asyncio.get_running_loop())
        except AdapterError as err:
            raise protocol.APIError(400, str(err), param="lora_name") from None
        except KeyError:
            raise protocol.APIError(404, f"no loaded adapter is named '{name}' (served: "
                                    f"{', '.join(self.models)})", param="lora_name",
                                    code="model_not_found") from None  # fmt: skip
        log.info("unloaded adapter %s", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    @staticmethod
    def _lora_body(body: Any, need_path: bool) -> tuple[str, str]:
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
            raise protocol.APIError(400, "'lora_name' is required (a non-empty string)", param="lora_name")
        path = body.get("lora_path")
        if need_path and (not isinstance(path, str) or not path):
            raise protocol.APIError(400, "'lora_path' is required (an adapter directory)", param="lora_path")
        return body["lora_name"], path

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
            aio = asyncio.get_running_loop()
            handle = self.port.submit(req.prompt, req.params, req.object_id, aio, req.model)
        except QueueFull:
            self.metrics.count_error(429)
            body = protocol.APIError(429, "the server's queue is full: retry later", "rate_limit_error",
                                     code="queue_full").body()  # fmt: skip
            return web.json_response(body, status=429, headers={"Retry-After": "1"})
        self.metrics.started(req.kind)
        reader = TextReader(self.tokenizer, req.stop)
        if not req.stream:
            try:
                return await self._whole(req, handle, reader)
            finally:
                if handle.seq is not None and not handle.seq.is_finished:
                    handle.abort()  # the handler was cancelled: the client went away
        return await self._streamed(request, req, handle, reader)

    async def _whole(self, req, handle: RequestHandle, reader: TextReader) -> web.Response:
        t0, first, n_tokens, prompt_tokens = time.perf_counter(), None, 0, 0
        while True:
            event = await handle.events.get()
            prompt_tokens = event.prompt_tokens or prompt_tokens
            if event.done:
                if event.finish_reason == "refused":
                    raise _refusal(event)
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
            protocol.response(req, text, reason, protocol.usage(prompt_tokens, n_tokens), _fingerprint(event))
        )

    async def _streamed(self, request, req, handle: RequestHandle, reader: TextReader) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        t0, first, n_tokens, prompt_tokens, sent_first = time.perf_counter(), None, 0, 0, False
        try:
            event = await handle.events.get()
            if event.done and event.finish_reason == "refused":  # refused before any byte went out
                raise _refusal(event)
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
                fingerprint = _fingerprint(event)
                await _send(
                    resp, protocol.chunk(req, piece, None, first=not sent_first, fingerprint=fingerprint)
                )
                sent_first = True
                if reader.stopped:
                    handle.abort()
                    break
                event = await handle.events.get()
            rest = reader.finish()  # what was held back rides in the last chunk, with the finish reason
            reason = "stop" if reader.stopped else protocol.finish_reason(event.finish_reason)
            await _send(
                resp, protocol.chunk(req, rest, reason, first=not sent_first, fingerprint=_fingerprint(event))
            )
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


def _refusal(event) -> protocol.APIError:
    """The error a request refused by the engine's owner answers with."""
    if event.status == 404:
        return protocol.APIError(404, event.error or "the model is not served", param="model",
                                 code="model_not_found")  # fmt: skip
    return protocol.APIError(400, event.error or "the request was refused", code="context_length_exceeded")


def _fingerprint(event) -> str | None:
    """``system_fingerprint`` of a response: the live adapter's optimizer step it ran on."""
    return None if event.step is None else f"step-{event.step}"


async def _send(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
