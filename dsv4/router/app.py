"""The router's ASGI app: OpenAI requests in, forwarded to a decode engine that pulls the
prompt's state from a prefill engine (the `x-dsv4-kv-transfer` header names the prefill
engine's state server).

Failure rules: an engine that cannot be reached, or answers 502/503/504 before any byte of the
body (a decode engine whose transfer failed answers that way, having released its pages),
is retried with another pair while untried engines remain; then the last error is returned
(an OpenAI error body, 502 when no engine answered). A stream cut after bytes were sent ends
with an error event and [DONE]. A client that goes away closes the upstream request, so the
decode engine aborts (and the prefill engine drops the transfer).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..disagg.settings import KV_TRANSFER_HEADER
from .backends import Backend, Pool
from .metrics import RouterMetrics

RETRY_STATUSES = {502, 503, 504}
PASS_HEADERS = ("authorization", "content-type", "x-request-id")


def error_body(status: int, message: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


class Router:
    def __init__(self, prefill: Pool, decode: Pool, timeout: float = 600.0):
        self.prefill, self.decode = prefill, decode
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), trust_env=False)
        self.metrics = RouterMetrics()

    async def state_address(self, p: Backend) -> str:
        if p.state_address is None:
            r = await self.http.get(f"{p.url}/disagg/info")
            r.raise_for_status()
            info = r.json()
            if info.get("role") != "prefill" or not info.get("state_address"):
                raise httpx.HTTPError(f"{p.url} is not a prefill engine ({info.get('role')})")
            p.state_address = info["state_address"]
        return p.state_address

    async def forward(self, request: Request, path: str) -> Response:
        body, start = await request.body(), time.monotonic()
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASS_HEADERS}
        tried_p, tried_d, last = set(), set(), error_body(502, "no engine could take the request")
        self.metrics.requests += 1
        while True:
            p, d = self.prefill.pick(tried_p), self.decode.pick(tried_d)
            if p is None or d is None:
                self.metrics.failures += 1
                return last
            tried_p.add(p.url)
            try:
                headers[KV_TRANSFER_HEADER] = await self.state_address(p)
            except (httpx.HTTPError, ValueError) as e:
                p.mark_down()
                last = error_body(502, f"prefill engine {p.url} unreachable: {e}")
                self.metrics.retries += 1
                continue
            response = await self._try(request, d, p, path, body, headers)
            if isinstance(response, Response):
                self.metrics.observe_first(time.monotonic() - start)
                return response
            last, blame = response
            (tried_d.add(d.url) if blame == "decode" else None)
            self.metrics.retries += 1

    async def _try(self, request: Request, d: Backend, p: Backend, path: str, body: bytes, headers: dict):
        """A Response to return, or (error response, which side failed) to retry."""
        req = self.http.build_request("POST", f"{d.url}{path}", content=body, headers=headers)
        d.in_flight += 1
        p.in_flight += 1
        try:
            upstream = await _unless_disconnected(request, self.http.send(req, stream=True))
        except ClientGone:
            d.in_flight -= 1
            p.in_flight -= 1
            return Response(status_code=499)        # nobody reads it; the upstream request was closed
        except httpx.HTTPError as e:
            d.in_flight -= 1
            p.in_flight -= 1
            d.mark_down()
            return error_body(502, f"decode engine {d.url} unreachable: {type(e).__name__}"), "decode"
        if upstream.status_code in RETRY_STATUSES:
            text = (await upstream.aread()).decode(errors="replace")
            await upstream.aclose()
            d.in_flight -= 1
            p.in_flight -= 1
            blame = "prefill" if "prefill engine" in text else "decode"
            (p if blame == "prefill" else d).failures += 1
            return Response(text, upstream.status_code, media_type="application/json"), blame
        p.in_flight -= 1                        # the state has moved: the prefill engine is done
        d.served += 1
        return StreamingResponse(self._relay(upstream, d), upstream.status_code,
                                 media_type=upstream.headers.get("content-type"))

    async def _relay(self, upstream: httpx.Response, d: Backend):
        sse = "text/event-stream" in upstream.headers.get("content-type", "")
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self.metrics.failures += 1
            if sse:
                message = {"error": {"message": f"lost decode engine {d.url}: {type(e).__name__}",
                                     "type": "server_error", "code": 502}}
                yield f"data: {json.dumps(message)}\n\ndata: [DONE]\n\n".encode()
        finally:
            d.in_flight -= 1
            await upstream.aclose()


class ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work):
    """Await `work` (the decode engine's response headers: prefill and transfer happen
    meanwhile) unless the client hangs up first; then cancel it, which closes the upstream
    connection, so the decode engine aborts the request (and its transfer)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await task
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="dsv4 router")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        d = router.decode.pick()
        try:
            r = await router.http.get(f"{d.url}/v1/models", headers={
                k: v for k, v in request.headers.items() if k.lower() == "authorization"})
        except httpx.HTTPError as e:
            return error_body(502, f"decode engine {d.url} unreachable: {type(e).__name__}")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        infos = {}
        for b in router.prefill.backends + router.decode.backends:
            try:
                infos[b.url] = (await router.http.get(f"{b.url}/disagg/info", timeout=2.0)).json()
            except (httpx.HTTPError, ValueError):
                infos[b.url] = None
        return PlainTextResponse(router.metrics.render(router.prefill.backends + router.decode.backends, infos))

    @app.on_event("shutdown")
    async def close() -> None:
        await router.http.aclose()

    return app
