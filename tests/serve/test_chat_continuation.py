"""The chat endpoint on real-world model output and requests: continuing a final assistant
message (DeepSeek's `prefix`, vLLM's `continue_final_message` / `add_generation_prompt`),
calls cut by max_tokens or EOS, arguments typed by the request's schema, effort values
mapped. Prompts are checked on the planner; behaviour through the scripted engine core."""
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from dsv4.engine.ipc import Ready
from dsv4.serve.http.chat_prompt import plan_chat
from dsv4.serve.http.errors import APIError
from dsv4.serve.http.protocol import ChatCompletionRequest
from dsv4.text.tokenizer import TEST_TOKENIZER_DIR, Tokenizer

pytest_plugins = ["serve.server_fixtures"]

A = "<｜Assistant｜>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CONTINUE_CODE = [{"role": "user", "content": "Please write quick sort code"},
                 {"role": "assistant", "content": "```python\n", "prefix": True}]


@pytest.fixture(scope="module")
def state():
    info = Ready(max_model_len=4096, vocab_size=1024, eos_token_id=1, num_pages=4, max_num_seqs=4,
                 max_request_tokens=4096, memory_report="")
    return SimpleNamespace(tokenizer=Tokenizer.from_dir(TEST_TOKENIZER_DIR), info=info, model_names=["m"],
                           release="0731")


def plan(state, **body):
    plan = plan_chat(ChatCompletionRequest.model_validate(body), state)
    return plan, state.tokenizer.decode(plan.prompt_ids)


@pytest.mark.parametrize("body", [
    {"messages": CONTINUE_CODE},                                                     # DeepSeek's API
    {"messages": [CONTINUE_CODE[0], {**CONTINUE_CODE[1], "prefix": False}], "continue_final_message": True,
     "add_generation_prompt": False},                                                # vLLM's names
    {"messages": [CONTINUE_CODE[0], {**CONTINUE_CODE[1], "prefix": False}], "continue_final_message": True},
])
def test_a_final_assistant_message_is_continued(state, body):
    chat, prompt = plan(state, **body)
    assert prompt.endswith(A + "</think>```python\n") and chat.start == "content"


def test_continuing_reasoning_in_thinking_mode(state):
    chat, prompt = plan(state, messages=[{"role": "user", "content": "q"},
                                         {"role": "assistant", "reasoning_content": "First,", "prefix": True}],
                        chat_template_kwargs={"thinking": True})
    assert prompt.endswith(A + "<think>First,") and chat.start == "reasoning"


def test_without_a_generation_prompt(state):
    chat, prompt = plan(state, messages=[{"role": "user", "content": "q"}], add_generation_prompt=False)
    assert prompt.endswith("<｜User｜>q") and chat.start == "content"
    _, usual = plan(state, messages=[{"role": "user", "content": "q"}], chat_template_kwargs={"thinking": True})
    assert usual.endswith(A + "<think>")


@pytest.mark.parametrize("body,param", [
    ({"messages": [CONTINUE_CODE[1], {"role": "user", "content": "q"}]}, "messages.0.prefix"),
    ({"messages": [{"role": "user", "content": "q", "prefix": True}]}, "messages.0.prefix"),
    ({"messages": [{"role": "user", "content": "q"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": CONTINUE_CODE, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"messages": CONTINUE_CODE, "tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "prefix": True, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]},
     "continue_final_message"),
])
def test_contradictory_continuations_are_400(state, body, param):
    with pytest.raises(APIError) as e:
        plan(state, **body)
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize("effort", ["extreme", "xhigh", "minimal", "medium"])
def test_any_effort_value_is_mapped(state, effort):
    chat, prompt = plan(state, messages=[{"role": "user", "content": "q"}], reasoning_effort=effort,
                        chat_template_kwargs={"thinking": True})
    assert chat.thinking and prompt.endswith(A + "<think>")
    assert prompt.startswith("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum") == (
        effort in ("extreme", "xhigh"))


# ---- through the scripted engine core ---------------------------------------------------------
@pytest.fixture
def client(fake_server):
    with openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key="unused", max_retries=0,
                       http_client=httpx.Client(trust_env=False)) as c:
        yield c


def chat(client, text, **kwargs):
    return client.chat.completions.create(model="dsv4-test", messages=[{"role": "user", "content": text}], **kwargs)


def streamed(client, text, **kwargs):
    content, calls, finish = "", {}, None
    for chunk in chat(client, text, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_prefix_continuation_end_to_end(client):
    r = client.chat.completions.create(model="dsv4-test", messages=[
        {"role": "user", "content": "[[think]]"},
        {"role": "assistant", "content": "Sure.", "prefix": True}], extra_body={"chat_template_kwargs": {"thinking": True}})
    # The turn's reasoning is closed: the script's reasoning text and </think> land in content
    # (the </think> dropped as markup).
    assert r.choices[0].message.content == "Two and two make four.The answer is 4."
    assert r.choices[0].message.reasoning_content == ""


@pytest.mark.parametrize("key,arguments", [("typed_tool", {"city": "Paris", "days": 3}),
                                           ("wrapped_tool", {"city": "Paris", "days": 3})])
def test_arguments_follow_the_schema(client, key, arguments):
    choice = chat(client, f"[[{key}]]", tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == arguments
    _, calls, finish = streamed(client, f"[[{key}]]", tools=[WEATHER])
    assert finish == "tool_calls" and json.loads(calls[0]["arguments"]) == arguments


def test_a_call_cut_by_eos_is_not_reported(client):
    choice = chat(client, "[[cut_tool]]", tools=[WEATHER]).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls, choice.message.content) == ("stop", None, "Let me check.")
    content, calls, finish = streamed(client, "[[cut_tool]]", tools=[WEATHER])
    assert (content, finish) == ("Let me check.", "stop")
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Paris"'   # streamed, unfinished


def test_a_call_cut_by_max_tokens_finishes_with_length(client, tok):
    from serve.server_fixtures import SCRIPTS
    reply = SCRIPTS["tool"]
    max_tokens = len(tok.encode(reply[:reply.index("Paris") + 2]))
    choice = chat(client, "[[tool]]", tools=[WEATHER], max_tokens=max_tokens).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls, choice.message.content) == ("length", None, "Let me check.")
    _, calls, finish = streamed(client, "[[tool]]", tools=[WEATHER], max_tokens=max_tokens)
    assert finish == "length" and calls[0]["name"] == "get_weather"
