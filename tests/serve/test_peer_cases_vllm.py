"""vLLM's DeepSeek-V4 tool-parser and reasoning-parser cases (inputs and expected outputs),
each parsed whole and at every chunking (serve/chat_cases.py). Sources, in vllm-project/vllm
and its forks carrying later versions of the same files:
  T = tests/tool_parsers/test_deepseekv4_tool_parser.py
  R = tests/reasoning/test_deepseekv4_reasoning_parser.py
Where vLLM and DeepSeek's reference disagree, dsv4 follows the reference; those cases say so.
"""
import json

import pytest

from serve.chat_cases import (D, INV_END, PARAM_END, TC_END, TC_START, block, calls_of, invoke, param,
                              parse_all, tool)


def build_tool_call(name: str, params: dict[str, str]) -> str:
    """T::build_tool_call: string parameters, each followed by a newline; no separator."""
    param_strs = "".join(param(k, v) + "\n" for k, v in params.items())
    return f'{TC_START}\n<{D}invoke name="{name}">\n{param_strs}{INV_END}\n{TC_END}'


PLAN_TRIP = tool("plan_trip", days={"type": "integer"}, flexible={"type": "boolean"},
                 cities={"type": "array", "items": {"type": "string"}}, notes={"type": "string"})
GET_WEATHER = tool("get_weather", location={"type": "string"})


def test_extract_tool_calls(tok):
    # T::test_extract_tool_calls
    msg = parse_all("Let me check. " + build_tool_call("get_weather", {"location": "Beijing", "unit": "celsius"}),
                    tok=tok)
    assert msg.content == "Let me check. "
    assert calls_of(msg) == [("get_weather", {"location": "Beijing", "unit": "celsius"})]


def test_function_calls_wrapper_is_read_as_a_damaged_wrapper():
    # T::test_function_calls_block_is_not_accepted expects the V3.2 wrapper name to stay
    # plain content, markup and all. DeepSeek's reference never returns DSML in content
    # (parse_message_from_completion_text rejects it), so dsv4 reads any wrapper name as
    # the block's wrapper and parses the invoke inside (disagreement, reference followed).
    text = build_tool_call("search", {"query": "vllm"}).replace("tool_calls", "function_calls")
    msg = parse_all(text)
    assert (msg.content, calls_of(msg)) == ("", [("search", {"query": "vllm"})])


def test_streaming_extracts_complete_invokes(tok):
    # T::test_streaming_extracts_complete_invokes
    msg = parse_all(build_tool_call("search", {"query": "deepseek v4"}), tok=tok)
    assert calls_of(msg) == [("search", {"query": "deepseek v4"})]


def test_split_start_token_does_not_leak_dsml_markers():
    # T::test_streaming_split_start_token_does_not_leak_dsml_markers (chunk size 1)
    msg = parse_all("I will check." + build_tool_call("search", {"query": "vllm"}))
    assert (msg.content, calls_of(msg)) == ("I will check.", [("search", {"query": "vllm"})])


def test_plain_text_trailing_angle_bracket_is_flushed():
    # T::test_streaming_plain_text_trailing_angle_bracket_is_flushed
    msg = parse_all("2 <")
    assert (msg.content, msg.tool_calls) == ("2 <", [])


def test_typed_arguments_are_preserved():
    # T::test_extract_tool_calls_non_streaming_preserves_typed_arguments (compact block)
    text = (f'{TC_START}<{D}invoke name="plan_trip">' + param("days", "3", "false")
            + param("flexible", "false", "false") + param("cities", '["Beijing", "Shanghai"]', "false")
            + param("notes", "window seat") + f"{INV_END}{TC_END}")
    msg = parse_all(text, tools=[PLAN_TRIP])
    assert calls_of(msg) == [("plan_trip", {"days": 3, "flexible": False, "cities": ["Beijing", "Shanghai"],
                                            "notes": "window seat"})]


def test_streaming_emits_incremental_argument_chunks():
    # T::test_streaming_emits_incremental_argument_chunks (canonical block, chunks of 4)
    text = block(invoke("plan_trip", param("days", "3", "false"), param("flexible", "false", "false"),
                        param("cities", '["Beijing","Shanghai","Tokyo","New York"]', "false"),
                        param("notes", "靠窗座位")))
    msg = parse_all(text, tools=[PLAN_TRIP])
    assert calls_of(msg) == [("plan_trip", {"days": 3, "flexible": False,
                                            "cities": ["Beijing", "Shanghai", "Tokyo", "New York"],
                                            "notes": "靠窗座位"})]
    from dsv4.serve.chat_format.parsers import OutputParser
    parser = OutputParser(False, True, tools=[PLAN_TRIP])
    pieces = [tc["function"]["arguments"] for i in range(0, len(text), 4) for d in parser.feed(text[i:i + 4])
              for tc in d.tool_calls or [] if tc["function"]["arguments"]]
    assert len(pieces) > 2


@pytest.mark.parametrize("name,flag,value", [
    ("arguments", "false", '{"location":"Beijing"}'),   # T::test_extract_tool_calls_arguments_wrapper
    ("arguments", "false", '{"location": "Beijing"}'),  # T::test_extract_tool_calls_repairs_arguments_wrapper_object
    ("input", "true", '{"location": "Beijing"}'),       # T::test_extract_tool_calls_repairs_input_wrapper_string
])                                                       # (and ..._streaming_..._repairs_input_wrapper_from_parser_tools)
def test_a_spurious_wrapper_parameter_is_unwrapped(name, flag, value):
    text = f'{TC_START}<{D}invoke name="get_weather">' + param(name, value, flag) + f"{INV_END}{TC_END}"
    msg = parse_all(text, tools=[GET_WEATHER])
    assert calls_of(msg) == [("get_weather", {"location": "Beijing"})]


def test_a_declared_arguments_parameter_is_kept():
    # The converse of the wrapper repair: vLLM (T::test_extract_tool_calls_unescapes_arguments_field_name)
    # keeps an "arguments" property the schema declares; its __vllm_param_arguments__
    # escaping is vLLM's own renaming and is not ported.
    text = block(invoke("echo_args", param("arguments", "hello")))
    msg = parse_all(text, tools=[tool("echo_args", arguments={"type": "string"})])
    assert calls_of(msg) == [("echo_args", {"arguments": "hello"})]


def test_composed_schemas_convert_objects_and_arrays():
    # T::test_composed_schema_converts_object_and_array_params
    set_timer = {"type": "function", "function": {"name": "set_timer", "parameters": {"type": "object", "properties": {
        "wait": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "patches": {"allOf": [{"type": "array", "items": {"type": "object"}}]}}}}}
    text = block(invoke("set_timer", param("wait", '{"type":"for","minutes":2880}', "false"),
                        param("patches", '[{"op":"replace","path":"/schedule","value":"quiet"}]', "false")))
    msg = parse_all(text, tools=[set_timer])
    assert calls_of(msg) == [("set_timer", {"wait": {"type": "for", "minutes": 2880},
                                            "patches": [{"op": "replace", "path": "/schedule", "value": "quiet"}]})]


@pytest.mark.parametrize("tools", [[tool("run_command", command={"type": "string"})], None])
def test_no_closing_tag_leaks_into_streamed_arguments(tools):
    # T::test_no_dsml_closing_tag_leak_in_streamed_args and
    # T::test_non_streaming_extract_with_angle_brackets: every chunk size.
    from dsv4.serve.chat_format.parsers import OutputParser
    text = build_tool_call("run_command", {"command": "git --version 2>&1"})
    for size in range(1, len(text) + 1):
        parser = OutputParser(False, True, tools=tools)
        deltas = [d for i in range(0, len(text), size) for d in parser.feed(text[i:i + size])]
        args = "".join(tc["function"]["arguments"] for d in deltas + parser.finish()[0] for tc in d.tool_calls or [])
        assert "DSML" not in args and json.loads(args) == {"command": "git --version 2>&1"}, size


def test_a_tool_call_without_think_close_ends_the_reasoning(tok):
    # T::test_tool_call_without_think_close_is_recovered (and its streaming twin)
    msg = parse_all("Let me check.\n\n" + build_tool_call("terminal", {"command": "git --no-pager log -1"}),
                    thinking=True, tok=tok)
    assert calls_of(msg) == [("terminal", {"command": "git --no-pager log -1"})]
    assert msg.reasoning_content == "Let me check." and TC_START not in msg.reasoning_content


def test_tool_call_start_implicitly_ends_reasoning():
    # R::test_tool_call_start_implicitly_ends_reasoning and
    # R::test_implicit_content_is_parseable_as_tool_call. vLLM keeps the "\n\n" before the
    # block in the reasoning; the reference encoder writes it as the block's separator,
    # so dsv4 drops it (disagreement, reference followed).
    call = block(invoke("read_file", param("path", "/tmp/example.lean")))
    msg = parse_all(f"Let me search.\n\n{call}", thinking=True)
    assert msg.reasoning_content == "Let me search." and msg.content == ""
    assert calls_of(msg) == [("read_file", {"path": "/tmp/example.lean"})]


def test_parameter_close_tag_is_not_part_of_the_value():
    # T::test_non_streaming_extract_with_angle_brackets: ">" inside a value is text.
    msg = parse_all(build_tool_call("run_command", {"command": "a > b && c >> d"}))
    assert calls_of(msg) == [("run_command", {"command": "a > b && c >> d"})] and PARAM_END not in msg.content
