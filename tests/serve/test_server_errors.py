"""Bad requests get the matching 4xx with an OpenAI error body and never reach the engine
(the server runs with --max-model-len 512 and an API key)."""
import httpx
import pytest

pytest_plugins = ["serve.server_fixtures"]

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

CASES = [  # (id, path, body, status, param)
    ("unknown model", CHAT, {"model": "gpt-4", "messages": USER}, 404, "model"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("missing messages", CHAT, {"model": "dsv4-test"}, 400, "messages"),
    ("wrong type", CHAT, {"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("string for int", CHAT, {"messages": USER, "max_tokens": "5"}, 400, "max_tokens"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("prompt too long", CHAT, {"messages": [{"role": "user", "content": "hello " * 600}]}, 400, "messages"),
    ("max_tokens too large", CHAT, {"messages": USER, "max_tokens": 600}, 400, "max_tokens"),
    ("max_completion_tokens too large", CHAT, {"messages": USER, "max_completion_tokens": 10_000}, 400,
     "max_completion_tokens"),
    ("max_tokens zero", CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("n < 1", CHAT, {"messages": USER, "n": 0}, 400, "n"),
    ("n too large", CHAT, {"messages": USER, "n": 1000}, 400, "n"),
    ("temperature < 0", CHAT, {"messages": USER, "temperature": -1}, 400, "temperature"),
    ("top_p > 1", CHAT, {"messages": USER, "top_p": 1.5}, 400, "top_p"),
    ("top_logprobs > 20", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("top_logprobs alone", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("tool without function", CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("tool bad name", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     400, "tools.0.function.name"),
    ("tool bad schema", CHAT, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     400, "tools.0.function.parameters"),
    ("tool_choice without tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
    ("named tool not given", CHAT, {"messages": USER, "tools": [TOOL],
                                    "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages.0.content.1"),
    ("bad response format", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("json_schema without schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("thinking not a bool", CHAT, {"messages": USER, "chat_template_kwargs": {"thinking": "yes"}}, 400,
     "chat_template_kwargs"),
    ("duplicate tool names", CHAT, {"messages": USER, "tools": [TOOL, TOOL]}, 400, "tools"),
    ("audio part", CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "messages.0.content.0.type"),
    ("empty stop string", CHAT, {"messages": USER, "stop": [""]}, 400, "stop"),
    ("token id out of range", COMPLETIONS, {"prompt": [1, 2, 10 ** 9]}, 400, "prompt"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("completion prompt too long", COMPLETIONS, {"prompt": [5] * 600}, 400, "prompt"),
    ("logprobs > 20", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("prompt of wrong type", COMPLETIONS, {"prompt": {"text": "hi"}}, 400, "prompt"),
]


def _assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_requests_get_an_openai_error(http, path, body, status, param):
    _assert_error(http.post(path, json=body), status, param)


def test_bad_requests_cost_the_engine_nothing(http, metric):
    before = http.get("/metrics").text
    for _, path, body, _, _ in CASES:
        assert http.post(path, json=body).status_code >= 400
    after = http.get("/metrics").text
    assert metric(after, "dsv4:prompt_tokens_total") == metric(before, "dsv4:prompt_tokens_total")


def test_malformed_json(http):
    r = http.post(CHAT, content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert "not valid JSON" in _assert_error(r, 400, None)["message"]
    _assert_error(http.post(CHAT, json=[1, 2]), 400, None)


def test_api_key_is_required_on_v1_routes(real_server):
    with httpx.Client(base_url=real_server.base_url, trust_env=False, timeout=30) as anon:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            error = _assert_error(anon.post(CHAT, json={"messages": USER}, headers=headers), 401, None)
            assert error["code"] == "invalid_api_key"
        assert anon.get("/v1/models").status_code == 401
        assert anon.get("/health").status_code == 200      # open, as in vLLM
        assert anon.get("/metrics").status_code == 200


def test_unknown_route_and_method(http):
    _assert_error(http.get("/v1/nothing"), 404, None)
    _assert_error(http.get(CHAT), 405, None)
