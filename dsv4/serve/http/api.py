"""The FastAPI app of the API process: routes, bearer-token check, body-size limit, error
bodies, the OpenAPI schema.

`build_app(state)` needs a started `EngineClient` (inside `state`); the app's lifespan
starts the client's socket tasks in the server's event loop. With an API key, every
`/v1/*` route and `/tokenize`, `/detokenize` need `Authorization: Bearer KEY` (401
otherwise); `/health`, `/metrics`, `/version` and `/openapi.json` stay open, as in vLLM.
Every GET route answers HEAD too (`HeadAsGet`).
"""
from __future__ import annotations

import contextlib
import hmac
import inspect

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from . import errors, openapi, render, utility
from .chat import create_chat_completion
from .completions import create_completion
from .limits import BodySizeLimit
from .metrics import CONTENT_TYPE
from .state import ServerState
from .warm_request import warm_up

PROTECTED = ("/v1/", "/tokenize", "/detokenize")


def build_app(state: ServerState, on_ready=None, warm: bool = False, server_index: int | None = None) -> FastAPI:
    """warm: send the warm-up requests (serve/http/warm_request.py) before `on_ready` (a
    function, or one returning an awaitable: awaited). server_index: this API process's index,
    named in every response's `X-DSV4-API-Server` header (several API processes, api_workers.py)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.client.run()
        if warm:
            await warm_up(app, state)                 # the first user request then runs warm
        state.client.on_stats = state.metrics.update
        if on_ready is not None and inspect.isawaitable(result := on_ready()):
            await result
        yield

    app = FastAPI(title="dsv4", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.dsv4 = state
    errors.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=state.limits.max_body_bytes)
    if state.api_key:
        app.add_middleware(BearerAuth, api_key=state.api_key)
    if server_index is not None:
        app.add_middleware(ServerIndexHeader, index=server_index)
    app.add_middleware(HeadAsGet)
    _add_routes(app, state)
    openapi.install(app, utility.version()["version"])
    return app


class BearerAuth:
    """Pure ASGI middleware (it never wraps a response, so streams and disconnects pass
    through untouched): a protected route without the right bearer token gets a 401."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = errors.APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                                        None, "invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeadAsGet:
    """Pure ASGI middleware: `HEAD` is answered as `GET` without the body (status and headers as
    GET's: `HEAD /health` is 200 when GET's is); FastAPI's GET routes take no HEAD by themselves."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)
        await self.app({**scope, "method": "GET"}, receive, without_body)


class ServerIndexHeader:
    """Pure ASGI middleware: `X-DSV4-API-Server: <index>` on every response (which API process
    answered, with several: api_workers.py)."""

    def __init__(self, app, index: int):
        self.app, self.header = app, (b"x-dsv4-api-server", str(index).encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)
        await self.app(scope, receive, send_with_header)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _require_engine(state)
        return await create_chat_completion(request, state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _require_engine(state)
        return await create_completion(request, state)

    @app.get("/v1/models")
    async def models() -> dict:
        return utility.list_models(state)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        return utility.get_model(model_id, state)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _in_thread(utility.tokenize, await request.body(), state)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _in_thread(utility.detokenize, await request.body(), state)

    @app.get("/version")
    async def version() -> dict:
        return utility.version()

    @app.get("/health")
    async def health() -> Response:
        if state.client.alive:
            return Response(status_code=200)
        return JSONResponse(errors.error_body(503, "the engine core is not running"), status_code=503)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        _require_engine(state)
        state.client.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def _in_thread(handler, raw: bytes, state: ServerState) -> Response:
    """handler(raw, state) -> dict, run and JSON-encoded in a worker thread (a million
    token ids take a while either way), in pieces (render.py: the loop gets the GIL between them)."""
    return Response(await run_in_threadpool(lambda: render.render(handler(raw, state))), media_type="application/json")


def _require_engine(state: ServerState) -> None:
    if not state.client.alive:
        raise errors.APIError(503, "the engine core is not running", None, "engine_dead")
