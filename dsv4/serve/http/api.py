"""The FastAPI app of the API process: routes, bearer-token check, error bodies.

`build_app(state)` needs a started `EngineClient` (inside `state`); the app's lifespan
starts the client's socket tasks in the server's event loop and shuts the engine down at
exit. With an API key, every `/v1/*` route needs `Authorization: Bearer KEY` (401
otherwise); `/health` and `/metrics` stay open, as in vLLM.
"""
from __future__ import annotations

import contextlib
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import errors
from .chat import create_chat_completion
from .completions import create_completion
from .metrics import CONTENT_TYPE
from .state import ServerState


def build_app(state: ServerState, on_ready=None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.client.on_stats = state.metrics.update
        state.client.run()
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="dsv4", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dsv4 = state
    errors.install(app)
    _add_auth(app, state.api_key)
    _add_routes(app, state)
    return app


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)


class BearerAuth:
    """Pure ASGI middleware (it never wraps a response, so streams and disconnects pass
    through untouched): `/v1/*` without the right bearer token gets a 401."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = errors.APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                                        None, "invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "dsv4", "root": state.model_dir,
             "max_model_len": state.info.max_model_len} for name in state.model_names]}

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


def _require_engine(state: ServerState) -> None:
    if not state.client.alive:
        raise errors.APIError(503, "the engine core is not running", None, "engine_dead")
