"""The API process against a scripted engine core (same IPC protocol, fixed replies): it
must turn a known token stream into the right OpenAI responses (reasoning, tool calls,
streaming deltas), fail a failing request alone, abort on disconnect, and stop when the
engine core dies."""
import asyncio
import json
import time

import httpx
import openai
import pytest

pytest_plugins = ["serve.server_fixtures"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CALL_ARGS = {"city": "Paris", "days": 3}


@pytest.fixture
def client(fake_server):
    with openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key="unused", max_retries=0,
                       http_client=httpx.Client(trust_env=False)) as c:
        yield c


def user(text):
    return [{"role": "user", "content": text}]


def collect(stream):
    """Assemble a chat stream: (content, reasoning, tool calls, finish reasons, chunks)."""
    content, reasoning, calls, finish, chunks = "", "", {}, [], list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, chunks


def test_reasoning_is_separated_from_content(client):
    r = client.chat.completions.create(model="dsv4-test", messages=user("[[think]]"),
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    message = r.choices[0].message
    assert message.content == "The answer is 4."
    assert message.reasoning_content == "Two and two make four."
    assert r.choices[0].finish_reason == "stop"


def test_streamed_reasoning_and_content_never_leak_markup(client):
    stream = client.chat.completions.create(model="dsv4-test", messages=user("[[think]]"), stream=True,
                                            extra_body={"chat_template_kwargs": {"thinking": True}})
    content, reasoning, calls, finish, chunks = collect(stream)
    assert (content, reasoning, calls, finish) == ("The answer is 4.", "Two and two make four.", [], ["stop"])
    assert chunks[0].choices[0].delta.role == "assistant"


def test_thinking_off_keeps_everything_in_content(client):
    r = client.chat.completions.create(model="dsv4-test", messages=user("[[plain]]"))
    assert r.choices[0].message.content == "Hello from the fake engine."
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_tool_call_auto_is_parsed(client):
    r = client.chat.completions.create(model="dsv4-test", messages=user("[[tool]]"), tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL_ARGS


def test_tool_call_streams_as_deltas(client):
    stream = client.chat.completions.create(model="dsv4-test", messages=user("[[tool]]"), tools=[WEATHER],
                                            stream=True)
    content, _, calls, finish, _ = collect(stream)
    assert content == "Let me check." and finish == ["tool_calls"]
    assert [c["name"] for c in calls] == ["get_weather"] and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == CALL_ARGS


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_prefills_the_block(client, stream):
    kwargs = dict(model="dsv4-test", messages=user("[[tool_rest]]"), tools=[WEATHER], tool_choice="required")
    if stream:
        _, _, calls, _, _ = collect(client.chat.completions.create(stream=True, **kwargs))
        name, args = calls[0]["name"], calls[0]["arguments"]
    else:
        (call,) = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        name, args = call.function.name, call.function.arguments
    assert name == "get_weather" and json.loads(args) == CALL_ARGS


def test_named_tool_choice_prefills_the_invoke(client):
    r = client.chat.completions.create(model="dsv4-test", messages=user("[[named_rest]]"), tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL_ARGS


def test_tool_choice_none_drops_calls(client):
    r = client.chat.completions.create(model="dsv4-test", messages=user("[[tool]]"), tools=[WEATHER],
                                       tool_choice="none")
    assert r.choices[0].message.content == "Let me check."
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


def test_max_tokens_cuts_with_length(client):
    r = client.chat.completions.create(model="dsv4-test", messages=user("[[plain]]"), max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_logprobs_per_token_with_alternatives(client):
    r = client.chat.completions.create(model="dsv4-test", messages=user("[[plain]]"), logprobs=True,
                                       top_logprobs=2)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens
    assert all(i.logprob == -0.25 and len(i.top_logprobs) == 2 for i in items)
    assert all(i.top_logprobs[0].logprob >= i.top_logprobs[1].logprob for i in items)


def test_a_failing_request_fails_alone(fake_server, client):
    with httpx.Client(base_url=fake_server.base_url, trust_env=False, timeout=30) as http:
        bad = http.post("/v1/chat/completions", json={"messages": user("[[fail]]")})
        assert bad.status_code == 500 and bad.json()["error"]["message"] == "injected failure"
        assert bad.json()["error"]["type"] == "server_error"
        lines = [ln for ln in http.post("/v1/chat/completions", json={"messages": user("[[fail]]"), "stream": True})
                 .text.splitlines() if ln.startswith("data: ")]
        assert json.loads(lines[-2][6:])["error"]["code"] == 500 and lines[-1] == "data: [DONE]"
    ok = client.chat.completions.create(model="dsv4-test", messages=user("[[plain]]"))
    assert ok.choices[0].message.content == "Hello from the fake engine."


def _wait_running(http, metric, value: float, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while metric(http.get("/metrics").text, "dsv4:num_requests_running") != value:
        assert time.monotonic() < deadline, f"num_requests_running never became {value}"
        time.sleep(0.05)


def test_client_disconnect_aborts_the_engine_request(fake_server, metric):
    body = {"messages": user("[[endless]]"), "max_tokens": 3000, "stream": True}
    with httpx.Client(base_url=fake_server.base_url, trust_env=False, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert metric(http.get("/metrics").text, "dsv4:num_requests_running") == 1
        _wait_running(http, metric, 0)
        with pytest.raises(httpx.ReadTimeout):   # a whole response that the client gives up on
            http.post("/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
        _wait_running(http, metric, 0)
        aborts = metric(http.get("/metrics").text, "dsv4:request_success_total", finished_reason="abort")
        assert aborts >= 2


def test_engine_death_fails_requests_in_flight_and_stops_the_server(fake_server_factory):
    server = fake_server_factory()
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": user("[[endless]]"), "max_tokens": 3000, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            crash = http.post("/v1/chat/completions", json={"messages": user("[[crash]]")})
            assert crash.status_code == 500 and "engine core died" in crash.json()["error"]["message"]
            rest = [ln for ln in lines if ln.startswith("data: ")]
            assert json.loads(rest[-2][6:])["error"]["code"] == 500 and rest[-1] == "data: [DONE]"
    server.thread.join(30)
    assert server.exit_code == 1


def test_an_undecodable_engine_message_is_treated_as_engine_death(fake_server_factory):
    server = fake_server_factory()
    with httpx.Client(base_url=server.base_url, trust_env=False, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"messages": user("[[garbage]]")})
        assert r.status_code == 500 and "cannot be decoded" in r.json()["error"]["message"]
    server.thread.join(30)
    assert server.exit_code == 1


def test_health_and_generation_answer_503_while_the_engine_is_down():
    from types import SimpleNamespace

    from dsv4.serve.http.api import build_app
    from dsv4.engine.ipc import Ready
    from dsv4.serve.http.metrics import ServerMetrics
    from dsv4.serve.http.state import ServerState
    from dsv4.text.tokenizer import TEST_TOKENIZER_DIR, Tokenizer

    info = Ready(max_model_len=64, vocab_size=1024, eos_token_id=1, num_pages=4, max_num_seqs=4,
                 max_request_tokens=64, memory_report="")
    state = ServerState(client=SimpleNamespace(alive=False), info=info, tokenizer=Tokenizer.from_dir(TEST_TOKENIZER_DIR),
                        model_dir=str(TEST_TOKENIZER_DIR), model_names=["m"], release="preview", add_bos=False,
                        metrics=ServerMetrics("m", 4))

    async def probe():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.get("/health"), await http.post("/v1/chat/completions", json={"messages": user("hi")})

    health, chat = asyncio.run(probe())
    assert health.status_code == 503
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "engine_dead"
