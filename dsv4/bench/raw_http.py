"""A small HTTP/1.1 client over asyncio streams for the serving benchmark's http:// requests.

At hundreds of concurrent streams a general client (httpx over httpcore and h11) spends more
CPU per streamed chunk than the server under test does to make it, so the benchmark would
measure itself. This one does only what `sse_client` needs: a POST with a body, the status,
then the body as bytes or as lines, framed by `Transfer-Encoding: chunked`, `Content-Length`
or the end of the connection. Connections are kept alive and reused per host:port (a reused
one the server closed meanwhile is replaced once, before any byte of the answer arrived).
`timeout`: seconds without progress (connecting, or between reads) before the exchange fails.

`RawClient.stream(...)` has the shape of `httpx.AsyncClient.stream` that `sse_client` uses:
an async context manager giving a response with `status_code`, `aread()` and `aiter_lines()`.
Every failure is a `RawHTTPError` (an OSError).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class RawHTTPError(OSError):
    """The exchange failed: the connection closed early, a malformed answer, no progress."""


class RawClient:
    def __init__(self, timeout: float):
        self.timeout = timeout
        self._idle: dict[tuple[str, int], list[Connection]] = {}

    async def __aenter__(self) -> "RawClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for _, writer in connections:
                writer.close()
        self._idle.clear()

    def stream(self, method: str, url: str, content: bytes, headers: dict[str, str] | None = None) -> "RawResponse":
        return RawResponse(self, method, url, content, headers or {})

    async def _connect(self, address: tuple[str, int]) -> tuple[Connection, bool]:
        """(a connection, whether it is a reused one)."""
        idle = self._idle.get(address)
        if idle:
            return idle.pop(), True
        try:
            return await asyncio.wait_for(asyncio.open_connection(*address), self.timeout), False
        except asyncio.TimeoutError:
            raise RawHTTPError(f"no connection to {address[0]}:{address[1]} within {self.timeout:g} s") from None

    def _release(self, address: tuple[str, int], connection: Connection) -> None:
        self._idle.setdefault(address, []).append(connection)


class RawResponse:
    """One exchange: entering sends the request and reads the head; leaving gives the
    connection back when its body was read to the end (and the server keeps it open)."""

    def __init__(self, client: RawClient, method: str, url: str, content: bytes, headers: dict[str, str]):
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise RawHTTPError(f"only http:// URLs, got {url!r}")
        self.client, self.address = client, (parts.hostname or "127.0.0.1", parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = {"Host": parts.netloc, "Content-Length": str(len(content)), "Accept": "*/*", **headers}
        self.request = (f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items())
                        + "\r\n").encode("latin-1") + content
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self._conn: Connection | None = None
        self._done = False                 # the body was read to its end
        self._timed_out = False
        self._last = 0.0                   # loop time of the last progress
        self._watch: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> "RawResponse":
        for attempt in (0, 1):
            self._conn, reused = await self.client._connect(self.address)
            try:
                await self._send_and_read_head()
                return self
            except RawHTTPError:
                self._drop()
                if not reused or self._timed_out or attempt:
                    raise
        raise AssertionError("unreachable")

    async def __aexit__(self, *exc) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._done and self._conn is not None and self.headers.get("connection", "").lower() != "close":
            self.client._release(self.address, self._conn)
            self._conn = None
        self._drop()

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    # ---- progress watch --------------------------------------------------------------------
    def _arm(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        self._watch = loop.call_later(self.client.timeout, self._check)

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self._last
        if quiet < self.client.timeout:
            self._watch = loop.call_later(self.client.timeout - quiet, self._check)
        elif self._conn is not None:
            self._timed_out = True
            self._conn[1].transport.abort()      # the pending read ends: see _failure

    def _failure(self, what: str) -> RawHTTPError:
        if self._timed_out:
            return RawHTTPError(f"no progress for {self.client.timeout:g} s")
        return RawHTTPError(what)

    # ---- the exchange ----------------------------------------------------------------------
    async def _send_and_read_head(self) -> None:
        reader, writer = self._conn
        self._arm()
        try:
            writer.write(self.request)
            raw = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as e:
            raise self._failure(f"no answer ({type(e).__name__})") from None
        self._last = asyncio.get_running_loop().time()
        lines = raw.decode("latin-1").split("\r\n")
        status = lines[0].split(" ", 2)
        if len(status) < 2 or not status[0].startswith("HTTP/") or not status[1].isdigit():
            raise RawHTTPError(f"malformed status line {lines[0][:100]!r}")
        self.status_code = int(status[1])
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                self.headers[name.strip().lower()] = value.strip()

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive."""
        reader = self._conn[0]
        loop = asyncio.get_running_loop()
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                    self._last = loop.time()
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass                   # trailer fields
                        break
                    piece = await reader.readexactly(size + 2)
                    yield piece[:-2]
            elif "content-length" in self.headers:
                piece = await reader.readexactly(int(self.headers["content-length"]))
                self._last = loop.time()
                yield piece
            else:
                self.headers["connection"] = "close"        # framed by the end of the connection
                while piece := await reader.read(65536):
                    self._last = loop.time()
                    yield piece
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError) as e:
            raise self._failure(f"the body ended early or is malformed ({type(e).__name__})") from None
        self._done = True

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines (UTF-8, without their \\n or \\r\\n)."""
        rest = b""
        async for piece in self._pieces():
            *lines, rest = (rest + piece).split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if rest:
            yield rest.rstrip(b"\r").decode()
