"""SGLang's DeepSeek-V4 function-call detector cases (inputs and expected outputs), each parsed
whole and at every chunking (serve/chat_cases.py). Sources, in sgl-project/sglang:
  D = test/registered/unit/function_call/test_deepseekv4_detector.py (several versions)
  S = test/registered/unit/function_call/test_deepseekv4_streaming_robustness.py
SGLang's opt-in strict mode (SGLANG_DSV4_STRICT_TOOL_OUTPUT: raise on odd markup, schema
validation) has no counterpart: dsv4 reads tolerantly and never raises on model output.
Where SGLang and DeepSeek's reference disagree, dsv4 follows the reference; those cases say so.
"""
import json

import pytest

from serve.chat_cases import D, block, calls_of, invoke, param, parse_all, tool

WEATHER = tool("get_weather", city={"type": "string"}, unit={"type": "string", "enum": ["celsius", "fahrenheit"]})
SEARCH = tool("search", query={"type": "string"}, topn={"type": "integer", "default": 10})
SUBMIT = tool("submit")
TOOLS = [WEATHER, SEARCH, SUBMIT]


def _param(name, flag, value):
    return param(name, value, flag)


def _invoke(name, params=""):
    """D::_invoke: header, newline, parameters, newline, close."""
    return f'<{D}invoke name="{name}">\n{params}\n</{D}invoke>'


def _wrapped(inner):
    return f"<{D}tool_calls>\n{inner}\n</{D}tool_calls>"


def _weather_call(city="SF"):
    return _wrapped(_invoke("get_weather", _param("city", "true", city)))


def test_reasoning_boundary_keeps_literals_inside_arguments():
    # D::test_strict_reasoning_boundary_preserves_tool_argument_literals
    value = "Example:\n<think>keep this</think>"
    msg = parse_all("Inspect.</think>Now call.\n</think>\n" + _weather_call(value), thinking=True, tools=TOOLS)
    assert msg.reasoning_content == "Inspect." and msg.content.strip() == "Now call."
    assert calls_of(msg) == [("get_weather", {"city": value})]


@pytest.mark.parametrize("text,content", [
    ("Let me check.\n" + _weather_call(), "Let me check.\n"),          # D::test_preamble_in_same_delta_as_tool_call
    ("Checking.\n" + _invoke("get_weather", _param("city", "true", "SF")), "Checking.\n"),  # D::..._bare_invoke_...
    ("Prose.\n" + _weather_call(), "Prose.\n"),                        # D::test_no_dsml_markers_leak_into_normal_text
    ("I will check the weather. " + _weather_call("Tokyo"), "I will check the weather. "),  # D (3edaea1)::..._leading_text
])
def test_preamble_is_content_and_the_call_is_parsed(text, content, tok):
    msg = parse_all(text, tools=TOOLS, tok=tok)
    assert msg.content == content and [n for n, _ in calls_of(msg)] == ["get_weather"]


def test_a_cut_partial_json_parameter_is_an_unfinished_call():
    # D::test_malformed_partial_json_falls_back_to_raw_value (the name is streamed) and
    # D::test_truncated_non_string_parameter_is_an_explicit_error (SGLang raises at the
    # end; dsv4 leaves the call out of tool_calls, marked unfinished).
    for value in ('{"a"', "[1,2"):
        text = f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="false">{value}'
        msg = parse_all(text, tools=TOOLS)
        assert (msg.tool_calls, msg.unfinished) == ([], "tool_calls")
        assert msg.cut_calls[0]["function"]["name"] == "get_weather"
        assert msg.finish_reason("length") == "length" and msg.finish_reason("stop") == "stop"


def test_every_tool_calls_section_is_parsed():
    # D::test_non_streaming_parses_every_tool_calls_section
    msg = parse_all(f"{_weather_call('SF')}\n{_weather_call('NY')}", tools=TOOLS)
    assert calls_of(msg) == [("get_weather", {"city": "SF"}), ("get_weather", {"city": "NY"})]


@pytest.mark.parametrize("value", ["12345e-3", '{"ratio":12345e-3,"enabled":true}',
                                   '[{"step":"write code","ratio":12345e-3},null,false]'])
def test_non_string_values_are_parsed_json(value):
    # D::test_non_string_parameter_is_not_rewritten_after_streaming (the arguments are
    # json.dumps of the parsed values, and every streamed prefix is a prefix of them)
    set_config = {"type": "function", "function": {"name": "set_config", "parameters": {
        "type": "object", "properties": {"value": {}, "label": {"type": "string"}}}}}
    text = _wrapped(_invoke("set_config", _param("value", "false", value) + _param("label", "true", "complete")))
    msg = parse_all(text, tools=[set_config])
    expected = {"value": json.loads(value), "label": "complete"}
    assert msg.tool_calls[0]["function"]["arguments"] == json.dumps(expected, ensure_ascii=False)


def test_a_non_string_value_is_written_once_complete():
    # D::test_incomplete_non_string_parameter_does_not_emit_a_guessed_value: nothing of a
    # held value before its close; then 12345e-3 -> 12.345 (JSON, as the reference reads it,
    # although the schema says string: values are never turned into strings).
    from dsv4.serve.chat_format.parsers import OutputParser
    parser = OutputParser(False, True, tools=TOOLS)
    chunks = [f'<{D}tool_calls><{D}invoke name="get_weather"><{D}parameter name="city" string="false">',
              "123", "45", "e-", "3"]
    args = "".join(tc["function"]["arguments"] for c in chunks for d in parser.feed(c) for tc in d.tool_calls or [])
    assert args == ""
    rest = parser.feed(f"</{D}parameter></{D}invoke></{D}tool_calls>")
    assert json.loads("".join(tc["function"]["arguments"] for d in rest for tc in d.tool_calls)) == {"city": 12.345}


def test_a_string_value_streams_before_its_close():
    # D::test_string_parameter_still_streams_incrementally (and strict twin)
    from dsv4.serve.chat_format.parsers import OutputParser
    parser = OutputParser(False, True, tools=TOOLS)
    start = f'<{D}tool_calls><{D}invoke name="get_weather"><{D}parameter name="city" string="true">San Fran'
    first = parser.feed(start) + parser.feed("cisco")
    assert "San Fran" in "".join(tc["function"]["arguments"] for d in first for tc in d.tool_calls or [])


DAMAGED_PREFIXES = [  # D::test_damaged_wrappers_do_not_become_assistant_preamble
    f"\n\n<{D}toolcalls>\n\n",
    f"\n\n<{D}tool_calls\n",
    f"\n\n<{D}tool_calls<tool_calls>\n\n",
    f"Checking files.\n\n<{D} SugarPanel>\n",
    f"\n\n<{D}tool_calls...\n\n",
    f"Final scan:\n\n<{D}tool_calls-ok Let's scan the outputs.\n",
]


@pytest.mark.parametrize("prefix", DAMAGED_PREFIXES)
@pytest.mark.parametrize("bare", [False, True])
def test_damaged_wrappers_are_not_content(prefix, bare):
    call = _invoke("get_weather", _param("city", "true", "SF")) if bare else _weather_call()
    msg = parse_all(prefix + call, tools=TOOLS)
    assert msg.content.strip() == prefix.split(f"<{D}", 1)[0].strip()
    assert calls_of(msg) == [("get_weather", {"city": "SF"})]


@pytest.mark.parametrize("quote", [
    f"Example:\n```xml\n{_weather_call('literal')}\n```\n",
    f"Example: `{_weather_call('literal')}`\n",
    f"Example: '<{D}toolcalls>'\n",
])
def test_quoted_dsml_is_still_markup(quote):
    # D::test_quoted_dsml_is_not_executed_or_removed expects a quoted block to stay in the
    # text and not run. DeepSeek's reference never returns DSML in content (DSML is a
    # special token the model writes for tool calls only), so dsv4 reads it as markup: the
    # quoted call is a call, and no DSML reaches the content (disagreement, reference followed).
    msg = parse_all(quote + _weather_call(), tools=TOOLS)
    assert msg.content.startswith("Example:") and D not in msg.content
    assert calls_of(msg)[-1] == ("get_weather", {"city": "SF"})


@pytest.mark.parametrize("text", [
    # D::test_strict_mode_preserves_literal_markup_and_balanced_xml and
    # D::test_strict_mode_rejects_orphan_markup_before_content_is_emitted: XML that is not
    # DSML is plain text (SGLang's strict mode rejects the orphan forms; dsv4 keeps them).
    "Literal `</parameter>`.",
    "Example:\n```xml\n</parameter>\n</invoke>\n```",
    'XML:\n<parameter description="a > b">\nvalue\n</parameter>',
    "</parameter>",
    "Text with an unrelated SGML fragment: <![unexpected[.",
    "Now let me update the result.\n\n</parameter>\n",
    '</parameter></invoke><invoke name="exec_command">\n',
])
def test_xml_that_is_not_dsml_is_text(text):
    msg = parse_all(text, tools=TOOLS)
    assert (msg.content, msg.tool_calls) == (text, [])


def test_indented_calls_and_literal_markup_in_values(tok):
    # D::test_indented_native_calls_and_parameter_literals_are_preserved
    literal = f"Echo `<{D}tool_calls>` without interpreting it"
    body = _weather_call(literal) + "\n" + _weather_call("NY")
    text = "Checking.\n" + "\n".join("        " + line for line in body.splitlines())
    msg = parse_all(text, tools=TOOLS, tok=tok)
    assert calls_of(msg) == [("get_weather", {"city": literal}), ("get_weather", {"city": "NY"})]
    assert msg.content.strip() == "Checking."


MARKER = f"</{D}parameter |"


@pytest.mark.parametrize("value", [
    # D::test_string_parameter_preserves_quoted_heredoc_and_escaped_marker_literals and
    # D::test_new_parameter_guard_does_not_change_non_strict_behavior: only the exact
    # close tag ends a value.
    f'print("{MARKER}")', f"Example: `{MARKER}`", f"```xml\n{MARKER}\n```", f"cat <<'EOF'\n{MARKER}\nEOF",
    f"cat <<EOF\n{MARKER}\nEOF", f"cat <<-EOF\n\t{MARKER}\n\tEOF", f"cat <<'A' <<'B'\n{MARKER}\nA\n{MARKER}\nB",
    f"# Literal example: {MARKER}\nprint(1)", f"echo \\{MARKER}", f'echo "created"{MARKER}\nprintf done',
    'python3 <<\'PY\'\ntext = """Notes.</think>"""\nprint(text)\nPY',  # D::test_opt_in_marker_policy_... (not strict)
])
def test_string_values_keep_marker_literals(value):
    msg = parse_all(_weather_call(value), tools=TOOLS)
    assert calls_of(msg) == [("get_weather", {"city": value})]


@pytest.mark.parametrize("body", ['{"city":"SF"}', '{"city": "SF"}', '\n{\n  "city": "SF"\n}\n'])
def test_an_invoke_body_written_as_json(body):
    # D::test_strict_direct_json_waits_for_complete_validated_invoke,
    # D (3edaea1)::test_single_tool_call_json_params, S::TestParameterTypeConversion::test_direct_json_body
    msg = parse_all(f'<{D}tool_calls><{D}invoke name="get_weather">{body}</{D}invoke></{D}tool_calls>', tools=TOOLS)
    assert calls_of(msg) == [("get_weather", {"city": "SF"})]


def test_a_missing_invoke_close_before_the_next_invoke():
    # D::test_strict_rejects_nested_invoke_instead_of_rewriting_streamed_arguments (strict
    # mode rejects it; read tolerantly, each invoke is its own call)
    source = _wrapped(f'<{D}invoke name="get_weather">' + _param("city", "true", "San Francisco") + "\n</"
                      + _invoke("get_weather", _param("city", "true", "NY")))
    msg = parse_all(source, tools=TOOLS)
    assert calls_of(msg) == [("get_weather", {"city": "San Francisco"}), ("get_weather", {"city": "NY"})]


def test_a_missing_parameter_close_ends_at_the_invoke_close():
    # D::test_strict_rejects_unclosed_string_parameter_at_invoke_end and
    # D::test_strict_incomplete_later_call_does_not_rewrite_previous_calls (strict mode
    # rejects; vLLM's parser and dsv4 end the value at the next tag)
    later = _wrapped(f'<{D}invoke name="get_weather"><{D}parameter name="city" string="true">LA</{D}invoke>')
    msg = parse_all(_weather_call("SF") + _weather_call("NY") + later, tools=TOOLS)
    assert calls_of(msg) == [("get_weather", {"city": c}) for c in ("SF", "NY", "LA")]


def test_a_repeated_parameter_keeps_its_first_value():
    # D::test_non_strict_duplicate_parameters_retain_legacy_behavior keeps the last value
    # ("NY"); the reference rejects the repeat. dsv4 keeps the first: it may already be
    # streamed, and a streamed value cannot be taken back (disagreement).
    msg = parse_all(_wrapped(_invoke("get_weather", _param("city", "true", "SF") + _param("city", "true", "NY"))),
                    tools=TOOLS)
    assert calls_of(msg) == [("get_weather", {"city": "SF"})] and msg.content == ""


# ---- test_deepseekv4_streaming_robustness.py ------------------------------------------------
PROSE = "Let me check the weather for you.\n\n"
BODY = _param("city", "true", "SF")


@pytest.mark.parametrize("call", [_wrapped(_invoke("get_weather", BODY)), _invoke("get_weather", BODY)])
def test_preamble_survives_every_split(call, tok):
    # S::TestPreamblePreservation (every split position, fixed chunk sizes, wrapped and bare)
    msg = parse_all(PROSE + call, tools=TOOLS, tok=tok)
    assert msg.content == "Let me check the weather for you."
    assert calls_of(msg) == [("get_weather", {"city": "SF"})]


@pytest.mark.parametrize("text,content", [
    ("Is 3 < 5? Yes.\n", "Is 3 < 5? Yes.\n"),                          # S::test_literal_less_than_not_swallowed
    ("Compare 3 < 5.\n" + _wrapped(_invoke("get_weather", BODY)), "Compare 3 < 5.\n"),  # ..._before_tool_call
])
def test_a_literal_less_than_is_content(text, content):
    assert parse_all(text, tools=TOOLS).content == content


@pytest.mark.parametrize("flag,value,expected", [  # S::TestParameterTypeConversion
    ("true", "42", "42"), ("false", "10", 10), ("false", "true", True), ("false", "[1, 2, 3]", [1, 2, 3]),
    ("false", '{"name": "John", "age": 30}', {"name": "John", "age": 30}), ("false", "null", None),
    ("false", '{"key": "val', '{"key": "val'),             # malformed JSON falls back to the raw string
])
def test_parameter_values_without_a_schema(flag, value, expected):
    msg = parse_all(_wrapped(_invoke("anything", _param("p", flag, value))), tools=TOOLS)
    assert calls_of(msg) == [("anything", {"p": expected})]


def test_sequential_invokes_and_a_self_closing_one():
    # S::TestMultipleSequentialCalls (distinct indexes, names before arguments, self-closing mix)
    text = _wrapped(_invoke("get_weather", BODY) + "\n" + _invoke("search", _param("query", "true", "weather SF"))
                    + "\n" + f'<{D}invoke name="submit"/>')
    msg = parse_all(text, tools=TOOLS)
    assert calls_of(msg) == [("get_weather", {"city": "SF"}), ("search", {"query": "weather SF"}), ("submit", {})]
    assert len({c["id"] for c in msg.tool_calls}) == 3


@pytest.mark.parametrize("text,content", [
    # S::TestFalsePositiveDSMLDetection: no call. A DSML tag that is not a call is markup
    # and is dropped (SGLang keeps such text buffered), and so is the DSML token alone: the
    # reference rejects it in content.
    ("Hello <" + f"{D}test more text", "Hello "),
    (f"<{D}" + "random> stuff here", "stuff here"),
    ("Text < " + D + " not_invoke text", "Text <  not_invoke text"),
])
def test_dsml_that_is_not_a_call(text, content):
    msg = parse_all(text, tools=TOOLS)
    assert (msg.content, msg.tool_calls, msg.cut_calls) == (content, [], [])


@pytest.mark.parametrize("cut", range(1, len(f'<{D}invoke name="get_weather">')))
def test_output_cut_inside_an_invoke_header(cut):
    # S::TestOpenerTruncationMidOpener and S::TestFullPipelineProductionBugReproduction:
    # the prose is content, no call, finish_reason stays "stop".
    msg = parse_all("Prose.\n" + f'<{D}invoke name="get_weather">'[:cut], tools=TOOLS)
    assert msg.tool_calls == [] and msg.cut_calls == [] and msg.content.startswith("Prose.\n")
    assert msg.finish_reason("stop") == "stop"


def test_max_tokens_cut_after_a_parameter():
    # S::TestMaxTokensTruncation::test_partial_tool_call_emitted_on_truncation: SGLang
    # reports the partial call; dsv4 streams it but leaves it out of tool_calls, and the
    # finish_reason says "length".
    msg = parse_all(f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n' + BODY, tools=TOOLS)
    assert msg.tool_calls == [] and msg.cut_calls[0]["function"] == {"name": "get_weather",
                                                                       "arguments": '{"city": "SF"'}
    assert msg.finish_reason("length") == "length"


def test_no_markup_words_leak_into_content():
    # S::TestFenceLeak
    msg = parse_all("Prose here.\n" + _wrapped(_invoke("get_weather", BODY)), tools=TOOLS)
    assert not any(w in msg.content for w in (f"<{D}", f"</{D}", "invoke", "parameter"))
