"""Structured outputs over HTTP on the demo checkpoint (docs/architecture.md, "Structured
outputs"): response_format and guided_* outputs validate, whole and streamed; forced tool calls
(required, named) come back as parsed calls whose arguments validate, through the `openai`
client and LangChain; bad constraints are 400s naming the problem."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from serve.server_fixtures import API_KEY, MODEL_NAMES

pytest_plugins = ["serve.server_fixtures"]

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "n"], "additionalProperties": False}
# small enough that the tools section and a call spelled about one character a token (the demo
# model knows no DSML) fit the test server's 512-token context; no max_tokens: all that is left
TOOL = {"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
DEEP = {"type": "array", "items": {}}
_inner = DEEP
for _ in range(40):
    _inner["items"] = _inner = {"type": "array", "items": {}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def client(real_server):
    with openai.OpenAI(base_url=real_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120,
                       http_client=httpx.Client(trust_env=False)) as c:
        yield c


def test_json_schema_whole_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model=MODEL_NAMES[0], messages=MSGS, max_tokens=60, n=3,
                                           temperature=0.8, seed=1, response_format=fmt)
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL_NAMES[0], messages=MSGS, max_tokens=60, temperature=0.8,
                                            seed=1, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_guided_kinds_through_extra_body(client):
    cases = [({"guided_regex": r"[a-z]{2,5}-[0-9]"}, lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]", t)),
             ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
             ({"structured_outputs": {"grammar": 'root ::= "<" [a-z] [a-z]? [a-z]? [a-z]? ">"'}},
              lambda t: re.fullmatch("<[a-z]{1,4}>", t)),     # bounded: 40 tokens always finish it
             ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)]
    for body, ok in cases:
        for stream in (False, True):
            out = client.completions.create(model=MODEL_NAMES[0], prompt="Answer:", max_tokens=40, extra_body=body,
                                            stream=stream)
            text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
            assert ok(text), (body, text)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "wx"}}])
def test_forced_tool_call_is_a_valid_call(client, choice):
    out = client.chat.completions.create(model=MODEL_NAMES[0], messages=MSGS, tools=[TOOL],
                                         tool_choice=choice, temperature=0.0)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls", message
    call = message.tool_calls[0].function
    assert call.name == "wx"
    jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])


@pytest.mark.parametrize("body, param, words", [
    ({"guided_regex": "a("}, "guided_regex", "parenthesis"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}}}},
     "response_format", "'not'"),
    ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/b"}},
                                                        "b": {"$ref": "#/$defs/nowhere"}}}}, "guided_json", "points nowhere"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "not defined"),
    ({"guided_json": DEEP}, "guided_json", "nests deeper than 32 levels"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "only one"),
])
def test_bad_constraints_are_400s(http, body, param, words):
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_langchain_bind_tools_and_structured_output(real_server):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=MODEL_NAMES[0], base_url=real_server.base_url + "/v1", api_key=API_KEY,
                     temperature=0, max_retries=0,
                     http_client=httpx.Client(trust_env=False))
    msg = llm.bind_tools([TOOL], tool_choice="any").invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "wx"
    jsonschema.validate(msg.tool_calls[0]["args"], TOOL["function"]["parameters"])
    schema = {"title": "City", "description": "a city", **SCHEMA}
    data = llm.with_structured_output(schema, method="json_schema").invoke("Name a city.")
    jsonschema.validate(data, SCHEMA)
