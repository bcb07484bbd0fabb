"""One request of each kind through the app before the server says it is ready
(docs/architecture.md, "Serving"): the engine's warm-up compiles its kernels and captures its
graphs, but the first request also meets first-time work on both sides (request parsing and
validation, the chat encoding, detokenisation and streaming, the engine's first admission of a
request), about 20 ms of TTFT on an H200. Sent in process (ASGI, no socket), a streamed
completion, a streamed chat completion and a streamed JSON-mode chat completion (its grammar
compiled and, with `--grammar-worker process`, the grammar worker started before READY, not in
the first constrained request's TTFT) of two tokens each; the server's request metrics start
after them (`ServerState.metrics` is made again)."""
from __future__ import annotations

import sys

import httpx

from .state import ServerState

MAX_TOKENS = 2


def warm_bodies(model: str) -> list[tuple[str, dict]]:
    """(path, JSON body) of the warm-up requests."""
    common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    chat = {**common, "messages": [{"role": "user", "content": "warm-up"}]}
    return [("/v1/completions", {**common, "prompt": "warm-up"}),
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})]


async def warm_up(app, state: ServerState) -> bool:
    """Send the warm-up requests through `app`; False (with a line on stderr) when one fails:
    the server still starts, the first user request is then the one that pays."""
    headers = {"Authorization": f"Bearer {state.api_key}"} if state.api_key else {}
    ok = True
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm-up",
                                 timeout=None) as client:
        for path, body in warm_bodies(state.model_names[0]):
            try:
                response = await client.post(path, json=body, headers=headers)
                failed = response.status_code != 200 or b"[DONE]" not in response.content
            except Exception as e:      # any failure is reported, never fatal (see above)
                failed, response = True, e
            if failed:
                ok = False
                print(f"dsv4 serve: the warm-up request to {path} failed: {str(getattr(response, 'text', response))[:200]}",
                      file=sys.stderr, flush=True)
    state.metrics = state.metrics.fresh()
    return ok
