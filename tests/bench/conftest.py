"""A tiny fake OpenAI-compatible streaming server on a free loopback port.

It answers /v1/completions and /v1/chat/completions with `max_tokens` content chunks
(`tokens_per_chunk` tokens each) followed, when asked, by a usage chunk and `[DONE]`.
It is deterministic: the n-th request it receives (1-based) fails with HTTP 500 when
`fail_every` divides n, and `chunk_delay` (default 0) is the only sleep.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class FakeOpenAIServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fail_every: int = 0, send_usage: bool = True, tokens_per_chunk: int = 1,
                 chunk_delay: float = 0.0, stream_error: bool = False):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fail_every, self.send_usage, self.tokens_per_chunk = fail_every, send_usage, tokens_per_chunk
        self.chunk_delay, self.stream_error = chunk_delay, stream_error
        self.requests: list[tuple[str, dict]] = []  # (path, body) in arrival order
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def admit(self, path: str, body: dict) -> int:
        with self.lock:
            self.requests.append((path, body))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return len(self.requests)

    def release(self) -> None:
        with self.lock:
            self.in_flight -= 1


class _Handler(BaseHTTPRequestHandler):
    server: FakeOpenAIServer

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        number = self.server.admit(self.path, body)
        self.released = False
        try:
            if self.path not in ENDPOINTS:
                return self._error(404, f"no route {self.path}")
            if self.server.fail_every and number % self.server.fail_every == 0:
                return self._error(500, "injected failure")
            self._stream(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up mid-stream (it stops reading after an error event)
        finally:
            self._release()

    def _release(self) -> None:
        """The request leaves the in-flight count before its last bytes go out: a client that
        has read them may start its next request at once, before this thread resumes."""
        if not self.released:
            self.released = True
            self.server.release()

    def _error(self, status: int, message: str):
        payload = json.dumps({"error": {"message": message, "type": "server_error"}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self._release()
        self.wfile.write(payload)

    def _stream(self, body: dict):
        chat = self.path == "/v1/chat/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self._event(": keep-alive comment, to be ignored")
        if chat:
            self._data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if self.server.stream_error:
            self._data({"error": {"message": "engine failed", "code": 500}})
        for first in range(0, body["max_tokens"], self.server.tokens_per_chunk):
            count = min(self.server.tokens_per_chunk, body["max_tokens"] - first)
            text = "tok " * count
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            self._data({"choices": [choice]})
            time.sleep(self.server.chunk_delay)
        if self.server.send_usage and body.get("stream_options", {}).get("include_usage"):
            self._data({"choices": [], "usage": {"prompt_tokens": _prompt_tokens(body),
                                                 "completion_tokens": body["max_tokens"]}})
        self._release()
        self._event("data: [DONE]")

    def _data(self, chunk: dict):
        self._event("data: " + json.dumps(chunk))

    def _event(self, line: str):
        self.wfile.write((line + "\n\n").encode())
        self.wfile.flush()


def _prompt_tokens(body: dict) -> int:
    if "messages" in body:
        return len(body["messages"][-1]["content"].split())
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


@pytest.fixture
def fake_server():
    """Factory: `fake_server(**behaviour)` starts a FakeOpenAIServer, stopped after the test."""
    started: list[FakeOpenAIServer] = []

    def start(**behaviour) -> FakeOpenAIServer:
        server = FakeOpenAIServer(**behaviour)
        server.thread.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()
