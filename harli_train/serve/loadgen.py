"""`harli-train loadgen`: replay a trace against a server over HTTP, streaming, and measure what its clients
see: TTFT (send to first token) and every token interval (one streamed token to the next), per request.

Each trace line becomes one streamed ``/v1/completions`` request sent at its arrival time (times
``time_scale``): its ``prompt`` text, or ``prompt_len`` random token ids; ``max_tokens`` its output length
with ``ignore_eos`` (every request streams exactly that many tokens, as in the in-process replay). The result
holds each request's figures and, against ``tpot_ms``, the same objective figures the co-location summary
reports. The server sends one chunk per engine step that drew a token (its text may be empty), so the client
times every token.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harli_train.engine.load import TraceRequest, read_trace, synthetic_prompt
from harli_train.engine.metrics import percentiles


@dataclass(slots=True)
class ClientRecord:
    """One request as its client saw it (seconds since the load's start)."""

    request_id: str
    sent_s: float
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    max_interval_ms: float | None = None
    status: int = 0
    error: str | None = None
    intervals_ms: list[float] = field(default_factory=list)


async def _one(
    session, url: str, model: str, req: TraceRequest, vocab: int, t0: float, headers
) -> ClientRecord:
    # A trace line naming a model asks for it; the others for `model`.
    import aiohttp

    await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
    prompt: Any = req.prompt
    if prompt is None:
        prompt = synthetic_prompt(req.prompt_len, vocab, zlib.crc32(str(req.request_id).encode()))
    body = {"model": req.model or model, "prompt": prompt, "max_tokens": req.output_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}  # fmt: skip
    sent = time.perf_counter()
    rec = ClientRecord(str(req.request_id), sent - t0)
    times: list[float] = []
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = (await resp.json()).get("error", {}).get("message")
                return rec
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload.get("usage"):
                    rec.prompt_tokens = payload["usage"]["prompt_tokens"]
                    rec.output_tokens = payload["usage"]["completion_tokens"]
                if any(c.get("finish_reason") is None for c in payload.get("choices", [])):
                    times.append(time.perf_counter())  # one chunk per step that drew a token
    except aiohttp.ClientError as err:
        rec.error = f"{type(err).__name__}: {err}"
    if times:
        rec.ttft_ms = (times[0] - sent) * 1e3
        gaps = np.diff(times) * 1e3
        rec.intervals_ms = [round(float(g), 3) for g in gaps]
        rec.max_interval_ms = float(gaps.max()) if gaps.size else None
        if len(times) > 1:
            rec.tpot_ms = (times[-1] - times[0]) * 1e3 / (len(times) - 1)
    return rec


async def replay(
    url: str, model: str, requests: list[TraceRequest], vocab: int, api_key: str | None
) -> list[ClientRecord]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        return await asyncio.gather(*(_one(session, url, model, r, vocab, t0, headers) for r in requests))


def summarize(records: list[ClientRecord], tpot_ms: float | None) -> dict[str, Any]:
    """Client-side figures: TTFT, TPOT and token intervals, and (with ``tpot_ms``) the objective's."""
    ok = [r for r in records if r.status == 200 and r.error is None]
    intervals = np.array([x for r in ok for x in r.intervals_ms])
    out: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "ttft_ms": percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": percentiles([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "token_interval_ms": percentiles(intervals),
    }
    if tpot_ms is not None:
        judged = [r.tpot_ms for r in ok if r.tpot_ms is not None]
        violations = int((intervals > tpot_ms).sum())
        out.update(
            objective_tpot_ms=tpot_ms,
            intervals=int(intervals.size),
            violations=violations,
            violation_rate=violations / intervals.size if intervals.size else None,
            tpot_attainment=sum(t <= tpot_ms for t in judged) / len(judged) if judged else None,
        )
    return out


def run_loadgen(
    url: str,
    trace: str | Path,
    model: str | None = None,
    time_scale: float = 1.0,
    api_key: str | None = None,
    tpot_ms: float | None = None,
    out: str | Path | None = None,
    vocab: int = 256,
) -> dict[str, Any]:
    """Replay ``trace`` against the server at ``url``; returns the summary (written with the records to
    ``out`` when given)."""
    import urllib.request

    requests = read_trace(trace)
    for r in requests:
        r.arrival_s *= time_scale
    url = url.rstrip("/").removesuffix("/v1")
    if model is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers)) as resp:
            model = json.load(resp)["data"][0]["id"]
    records = asyncio.run(replay(url, model, requests, vocab, api_key))
    summary = {
        "url": url,
        "model": model,
        "trace": str(trace),
        "time_scale": time_scale,
        **summarize(records, tpot_ms),
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "client_requests.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(asdict(r)) + "\n")
        (out / "client_summary.json").write_text(json.dumps(summary, indent=1))
    return summary
