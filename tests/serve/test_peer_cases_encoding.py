"""The peers' DeepSeek-V4 prompt-encoding cases (inputs and expected prompts), and the
continuation of a final assistant message. Sources:
  V = vLLM tests/tokenizers_/test_deepseek_v4.py
  E = SGLang test/registered/unit/entrypoints/openai/test_encoding_dsv4.py
  C = SGLang test/registered/unit/entrypoints/openai/test_dsv4_encoder_compat.py
Where a peer and DeepSeek's reference encoder disagree, dsv4 follows the reference.
"""
import json
from pathlib import Path

import pytest

from dsv4.serve.chat_format.encoding import continuation_channel, encode_messages
from dsv4.serve.chat_format.parsers import parse_completion
from dsv4.serve.chat_format.release import effort_prefix

BOS, EOS, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
PREFIX_MESSAGES = [{"role": "user", "content": "Please write quick sort code"},
                   {"role": "assistant", "content": "```python\n", "prefix": True}]


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_prefix_message_is_continued_in_chat_mode():
    # V::test_deepseek_v4_preserves_official_prefix_assistant_message
    prompt = encode_messages(PREFIX_MESSAGES, thinking=False, continue_final_message=True)
    assert prompt.endswith(A + "</think>```python\n") and not prompt.endswith(EOS)
    assert continuation_channel(PREFIX_MESSAGES, thinking=False) == "content"


def test_prefix_message_in_thinking_mode_follows_the_reference():
    # vLLM's thinking-mode render of the same case ends "<｜Assistant｜></think>```python\n";
    # the reference renders an assistant turn after the last user as <think>reasoning</think>
    # content, so the continued turn carries an empty reasoning block (disagreement).
    prompt = encode_messages(PREFIX_MESSAGES, thinking=True, continue_final_message=True)
    assert prompt.endswith(A + "<think></think>```python\n")
    assert continuation_channel(PREFIX_MESSAGES, thinking=True) == "content"


def test_continuing_a_turn_that_is_still_reasoning():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": "First, "}]
    prompt = encode_messages(messages, thinking=True, continue_final_message=True)
    assert prompt == BOS + U + "q" + A + "<think>First, "
    assert continuation_channel(messages, thinking=True) == "reasoning"
    # The continuation equals the closed turn minus its end.
    closed = encode_messages(messages, thinking=True)
    assert closed == prompt + "</think>" + EOS


@pytest.mark.parametrize("messages,error", [
    ([{"role": "user", "content": "q"}], "last message must be an assistant"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call("c", "f", "{}")]}], "tool_calls"),
])
def test_what_cannot_be_continued(messages, error):
    with pytest.raises(ValueError, match=error):
        encode_messages(messages, thinking=False, continue_final_message=True)


def test_history_tool_arguments_become_parameters():
    # V::test_deepseek_v4_renders_parsed_history_tool_arguments
    messages = [{"role": "user", "content": "List the repo"},
                {"role": "assistant", "tool_calls": [call("call_1", "str_replace_editor",
                                                          '{"command": "view", "path": "/testbed"}')]},
                {"role": "tool", "tool_call_id": "call_1", "content": "file list"}]
    prompt = encode_messages(messages, thinking=True)
    assert '<｜DSML｜parameter name="command" string="true">view' in prompt
    assert '<｜DSML｜parameter name="path" string="true">/testbed' in prompt
    assert 'parameter name="arguments"' not in prompt


@pytest.mark.parametrize("function,parameter", [
    # V::test_deepseek_v4_encodes_empty_history_tool_arguments and
    # V::test_deepseek_v4_renders_openai_history_tool_call_with_null_arguments
    ({"name": "refresh", "arguments": None}, None),
    ({"name": "refresh"}, None),
    ({"name": "refresh", "arguments": ""}, None),
    ({"name": "refresh", "arguments": '{"target": "cache"}'}, '<｜DSML｜parameter name="target" string="true">cache'),
    ({"name": "refresh", "arguments": {"target": "cache"}}, '<｜DSML｜parameter name="target" string="true">cache'),
])
def test_empty_history_arguments(function, parameter):
    messages = [{"role": "user", "content": "Refresh state"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": function}]}]
    prompt = encode_messages(messages, thinking=False)
    assert '<｜DSML｜invoke name="refresh">' in prompt
    if parameter is None:
        assert "<｜DSML｜parameter" not in prompt
    else:
        assert parameter in prompt


def test_consecutive_assistant_messages_stay_separate_turns():
    # V::test_deepseek_v4_merges_consecutive_assistant_messages merges them into one turn
    # (one EOS). The reference renders every assistant message as its own turn, each
    # closed by EOS (disagreement, reference followed).
    messages = [{"role": "user", "content": "Check the server"},
                {"role": "assistant", "content": "Let me check the server status."},
                {"role": "assistant", "reasoning": "The user wants a health check. I should run uptime.",
                 "tool_calls": [call("call_1", "shell_exec", '{"command": "uptime"}')]},
                {"role": "tool", "tool_call_id": "call_1", "content": "up 5 days"}]
    tools = [{"type": "function", "function": {"name": "shell_exec", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}}]
    prompt = encode_messages(messages, thinking=True, tools=tools)
    assert prompt.count(EOS) == 2 and prompt.endswith(A + "<think>")
    assert ("</think>Let me check the server status." + EOS + "The user wants a health check. I should run "
            "uptime.</think>\n\n<｜DSML｜tool_calls>") in prompt


def test_tool_results_follow_the_call_order():
    # E::test_context_tool_call_order_controls_new_message_results
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [call("call_a", "tool_a", '{"value": "A"}'),
                                                     call("call_b", "tool_b", '{"value": "B"}')]},
                {"role": "tool", "tool_call_id": "call_b", "content": "result B"},
                {"role": "tool", "tool_call_id": "call_a", "content": "result A"}]
    prompt = encode_messages(messages, thinking=False)
    assert prompt.index("result A") < prompt.index("result B")


def test_sorting_tool_results_keeps_text_in_its_slot():
    # E::test_sorting_tool_results_preserves_non_tool_slots
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "tool_calls": [call("call_a", "tool_a", "{}"), call("call_b", "tool_b", "{}")]},
                {"role": "tool", "tool_call_id": "call_b", "content": "result B"},
                {"role": "user", "content": "Compare both tool results."},
                {"role": "tool", "tool_call_id": "call_a", "content": "result A"}]
    prompt = encode_messages(messages, thinking=False)
    assert (U + "<tool_result>result A</tool_result>\n\nCompare both tool results.\n\n"
            "<tool_result>result B</tool_result>" + A) in prompt


def test_dropped_reasoning_stops_at_the_latest_developer_message():
    # E::test_drop_thinking_respects_user_or_developer_boundary
    messages = [{"role": "user", "content": "Initial question"},
                {"role": "assistant", "reasoning_content": "old private reasoning", "content": "old visible answer"},
                {"role": "developer", "content": "New instruction for the current turn"},
                {"role": "assistant", "reasoning_content": "current private reasoning",
                 "content": "current visible answer"}]
    prompt = encode_messages(messages, thinking=True)
    assert "old private reasoning" not in prompt and "old visible answer" in prompt
    assert U + "New instruction for the current turn" + A + "<think>current private reasoning</think>" \
        "current visible answer" + EOS in prompt


def test_assistant_round_trip():
    # E::test_assistant_round_trip_preserves_semantics
    message = {"role": "assistant", "reasoning_content": "Compare weather and accommodation options.",
               "content": "I will check both sources.", "tool_calls": [
                   call("call_weather", "get_weather", json.dumps({"city": "北京", "unit": "celsius"},
                                                                  ensure_ascii=False)),
                   call("call_search", "search_hotels", json.dumps(
                       {"query": "Singapore hotels", "limit": 3, "filters": {"stars": [4, 5], "available": True}}))]}
    user = [{"role": "user", "content": "Plan it."}]
    prompt = encode_messages(user, thinking=True)
    completion = encode_messages(user + [message], thinking=True)[len(prompt):]
    parsed = parse_completion(completion, thinking=True)
    assert (parsed.reasoning_content, parsed.content) == (message["reasoning_content"], message["content"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


@pytest.mark.parametrize("preview,release_0731", [
    # C::test_legacy_profiles_match_flat_efforts: the preview efforts are the 0731 ones
    # under other names
    (None, "low"), ("high", "low"), ("max", "high"),
])
def test_preview_efforts_are_0731_efforts(preview, release_0731):
    assert effort_prefix("preview", preview, thinking=True) == effort_prefix("0731", release_0731, thinking=True)


def test_preview_rejects_low():
    # C::test_invalid_legacy_profile_or_effort
    with pytest.raises(ValueError):
        effort_prefix("preview", "low", thinking=True)


def test_replayed_arguments_as_object_or_json_string():
    # C::test_replayed_tool_arguments_match_json_strings
    arguments = {"city": "Paris", "count": 2, "options": {"units": "metric"}}

    def history(value):
        return [{"role": "user", "content": "Find the weather."},
                {"role": "assistant", "content": None, "tool_calls": [call("call_1", "weather", value)]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
                {"role": "user", "content": "And tomorrow?"}]

    actual = encode_messages(history(arguments), thinking=False)
    assert actual == encode_messages(history(json.dumps(arguments)), thinking=False)
    assert 'parameter name="city"' in actual and 'parameter name="arguments"' not in actual


FIXTURES = Path(__file__).parent / "data" / "vllm_deepseek_v4"


@pytest.mark.parametrize("case,thinking", [(1, True), (3, True), (4, False)])
def test_reference_golden_fixtures(case, thinking):
    # V::test_deepseek_v4_matches_reference_golden_fixtures (thinking with effort "low", the
    # 0731 default, for 1 and 3; chat mode for 4)
    data = json.loads((FIXTURES / f"test_input_{case}.json").read_text(encoding="utf-8"))
    messages, tools = (data["messages"], data.get("tools")) if isinstance(data, dict) else (data, None)
    prompt = encode_messages(messages, thinking=thinking, reasoning_effort="low" if thinking else None,
                             tools=tools, release="0731")
    assert prompt == (FIXTURES / f"test_output_{case}.txt").read_text(encoding="utf-8")
