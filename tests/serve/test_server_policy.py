"""Request policy of the API process against the scripted engine core: unknown and
unsupported fields, DeepSeek's thinking switches, include_reasoning, the body-size and
prompts x n limits, the shutdown drain, and one request that cannot be sent failing alone."""
import json
import threading

import httpx
import pytest

from dsv4.serve.http.limits import MB, ServerLimits

pytest_plugins = ["serve.server_fixtures"]

CHAT = "/v1/chat/completions"


def user(text):
    return [{"role": "user", "content": text}]


def _http(server, **kw):
    return httpx.Client(base_url=server.base_url, trust_env=False, timeout=30, **kw)


def _error(r: httpx.Response, status: int, param) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def limited_server():
    """One fake server with every limit the limit tests need (each test sends requests only its
    own limit refuses): strict API, 1 MB bodies, at most 4 prompts x n."""
    from serve.server_fixtures import start_fake_server
    server = start_fake_server(ServerLimits(strict_api=True, max_body_bytes=MB, max_batch_requests=4))
    yield server
    server.stop()


# ---- unknown fields ----------------------------------------------------------------------
def test_unknown_fields_are_ignored_and_named_in_a_header(fake_server, caplog):
    with _http(fake_server) as http:
        body = {"messages": [{"role": "user", "content": "[[plain]]", "mood": "x"}], "frobnicate": 1,
                "stream_options": {"include_usage": True, "extra_opt": 1}}
        r = http.post(CHAT, json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello from the fake engine."
        assert r.headers["X-Ignored-Fields"] == "frobnicate, stream_options.extra_opt, messages.0.mood"
        stream = http.post(CHAT, json={**body, "stream": True})
        assert stream.headers["X-Ignored-Fields"] and stream.text.endswith("data: [DONE]\n\n")
        assert "X-Ignored-Fields" not in http.post(CHAT, json={"messages": user("[[plain]]")}).headers
    warnings = [r.getMessage() for r in caplog.records if "unknown request field 'frobnicate'" in r.getMessage()]
    assert len(warnings) == 1          # once per field name, not once per request


def test_strict_api_rejects_unknown_fields(limited_server):
    with _http(limited_server) as http:
        _error(http.post(CHAT, json={"messages": user("hi"), "frobnicate": 1}), 400, "frobnicate")
        _error(http.post(CHAT, json={"messages": [{"role": "user", "content": "hi", "mood": 1}]}), 400,
               "messages.0.mood")
        _error(http.post("/v1/completions", json={"prompt": "hi", "best_of": 1, "x": 2}), 400, "x")
        assert http.post(CHAT, json={"messages": user("[[plain]]"), "logit_bias": {"5": 1},
                                     "thinking": {"type": "disabled"}}).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": user("hi"), "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (CHAT, {"messages": user("hi"), "functions": [{"name": "f"}]}, "functions"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
])
def test_unsupported_fields_are_a_400_even_without_strict_api(fake_server, path, body, param):
    with _http(fake_server) as http:
        _error(http.post(path, json=body), 400, param)


def test_header_names_are_ascii_and_bounded(fake_server):
    with _http(fake_server) as http:
        body = {"messages": user("[[plain]]"), "naïve\r\nX-Evil: 1": 1, " ": 2, **{f"f{i}": i for i in range(40)}}
        r = http.post(CHAT, json=body)
        header = r.headers["X-Ignored-Fields"]
        assert r.status_code == 200 and header.endswith(", ...") and len(header.split(", ")) == 33
        assert header.startswith("na%C3%AFve%0D%0AX-Evil%3A%201, %20, f0, ")
        assert "X-Evil" not in r.headers


# ---- thinking --------------------------------------------------------------------------------
THINKING = [
    ({"thinking": {"type": "enabled"}}, True),
    ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, False),
    ({"reasoning_effort": "high"}, True),                       # as DeepSeek's API: effort turns it on
    ({"reasoning_effort": "none"}, False),
    ({"chat_template_kwargs": {"thinking": True}}, True),
    ({}, False),
]


@pytest.mark.parametrize("fields,thinks", THINKING, ids=[json.dumps(f) for f, _ in THINKING])
def test_thinking_switches(fake_server, fields, thinks):
    with _http(fake_server) as http:
        message = http.post(CHAT, json={"messages": user("[[think]]"), **fields}).json()["choices"][0]["message"]
    from serve.server_fixtures import SCRIPTS
    if thinks:     # the prompt opened <think>: the reply's reasoning is split off
        assert (message["reasoning_content"], message["content"]) == ("Two and two make four.", "The answer is 4.")
    else:          # the prompt closed </think>: everything is content (a stray marker never reaches it)
        assert "reasoning_content" not in message and message["content"] == SCRIPTS["think"].replace("</think>", "")


def test_contradicting_thinking_switches_are_a_400(fake_server):
    with _http(fake_server) as http:
        _error(http.post(CHAT, json={"messages": user("hi"), "thinking": {"type": "enabled"},
                                     "chat_template_kwargs": {"thinking": False}}), 400, "thinking")
        _error(http.post(CHAT, json={"messages": user("hi"), "thinking": {"type": "maybe"}}), 400, "thinking.type")


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_the_reasoning(fake_server, stream):
    body = {"messages": user("[[think]]"), "thinking": {"type": "enabled"}, "include_reasoning": False,
            "stream": stream}
    with _http(fake_server) as http:
        r = http.post(CHAT, json=body)
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert not any("reasoning_content" in d for d in deltas)
        assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4."
    else:
        message = r.json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "The answer is 4."}


# ---- limits ----------------------------------------------------------------------------------
def test_body_size_limit_is_a_413(limited_server):
    big = json.dumps({"prompt": "x" * (MB + 10)}).encode()
    with _http(limited_server) as http:
        error = _error(http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}),
                       413, None)
        assert "--max-request-body-mb" in error["message"]
        chunked = http.post("/v1/completions", content=iter([big[:MB // 2], big[MB // 2:]]),
                            headers={"Content-Type": "application/json"})
        _error(chunked, 413, None)
        assert http.post("/v1/completions", json={"prompt": "[[plain]]", "max_tokens": 2}).status_code == 200


def test_prompts_times_n_is_capped(limited_server):
    with _http(limited_server) as http:
        error = _error(http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3}), 400, "prompt")
        assert "--max-batch-requests" in error["message"]
        _error(http.post("/v1/completions", json={"prompt": "a", "n": 5}), 400, "n")
        _error(http.post(CHAT, json={"messages": user("a"), "n": 5}), 400, "n")
        r = http.post("/v1/completions", json={"prompt": ["[[plain]]", "[[plain]]"], "n": 2, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4


# ---- shutdown drain --------------------------------------------------------------------------
def test_stop_drains_then_fails_what_still_runs(fake_server_factory):
    """Past --shutdown-timeout a running stream ends with an error event and [DONE], a
    running whole request gets a 503 body; nothing is cut."""
    server = fake_server_factory(ServerLimits(shutdown_timeout=0.3))
    endless = {"messages": user("[[endless]]"), "max_tokens": 3000}
    results = {}
    with _http(server) as http:
        with http.stream("POST", CHAT, json={**endless, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            whole = threading.Thread(target=lambda: results.update(whole=http.post(CHAT, json=endless)))
            whole.start()
            server.server.stop()
            rest = [ln for ln in lines if ln.startswith("data: ")]
        whole.join(30)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert results["whole"].status_code == 503 and results["whole"].json()["error"]["type"] == "service_unavailable"
    server.thread.join(30)
    assert server.exit_code == 0


# ---- one request the wire cannot carry ------------------------------------------------------
def test_a_request_that_cannot_be_encoded_fails_alone(fake_server):
    from dsv4.sampling_params import SamplingParams
    from dsv4.serve.client import NotEncodable
    client = fake_server.server.client
    with pytest.raises(NotEncodable, match="cannot be sent to the engine"):
        client.submit([[1, 2]], [SamplingParams(seed=1 << 70)], "bad")
    with pytest.raises(NotEncodable):
        client.submit([[1, 2]], [SamplingParams(stop=["\ud800"])], "bad2")
    assert not any(rid.startswith("bad") for rid in client.groups)
    with _http(fake_server) as http:
        assert http.post(CHAT, json={"messages": user("[[plain]]")}).status_code == 200
        assert http.get("/health").status_code == 200


# ---- any other failure -----------------------------------------------------------------------
def test_an_unexpected_failure_is_a_500_in_openai_shape():
    """A handler that raises something nobody expected (here: the tokenizer) answers a 500
    error body, not Starlette's plain-text page; the next request is served."""
    import asyncio
    from types import SimpleNamespace

    from dsv4.engine.ipc import Ready
    from dsv4.serve.http.api import build_app
    from dsv4.serve.http.metrics import ServerMetrics
    from dsv4.serve.http.state import ServerState
    from dsv4.text.tokenizer import TEST_TOKENIZER_DIR, Tokenizer

    class BrokenTokenizer(Tokenizer):
        def encode(self, text):
            raise RuntimeError("tokenizer exploded")

    tok = Tokenizer.from_dir(TEST_TOKENIZER_DIR)
    broken = BrokenTokenizer(tok._hf)
    info = Ready(max_model_len=64, vocab_size=tok.vocab_size, eos_token_id=1, num_pages=4, max_num_seqs=4,
                 max_request_tokens=64, memory_report="")
    state = ServerState(client=SimpleNamespace(alive=True, on_stats=None, run=lambda: None), info=info,
                        tokenizer=broken, model_dir=str(TEST_TOKENIZER_DIR), model_names=["m"], release="preview",
                        add_bos=False, metrics=ServerMetrics("m", 4))

    async def probe():
        transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [await http.post(CHAT, json={"messages": user("hi")}),
                    await http.post("/v1/completions", json={"prompt": "hi"}),
                    await http.post("/tokenize", json={"prompt": "hi"}),
                    await http.post("/detokenize", json={"tokens": [1, 2]})]

    chat, completion, tokenize, detokenize = asyncio.run(probe())
    for r in (chat, completion, tokenize):
        error = _error(r, 500, None)
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert detokenize.status_code == 200
