"""The HTTP level of the API process (serve/http/connection.py, render.py; docs/architecture.md,
"Serving"): headers that never finish get a 408 and a closed connection, oversized headers a
431, malformed framing an OpenAI 400 body; HEAD answers every GET route; a large whole
response is rendered off the event loop, in pieces, while other requests are served."""
import asyncio
import json
import socket
import threading

import httpx
import pytest
import uvicorn

from dsv4.serve.http import connection, render

pytest_plugins = ["serve.server_fixtures"]


def _address(base_url: str) -> tuple[str, int]:
    host, port = base_url.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def _read_to_close(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


def _error_answer(raw: bytes, status: int) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:200]
    assert b"content-type: application/json" in head.lower() and b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.fixture(params=[(0.3, 30.0)])
def tiny_server(request):
    """uvicorn with the API process's protocol (header and body timeouts: the param, by default
    a 0.3 s header timeout) over a trivial app, on loopback; its socket listens before uvicorn
    runs, so clients connect at once."""
    from dsv4.serve.http.server import listen_socket

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, http=connection.http_protocol(*request.param), lifespan="off",
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield sock.getsockname()
    server.should_exit = True
    thread.join(30)
    sock.close()


def test_headers_that_never_finish_get_a_408_and_the_connection_closed(tiny_server):
    with socket.create_connection(tiny_server, timeout=30) as uploading, \
            socket.create_connection(tiny_server, timeout=30) as kept, \
            socket.create_connection(tiny_server, timeout=30) as stalled:
        # complete headers, body pending: its timer (armed first) is cancelled with the headers
        uploading.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(1 << 16).endswith(b"\r\n\r\nok")
        kept.sendall(b"GET / HTTP/1.1\r\nHo")                   # a kept-alive connection's next request
        stalled.sendall(b"GET /heal")                            # half a request line
        for sock in (stalled, kept):
            error = _error_answer(_read_to_close(sock), 408)
            assert "--header-timeout" in error["message"]
        uploading.sendall(b"{}")                                 # (its deadline passed before the others')
        assert uploading.recv(1 << 16).startswith(b"HTTP/1.1 200 ")
    assert httpx.get(f"http://{tiny_server[0]}:{tiny_server[1]}/", trust_env=False).text == "ok"


@pytest.mark.parametrize("tiny_server", [(30.0, 0.3)], indirect=True)
def test_a_body_that_stops_arriving_gets_a_408_and_the_connection_closed(tiny_server):
    with socket.create_connection(tiny_server, timeout=30) as stalled, \
            socket.create_connection(tiny_server, timeout=30) as whole:
        stalled.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{}")     # 2 of 10 bytes
        whole.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        assert whole.recv(1 << 16).endswith(b"\r\n\r\nok")      # a whole body: its timer cancelled
        error = _error_answer(_read_to_close(stalled), 408)
        assert "--body-timeout" in error["message"]
        whole.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")         # (kept alive past the deadline)
        assert whole.recv(1 << 16).endswith(b"\r\n\r\nok")
    assert httpx.get(f"http://{tiny_server[0]}:{tiny_server[1]}/", trust_env=False).text == "ok"


def test_oversized_headers_get_a_431(tiny_server, monkeypatch):
    monkeypatch.setattr(connection, "MAX_HEADER_BYTES", 1000)
    with socket.create_connection(tiny_server, timeout=30) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 1500)
        _error_answer(_read_to_close(sock), 431)


def test_malformed_framing_gets_an_openai_400_body(fake_server):
    with socket.create_connection(_address(fake_server.base_url), timeout=30) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        _error_answer(_read_to_close(sock), 400)
    assert httpx.get(fake_server.base_url + "/health", trust_env=False).status_code == 200


def test_head_answers_every_get_route_without_a_body(fake_server):
    with httpx.Client(base_url=fake_server.base_url, trust_env=False, timeout=30) as http:
        for path in ("/health", "/v1/models", "/v1/models/dsv4-test", "/metrics", "/version", "/openapi.json"):
            got, head = http.get(path), http.head(path)
            assert (head.status_code, head.content) == (200, b""), path
            assert head.headers.get("content-type") == got.headers.get("content-type"), path
        assert http.head("/v1/models/gpt-4").status_code == 404
        assert http.head("/v1/completions").status_code == 405


# ---- large whole responses -----------------------------------------------------------------
def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def test_pieces_are_the_json_text_in_bounded_calls(monkeypatch):
    monkeypatch.setattr(render, "STRING_CHARS", 1000)       # (a long string is cut into pieces too)
    top = [{f"t{j}": -1.0 - j / 7 for j in range(20)} for _ in range(300)]
    chat = {"content": [{"token": "é", "logprob": -1.0, "bytes": [195, 169],
                         "top_logprobs": [{"token": "\"\n", "logprob": -2.5, "bytes": [34, 10]}] * 20}] * 300}
    body = {"id": "x", "choices": [{"index": i, "text": "ab\"\\\u2028" * 40_000, "logprobs": {"top_logprobs": top},
                                    "chat": chat, "empty": [], "nested": [[1, [2]], {}], "ints": {1: 2}}
                                   for i in range(3)], "usage": None}
    parts = list(render.pieces(body, budget=256))
    assert "".join(parts) == _dumps(body) and render.render(body) == _dumps(body).encode()
    assert len(parts) > 1000 and max(len(p) for p in parts) < len(_dumps(body)) // 200
    for value in (1, "x", [], {}, [None] * 100, {"a": float("inf")}):
        if value == {"a": float("inf")}:
            with pytest.raises(ValueError):       # as Starlette's JSONResponse: no NaN/Infinity
                render.render(value)
        else:
            assert render.render(value) == _dumps(value).encode()


def test_a_large_completion_is_rendered_while_other_requests_are_served(fake_server, monkeypatch):
    """The big body's render is held (in its worker thread) until a health check and a whole
    stream have been answered: were it rendered on the event loop, neither could be."""
    rendering, release = threading.Event(), threading.Event()

    async def held_to_thread(fn, *args):
        def held():
            rendering.set()
            assert release.wait(60)
            return fn(*args)
        return await asyncio.to_thread(held)

    monkeypatch.setattr(render, "to_thread", held_to_thread)
    big = {"prompt": "hi", "n": 128, "logprobs": 20, "max_tokens": 16}
    answer = {}
    worker = threading.Thread(target=lambda: answer.update(r=httpx.post(
        fake_server.base_url + "/v1/completions", json=big, timeout=120, trust_env=False)))
    worker.start()
    try:
        assert rendering.wait(60), "the large body was not rendered in a worker thread"
        with httpx.Client(base_url=fake_server.base_url, trust_env=False, timeout=30) as http:
            assert http.get("/health").status_code == 200
            events = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}).text
            assert events.endswith("data: [DONE]\n\n") and events.count("data: {") >= 2
            assert not answer
    finally:
        release.set()
        worker.join(60)
    r = answer["r"]
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert len(choices) == 128 and all(len(top) == 20 for c in choices for top in c["logprobs"]["top_logprobs"])
    assert render.weight(r.json()) > render.IN_THREAD_FROM


@pytest.mark.parametrize("command", [["serve"], ["router", "--prefill", "http://p", "--decode", "http://d"]])
@pytest.mark.parametrize("flag", ["--header-timeout", "--body-timeout"])
def test_timeout_flags_must_be_positive(command, flag, capsys):
    from dsv4.cli import main
    with pytest.raises(SystemExit):
        main([*command, flag, "0"])
    assert f"argument {flag}: expected a positive number (or inf), got 0" in capsys.readouterr().err


def test_the_router_takes_the_header_timeout(tmp_path):
    from serve.server_fixtures import ServerProcess
    router = ServerProcess(["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9", "--port", "0",
                            "--header-timeout", "0.3", "--log-level", "warning"], tmp_path / "router.log",
                           command="router")
    try:
        with socket.create_connection(_address(router.base_url), timeout=30) as stalled:
            stalled.sendall(b"GET /heal")                            # half a request line
            assert "--header-timeout" in _error_answer(_read_to_close(stalled), 408)["message"]
    finally:
        router.stop()
