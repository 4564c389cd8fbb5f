"""The OpenAI API's request and response bodies: parsing and checking a request into what the engine runs,
and shaping what it drew into completions, chat completions and their streamed chunks.

Everything a client can get wrong is an ``APIError`` carrying the HTTP status and OpenAI's error object
(``{"error": {"message", "type", "param", "code"}}``); the server answers it and goes on serving.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from harli_train.engine.engine_config import EngineError
from harli_train.engine.sampling_params import SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class APIError(Exception):
    """A request the server refuses: ``status`` and the OpenAI error object."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class APIRequest:
    """One parsed request: what to run and how to answer."""

    kind: str  # "completion" or "chat"
    model: str
    prompt: str | list[int]  # text (tokenized by the engine) or token ids (a rendered chat)
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id


def _number(body: dict, key: str, default: float, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise APIError(400, f"'{key}' must be {what} in [{lo}, {hi}], got {value!r}", param=key)
    return value


def _stop(body: dict) -> tuple[list[str], tuple[int, ...]]:
    stop = body.get("stop")
    if stop is None:
        strings: list[str] = []
    elif isinstance(stop, str):
        strings = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        strings = list(stop)
    else:
        raise APIError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    return [s for s in strings if s], tuple(ids)


def _common(body: Any, served: list[str]) -> tuple[str, dict]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' is required (a string; GET /v1/models lists them)", param="model")
    if model not in served:
        raise APIError(404, f"the model '{model}' does not exist (served: {', '.join(served)})",
                       "invalid_request_error", "model", "model_not_found")  # fmt: skip
    n = body.get("n", 1)
    if n != 1:
        raise APIError(400, f"'n' must be 1 (one choice per request), got {n!r}", param="n")
    return model, body


def _params(body: dict, default_max: int | None, max_model_len: int) -> tuple[SamplingParams, list[str]]:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = default_max if default_max is not None else max_model_len
    max_tokens = _number(body, key, default, 1, max_model_len, integer=True)
    strings, ids = _stop(body)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, f"'seed' must be an integer, got {seed!r}", param="seed")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
            top_k=_number(body, "top_k", 0, 0, 1 << 20, integer=True),
            seed=seed,
            stop_token_ids=ids,
            ignore_eos=bool(body.get("ignore_eos", False)),  # vLLM's extension: exactly max_tokens tokens
        )
    except EngineError as err:
        raise APIError(400, str(err)) from None
    return params, strings


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(body.get("stream", False))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    return stream, stream and bool(options.get("include_usage", False))


def parse_completion(body: Any, served: list[str], max_model_len: int) -> APIRequest:
    """A /v1/completions body: one prompt (a string, or a list of token ids)."""
    model, body = _common(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise APIError(
            400, "'prompt' must be a non-empty string or list of token ids (one prompt)", param="prompt"
        )
    params, stop = _params(body, DEFAULT_COMPLETION_TOKENS, max_model_len)
    stream, usage = _stream_flags(body)
    return APIRequest("completion", model, prompt, params, stop, stream, usage, bool(body.get("echo")))


def parse_chat(body: Any, served: list[str], max_model_len: int, render) -> APIRequest:
    """A /v1/chat/completions body; ``render(messages) -> token ids`` applies the model's chat template."""
    model, body = _common(body, served)
    messages = body.get("messages")
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise APIError(
            400, "'messages' must be a non-empty list of {role, content} strings", param="messages"
        )
    ids = render([{"role": m["role"], "content": m["content"]} for m in messages])
    if len(ids) >= max_model_len:
        raise APIError(400, f"the conversation is {len(ids)} tokens; the model's context is {max_model_len}",
                       param="messages", code="context_length_exceeded")  # fmt: skip
    params, stop = _params(body, max_model_len - len(ids), max_model_len)  # by default: up to the context
    stream, usage = _stream_flags(body)
    return APIRequest("chat", model, ids, params, stop, stream, usage)


def finish_reason(engine_reason: str | None) -> str:
    """OpenAI's finish_reason for the engine's: EOS and stop tokens or strings are "stop"."""
    return "length" if engine_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(
    req: APIRequest, text: str, reason: str, used: dict[str, int], fingerprint: str | None = None
) -> dict[str, Any]:
    """The whole (non-streamed) response; ``fingerprint``: its ``system_fingerprint`` (None: left out)."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    out = {"id": req.object_id, "object": obj, "created": req.created, "model": req.model,
           "choices": [choice], "usage": used}  # fmt: skip
    if fingerprint is not None:
        out["system_fingerprint"] = fingerprint
    return out


def chunk(req: APIRequest, text: str | None, reason: str | None, used: dict | None = None,
          first: bool = False, fingerprint: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk: a piece of text, the finish reason, or (with ``used`` and no choice) the usage."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": reason}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]
        obj = "text_completion"
    out = {"id": req.object_id, "object": obj, "created": req.created, "model": req.model, "choices": choices}
    if fingerprint is not None:
        out["system_fingerprint"] = fingerprint
    if used is not None:
        out["choices"], out["usage"] = [], used
    elif req.include_usage:
        out["usage"] = None
    return out
