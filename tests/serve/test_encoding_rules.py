"""Encoder behaviour around the golden cases: input forms, errors, and no side effects."""

import copy
import json

import pytest

from dsv4.serve.chat_format.encoding import encode_messages

BOS, EOS, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def call(arguments):
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}


@pytest.mark.parametrize("messages,error", [
    ([], "empty"),
    ([{"role": "robot", "content": "x"}], "role"),
    ([{"role": "developer", "content": ""}, {"role": "user", "content": "x"}], "developer"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text"),
    ([{"role": "user", "content": 42}], "content"),
    ([{"role": "user", "content": "x", "task": "summarize"}], "task"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call("[1, 2]")]}], "object"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c"}]}], "tool call"),
    ([{"role": "system", "content": "x", "tools": [{"type": "function"}]}], "tool"),
    (["just a string"], "object"),
])
def test_bad_input_is_a_value_error(messages, error):
    with pytest.raises(ValueError, match=error):
        encode_messages(messages, thinking=False)


def test_bad_request_tools_are_a_value_error():
    with pytest.raises(ValueError, match="tool"):
        encode_messages([{"role": "user", "content": "x"}], thinking=False, tools=[{"name": "f"}])


def test_input_is_not_modified():
    messages = [{"role": "system", "content": "S", "tools": [TOOL]},
                {"role": "user", "content": [{"type": "text", "text": "x"}]},
                {"role": "assistant", "tool_calls": [call('{"a": 1}')]},
                {"role": "tool", "tool_call_id": "c", "content": "r"}]
    before = copy.deepcopy(messages)
    encode_messages(messages, thinking=True, tools=[TOOL], response_format={"type": "json_object"})
    assert messages == before


def test_reasoning_key_spellings_and_none_fields():
    # vLLM's copy of the reference reads "reasoning", SGLang's "reasoning_content".
    turn = [{"role": "user", "content": "q"}]
    a = encode_messages(turn + [{"role": "assistant", "reasoning": "r", "content": None}], thinking=True)
    b = encode_messages(turn + [{"role": "assistant", "reasoning_content": "r", "content": ""}], thinking=True)
    assert a == b == BOS + U + "q" + A + "<think>r</think>" + EOS


def test_request_tools_replace_message_tools():
    other = {"type": "function", "function": {"name": "other"}}
    prompt = encode_messages([{"role": "system", "content": "S", "tools": [other]},
                              {"role": "user", "content": "q"}], thinking=False, tools=[TOOL])
    assert '"name": "f"' in prompt and '"name": "other"' not in prompt


def test_message_level_tools_are_honoured():
    prompt = encode_messages([{"role": "system", "content": "S", "tools": [TOOL]},
                              {"role": "user", "content": "q"}], thinking=False)
    assert prompt.startswith(BOS + "S\n\n## Tools\n\n") and '"name": "f"' in prompt


def test_unparsable_arguments_become_one_string_parameter():
    # SGLang's copy of the reference: json.loads fails -> {"arguments": <the raw string>}.
    prompt = encode_messages([{"role": "user", "content": "q"},
                              {"role": "assistant", "tool_calls": [call("not json")]}], thinking=False)
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in prompt


def test_wo_eos_leaves_the_assistant_turn_open():
    prompt = encode_messages([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "partial", "wo_eos": True}], thinking=False)
    assert prompt == BOS + U + "q" + A + "</think>partial"


def test_developer_messages_survive_in_chat_mode():
    prompt = encode_messages([{"role": "developer", "content": "D"}, {"role": "user", "content": "u"}],
                             thinking=False)
    assert prompt == BOS + U + "D" + U + "u" + A + "</think>"


def test_tool_schema_is_json_with_non_ascii_kept():
    tool = {"type": "function", "function": {"name": "météo", "description": "天气"}}
    prompt = encode_messages([{"role": "user", "content": "q"}], thinking=False, tools=[tool])
    assert json.dumps(tool["function"], ensure_ascii=False) in prompt
