"""The HTTP/1.1 connection of the API process: uvicorn's httptools protocol with the limits it
lacks (docs/architecture.md, "Serving").

* A header-read timeout: a request's line and headers must arrive within `header_timeout`
  seconds of the connection's start (the first request) or of the request's first byte (a
  later one on a kept-alive connection); else the client gets a 408 and the connection is
  closed. uvicorn times out idle kept-alive connections only, so a client that sends half a
  request line held its connection forever.
* A body idle timeout: once the headers are in, a request body may go at most `body_timeout`
  seconds without a byte arriving (while the server reads; not while it has paused reading
  for the application to catch up); else a 408 where no answer has started, and the
  connection is closed either way, the application seeing a disconnect. A client that sent
  headers and then its body a byte a minute held the connection and its request forever.
* Headers are bounded: more than `MAX_HEADER_BYTES` of request line and headers is a 431 and
  the connection is closed (httptools buffers a header of any size).
* Malformed framing is a 400 with an OpenAI error body (uvicorn writes plain text).
Every such answer closes the connection, as uvicorn's own 400 does.
"""
from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .errors import error_body

HEADER_TIMEOUT_S = 60.0       # a reverse proxy's usual client header timeout
BODY_TIMEOUT_S = 60.0         # ... and its usual client body timeout (between two reads)
MAX_HEADER_BYTES = 1 << 20    # (bytes read while the headers were incomplete, counted per read)


class _Deadline:
    """A re-armable timer on the loop: `expired()` runs `seconds` after the last `arm`, unless
    cancelled first."""

    def __init__(self, loop, seconds: float, expired):
        self.loop, self.seconds, self.expired, self.handle = loop, seconds, expired, None

    @property
    def armed(self) -> bool:
        return self.handle is not None

    def arm(self) -> None:
        self.cancel()
        self.handle = self.loop.call_later(self.seconds, self._fire)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _fire(self) -> None:
        self.handle = None
        self.expired()


class LimitedHttpProtocol(HttpToolsProtocol):
    header_timeout: float = HEADER_TIMEOUT_S
    body_timeout: float = BODY_TIMEOUT_S

    def connection_made(self, transport) -> None:
        self._headers = _Deadline(self.loop, self.header_timeout, self._headers_timed_out)
        self._body = _Deadline(self.loop, self.body_timeout, self._body_timed_out)
        self._header_bytes = 0
        super().connection_made(transport)
        self._headers.arm()

    def connection_lost(self, exc) -> None:
        self._headers.cancel()
        self._body.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._headers.armed and not self.transport.is_closing():    # headers still incomplete
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._headers.cancel()
                self._refuse(431, f"the request line and headers are larger than {MAX_HEADER_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._headers.armed:
            self._header_bytes = 0
            self._headers.arm()

    def on_headers_complete(self) -> None:
        self._headers.cancel()
        super().on_headers_complete()
        self._body.arm()              # (a request without a body completes at once: cancelled)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body.arm()

    def on_message_complete(self) -> None:
        self._body.cancel()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        self._headers.cancel()
        self._answer_and_close(400, msg)

    def _headers_timed_out(self) -> None:
        if not self.transport.is_closing():
            self._refuse(408, f"the request's headers did not arrive within {self.header_timeout:g} s "
                              f"(--header-timeout)")

    def _body_timed_out(self) -> None:
        if self.transport.is_closing() or self.cycle is None:
            return
        if self.flow.read_paused:         # we stopped reading, not the client: wait on
            self._body.arm()
            return
        cycle = self.cycle
        cycle.disconnected = True         # the application's receive() says so; its sends are dropped
        cycle.message_event.set()
        if cycle.response_started:
            self.transport.close()
        else:
            self._answer_and_close(408, f"no byte of the request's body arrived for {self.body_timeout:g} s "
                                        f"(--body-timeout)")

    def _refuse(self, status: int, message: str) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self.flow.pause_reading()          # an earlier pipelined request's answer still goes out,
            self.cycle.keep_alive = False      # then the connection closes
            return
        self._answer_and_close(status, message)

    def _answer_and_close(self, status: int, message: str) -> None:
        body = json.dumps(error_body(status, message)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def http_protocol(header_timeout: float = HEADER_TIMEOUT_S,
                  body_timeout: float = BODY_TIMEOUT_S) -> type[LimitedHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`."""
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})
