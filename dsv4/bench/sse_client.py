"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

The request asks for exactly `output_len` tokens (`max_tokens` + `ignore_eos`, a vLLM /
SGLang extension) and for a final usage chunk (`stream_options.include_usage`). A chunk
"has content" when it carries generated text: `text` (completions) or `delta.content` /
`delta.reasoning_content` (chat); its text (`text` / `delta.content`) is kept, and so are the
prompt tokens the server resumed from its prefix cache (`usage.prompt_tokens_details.cached_tokens`).
Times are `time.perf_counter()` seconds:
  ttft    = first content chunk - request sent
  latency = end of stream - request sent  (>= ttft)
  itl     = gaps between successive content chunks (one per chunk, not per token)
The client is an httpx.AsyncClient or, cheaper per chunk, a `raw_http.RawClient` (http:// only).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

from dsv4.bench.raw_http import RawClient

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)


class StreamError(Exception):
    """The server reported an error inside the event stream."""


@dataclass
class RequestOutcome:
    success: bool
    prompt_tokens: int = 0   # usage.prompt_tokens, else the prompt length as sent
    output_tokens: int = 0   # usage.completion_tokens, else the number of content chunks
    cached_tokens: int = 0   # usage.prompt_tokens_details.cached_tokens (0 when absent)
    text: str = ""           # the generated text (content, not reasoning)
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than 2 tokens."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def request_body(endpoint: str, model: str, prompt: str | list[int] | list[dict], output_len: int) -> dict[str, Any]:
    """`prompt`: text or token ids (completions), text or a list of messages (chat)."""
    body: dict[str, Any] = {"model": model, "max_tokens": output_len, "ignore_eos": True,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == CHAT_COMPLETIONS:
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        body["messages"] = prompt if chat else [{"role": "user", "content": prompt}]
    elif endpoint == COMPLETIONS:
        body["prompt"] = prompt
    else:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
    return body


async def stream_request(client: httpx.AsyncClient | RawClient, url: str, body: dict[str, Any],
                         prompt_len: int, headers: dict[str, str] | None = None) -> RequestOutcome:
    """Send one streaming request; every failure becomes an unsuccessful outcome. The body
    is encoded before the clock starts, so TTFT does not include client-side JSON work."""
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url, content=payload, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return _failure(f"HTTP {response.status_code}: {text[:300]}", sent)
            return await _read_stream(response, sent, prompt_len)
    except (httpx.HTTPError, OSError, ValueError, StreamError) as e:
        return _failure(f"{type(e).__name__}: {e}", sent)


async def _read_stream(response, sent: float, prompt_len: int) -> RequestOutcome:
    arrivals: list[float] = []  # perf_counter() of every content chunk, in order
    usage: dict[str, Any] = {}
    pieces: list[str] = []
    async for chunk in _sse_chunks(response):
        now = time.perf_counter()
        if chunk.get("error"):
            raise StreamError(json.dumps(chunk["error"])[:300])
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        if _has_content(chunk):
            arrivals.append(now)
            pieces += [_text(choice) for choice in chunk.get("choices") or ()]
    end = time.perf_counter()
    if not arrivals:
        return _failure("the stream carried no generated text", sent)
    return RequestOutcome(
        success=True,
        prompt_tokens=_int_or(usage.get("prompt_tokens"), prompt_len),
        output_tokens=_int_or(usage.get("completion_tokens"), len(arrivals)),
        cached_tokens=_int_or((usage.get("prompt_tokens_details") or {}).get("cached_tokens"), 0),
        text="".join(pieces),
        ttft=arrivals[0] - sent,
        latency=end - sent,
        itl=[b - a for a, b in zip(arrivals, arrivals[1:])],
    )


async def _sse_chunks(response) -> AsyncIterator[dict[str, Any]]:
    """JSON payloads of the `data:` lines, up to `data: [DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` / `id:` fields
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if not isinstance(chunk, dict):
            raise ValueError(f"expected a JSON object per event, got {payload[:100]!r}")
        yield chunk


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _failure(error: str, sent: float) -> RequestOutcome:
    return RequestOutcome(success=False, latency=time.perf_counter() - sent, error=error)
