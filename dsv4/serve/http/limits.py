"""What one request may cost: body bytes (413) and engine requests per HTTP request (400).

`BodySizeLimit` is pure ASGI middleware: a declared Content-Length over the limit is
answered 413 before any byte is read; a chunked body is counted while the handler reads
it and the read fails with the same 413 as soon as it passes the limit (nothing past the
limit is buffered).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import APIError, bad_request
from .media import MediaPolicy

MB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 32 * MB
    max_batch_requests: int = 256      # prompts x n of one HTTP request
    strict_api: bool = False           # unknown request fields: 400 (else ignored with a warning)
    shutdown_timeout: float = 30.0     # seconds running requests get to finish at shutdown
    header_timeout: float = 60.0       # seconds a request's line and headers may take (connection.py)
    body_timeout: float = 60.0         # seconds a request's body may go without a byte (connection.py)
    media: MediaPolicy = MediaPolicy()  # where image URLs may point (docs/vision.md)


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the server's limit of {limit / MB:g} MB "
                              f"(--max-request-body-mb)", None, "request_too_large")


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await BodyTooLarge(self.max_bytes).response()(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)


def check_batch(num_prompts: int, n: int, limits: ServerLimits) -> None:
    """400 when one HTTP request would become more engine requests than allowed."""
    total = num_prompts * n
    if total <= limits.max_batch_requests:
        return
    param = "n" if num_prompts == 1 or n > limits.max_batch_requests else "prompt"
    raise bad_request(f"{param}: {num_prompts} prompt(s) x n={n} is {total} generations; this server allows "
                      f"at most {limits.max_batch_requests} per request (--max-batch-requests)", param)
