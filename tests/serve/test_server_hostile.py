"""`dsv4 serve` on the demo checkpoint against requests that used to cost more than their own
answer: a constraint xgrammar refuses only when compiling it (it ended the grammar worker, and
with it every constrained request in flight), tool-call arguments no prompt can carry (a 500,
and the keep-alive connection closed), stop lists that stalled every other stream, a body cut
off mid-send (a 500 and a traceback); and at the HTTP level, pipelined requests and clients
that never finish their headers."""
import asyncio
import json
import socket

import pytest

pytest_plugins = ["serve.server_fixtures"]

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
GREEDY = {"prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
NEGATIVE_LENGTH = {"type": "string", "minLength": -5}      # builds, then fails xgrammar's compile


def _error(r, status: int, param) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


# ---- constraints that fail only when compiled ------------------------------------------
COMPILE_FAILURES = [  # (id, path, body, param)
    ("response_format", CHAT, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"schema": NEGATIVE_LENGTH}}}, "response_format"),
    ("guided_json", COMPLETIONS, {"prompt": "x", "guided_json": {"type": "array", "items": NEGATIVE_LENGTH}},
     "guided_json"),
    ("forced tool call", CHAT, {"messages": USER, "tool_choice": "required", "tools": [_tool(
        {"type": "object", "properties": {"a": {"type": "array", "items": NEGATIVE_LENGTH}}})]}, "tools"),
]


def test_constraints_that_fail_to_compile_are_400s_and_spare_running_constrained_streams(http):
    body = {"prompt": "def", "max_tokens": 24, "temperature": 0, "guided_regex": "[a-z]{60}", "stream": True}
    alone = "".join(json.loads(line[6:])["choices"][0]["text"] for line in
                    http.post(COMPLETIONS, json=body).text.splitlines() if line.startswith("data: {"))
    with http.stream("POST", COMPLETIONS, json=body) as r:
        lines = r.iter_lines()
        first = next(lines)
        for _, path, bad, param in COMPILE_FAILURES:
            assert "Invalid repetition range" in _error(http.post(path, json=bad), 400, param)["message"]
        events = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events[-2:]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == alone


def test_grammar_checks_compile_what_they_build():
    from dsv4.sampling_params import StructuredOutputs
    from dsv4.serve.chat_format.tool_grammar import forced_call_grammar
    from dsv4.structured import grammars
    with pytest.raises(grammars.GrammarError, match="^json_schema: .*Invalid repetition range"):
        grammars.build_checked(StructuredOutputs(json=json.dumps(NEGATIVE_LENGTH)))
    tools = [_tool({"type": "object", "properties": {"a": {"type": "array", "items": NEGATIVE_LENGTH}}})]
    with pytest.raises(grammars.GrammarError, match="function 'f', parameter 'a'"):
        forced_call_grammar(tools, None)
    grammars.build_checked(StructuredOutputs(regex="[a-z]{3}"))
    from dsv4.structured.compiler import GrammarCache
    from dsv4.text.tokenizer import TEST_TOKENIZER_DIR, Tokenizer
    tok = Tokenizer.from_dir(TEST_TOKENIZER_DIR)
    with pytest.raises(grammars.GrammarError, match="^Invalid repetition range"):    # the engine's own compile
        GrammarCache(tok, tok.vocab_size, tok.eos_id).get(StructuredOutputs(json=json.dumps(NEGATIVE_LENGTH)))


def test_forced_tool_call_ignores_a_required_that_is_not_a_list(http):
    tools = [_tool({"type": "object", "properties": {"a": {"type": "integer"}}, "required": 5})]
    r = http.post(CHAT, json={"messages": USER, "tools": tools, "tool_choice": "required", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- tool-call arguments no prompt can carry -----------------------------------------------
@pytest.mark.parametrize("arguments,words", [
    ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "nest too deeply"),
    ('{"a": "\\ud800"}', "lone UTF-16 surrogate"),
], ids=["nested 5000 deep", "lone surrogate escape"])
def test_unusable_tool_call_arguments_are_a_400_on_a_live_connection(http, arguments, words):
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = USER + [{"role": "assistant", "tool_calls": [call]}]
    assert words in _error(http.post(CHAT, json={"messages": messages}), 400, "messages")["message"]
    ok = http.post(COMPLETIONS, json=GREEDY)          # the same keep-alive connection (a 500 closed it)
    assert ok.status_code == 200


# ---- bounds ----------------------------------------------------------------------------------
def test_completion_prompt_logprobs_out_of_range_is_a_400(http):
    for value in (-1, 21):
        _error(http.post(COMPLETIONS, json={"prompt": "x", "prompt_logprobs": value}), 400, "prompt_logprobs")


def test_stop_lists_and_constraints_are_bounded(http):
    assert http.post(COMPLETIONS, json={**GREEDY, "stop": [f"zz{i}q" for i in range(64)]}).status_code == 200
    _error(http.post(COMPLETIONS, json={**GREEDY, "stop": [f"zz{i}q" for i in range(65)]}), 400, "stop")
    _error(http.post(CHAT, json={"messages": USER, "stop_token_ids": [5] * 1025}), 400, "stop_token_ids")
    _error(http.post(COMPLETIONS, json={"prompt": "x", "guided_choice": [f"choice{i:05d}" for i in range(6000)]}),
           400, "guided_choice")
    _error(http.post(CHAT, json={"messages": USER, "guided_regex": "a" * 70_000}), 400, "guided_regex")


# ---- a body cut off mid-send -------------------------------------------------------------------
def test_a_client_gone_while_sending_its_body_is_no_server_error():
    from fastapi import FastAPI, Request

    from dsv4.serve.http import errors
    app = FastAPI()
    errors.install(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body())}

    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/echo", "headers": [(b"content-length", b"100")],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("x", 1), "root_path": ""}
    asyncio.run(app(scope, receive, send))            # (it raised, after a 500, before)
    assert sent[0]["status"] == 499


# ---- HTTP level --------------------------------------------------------------------------------
def _raw_request(path: str, body: bytes, close: bool = False) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
            ).encode() + body


def _address(base_url: str) -> tuple[str, int]:
    host, port = base_url.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def _responses(sock: socket.socket) -> list[tuple[int, bytes]]:
    """(status, body) of every response on the connection, read until the server closes it."""
    import h11
    conn, found = h11.Connection(h11.CLIENT), []
    ask = [h11.Request(method="GET", target="/", headers=[("Host", "x")]), h11.EndOfMessage()]
    for event in ask:                       # (h11 reads a response only to a request it sent)
        conn.send(event)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
        elif isinstance(event, h11.Response):
            found.append([event.status_code, b""])
        elif isinstance(event, h11.Data):
            found[-1][1] += event.data
        elif isinstance(event, h11.EndOfMessage):
            if conn.their_state is h11.MUST_CLOSE:
                return [tuple(f) for f in found]
            conn.start_next_cycle()
            for event in ask:
                conn.send(event)


def test_pipelined_requests_are_answered_in_order(http, real_server):
    alone = http.post(COMPLETIONS, json=GREEDY).json()["choices"][0]["text"]
    good = json.dumps(GREEDY).encode()
    with socket.create_connection(_address(real_server.base_url), timeout=60) as sock:
        sock.sendall(_raw_request(COMPLETIONS, good) + _raw_request(COMPLETIONS, b'{"prompt": [') +
                     _raw_request(COMPLETIONS, json.dumps({**GREEDY, "stream": True}).encode()) +
                     _raw_request(COMPLETIONS, good, close=True))
        answers = _responses(sock)
    assert [status for status, _ in answers] == [200, 400, 200, 200], answers
    assert "not valid JSON" in json.loads(answers[1][1])["error"]["message"]
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in answers[2][1].split(b"\n")
                       if line.startswith(b"data: {"))
    whole = [json.loads(answers[i][1])["choices"][0]["text"] for i in (0, 3)]
    assert whole == [alone, alone] and streamed == alone


def test_clients_that_never_finish_their_headers_hold_nobody_up(http, real_server):
    alone = http.post(COMPLETIONS, json=GREEDY).json()["choices"][0]["text"]
    stalled = [socket.create_connection(_address(real_server.base_url), timeout=60) for _ in range(32)]
    try:
        for i, sock in enumerate(stalled):
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n" if i % 2 else
                         b"GET /health HTTP/1.1\r\nX-Slow: ")
        assert http.get("/health").status_code == 200
        assert http.post(COMPLETIONS, json=GREEDY).json()["choices"][0]["text"] == alone
    finally:
        for sock in stalled:
            sock.close()
