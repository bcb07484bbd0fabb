"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx.

Handlers raise `APIError`; `install(app)` turns it, request-validation problems,
Starlette's own 404/405 and any other exception (a 500, logged) into that body. `validation_error` converts a pydantic
ValidationError into a 400 naming the first offending field.
"""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
         503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else status

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_value_error(error: ValueError, default_param: str | None = None,
                     rename: dict[str, str] | None = None) -> APIError:
    """A ValueError whose message starts with "field: ..." (the engine's and SamplingParams'
    convention) becomes a 400 with that field as param (renamed to the API's name)."""
    text = str(error)
    head, sep, _ = text.partition(":")
    param = head if sep and head.isidentifier() else default_param
    if param is not None and rename:
        param = rename.get(param, param)
    return bad_request(text, param)


_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_LABELS = {"str", "int", "float", "bool", "none"}


def validation_error(error: ValidationError) -> APIError:
    """400 naming the first bad field, e.g. `messages.0.role` (pydantic's union-member
    labels such as `str` or `list[int]` are left out of the path)."""
    first = error.errors()[0]
    path = [str(p) for p in first["loc"]
            if isinstance(p, int) or (_FIELD.match(str(p)) and str(p) not in _TYPE_LABELS)]
    loc = ".".join(path)
    return bad_request(f"{loc or 'body'}: {first['msg']}", loc or None)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> Response:
        """The client hung up while sending its body: nobody reads the answer (no 500, no traceback)."""
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        """Anything else (a bug, a resource limit): a 500 for this request; Starlette
        re-raises it afterwards, so uvicorn logs the traceback; the server goes on."""
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
