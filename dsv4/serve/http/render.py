"""JSON response bodies that never stall the event loop (docs/architecture.md, "Serving").

A large body (a completion with n=128 and 20 top logprobs a token: tens of MB) took one
`json.dumps` call of seconds. Run in a worker thread that call still stalls every stream: the C
encoder holds the GIL for the whole call. `pieces` encodes a body as many `json.dumps` calls of
at most ~`PIECE` values each, so a thread rendering it lets the event loop have the GIL between
any two; `json_response` renders a large body so in a worker thread (`to_thread`: replaceable in
tests), a small one at once. The text is the one `json.dumps(body, ensure_ascii=False,
allow_nan=False, separators=(",", ":"))` gives (Starlette's `JSONResponse`), byte for byte.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

from fastapi.responses import Response

PIECE = 2048                 # values per encoder call (~1-3 ms of json.dumps)
STRING_CHARS = 1 << 18       # characters of one string per encoder call (~1 ms)
IN_THREAD_FROM = 4 * PIECE   # bodies estimated larger are rendered in a worker thread
SHORT_LIST = 64              # lists up to this long are weighed element by element

_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def weight(value) -> int:
    """An estimate of the values in `value` (a long list counts as its first element times its
    length: the lists of a response body hold alike entries); cheap next to encoding it."""
    if isinstance(value, dict):
        return 1 + sum(weight(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        if len(value) <= SHORT_LIST:
            return 1 + sum(weight(v) for v in value)
        return 1 + len(value) * weight(value[0])
    if isinstance(value, str):
        return 1 + len(value) * PIECE // STRING_CHARS
    return 1


def pieces(value, budget: int = PIECE) -> Iterator[str]:
    """`value`'s JSON text in pieces, each one encoder call over about `budget` values or fewer."""
    if weight(value) <= budget:
        yield _encode(value)
    elif isinstance(value, dict) and all(isinstance(k, str) for k in value):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + _encode(key) + ":"
            yield from pieces(item, budget)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        if len(value) <= SHORT_LIST:
            for i, item in enumerate(value):
                if i:
                    yield ","
                yield from pieces(item, budget)
        else:
            step = max(1, budget // weight(value[0]))
            for i in range(0, len(value), step):
                if i:
                    yield ","
                if step == 1:
                    yield from pieces(value[i], budget)
                else:
                    yield _encode(value[i:i + step])[1:-1]
        yield "]"
    elif isinstance(value, str):
        yield '"'
        for i in range(0, len(value), STRING_CHARS):
            yield _encode(value[i:i + STRING_CHARS])[1:-1]
        yield '"'
    else:                # (a dict with keys other than strings: JSON's own key conversions)
        yield _encode(value)


def render(value) -> bytes:
    return "".join(pieces(value)).encode()


to_thread = asyncio.to_thread


async def json_response(value, status_code: int = 200, headers: dict | None = None) -> Response:
    """A JSON response, rendered in a worker thread when large."""
    body = await to_thread(render, value) if weight(value) > IN_THREAD_FROM else render(value)
    return Response(body, status_code=status_code, headers=headers, media_type="application/json")
