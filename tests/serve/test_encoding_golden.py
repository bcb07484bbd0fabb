"""Golden prompts: `encode_messages` must equal DeepSeek's reference encoder byte for byte.

Every expected string below was written by hand from reading the reference, not by running
this project's code. "REF" is DeepSeek's `encoding/encoding_dsv4.py` as copied in vLLM
(`vllm/tokenizers/deepseek_v4_encoding.py`) and SGLang
(`python/sglang/srt/entrypoints/openai/encoding_dsv4.py`); "REF-0731" is the 0731 encoder's
`REASONING_EFFORT_PROMPTS` / `DEFAULT_REASONING_EFFORT`; "VLLM-WRAP" is vLLM's
`vllm/tokenizers/deepseek_v4.py` (request tools go on the leading system/developer message).
Rules cited by function name: encode_messages, render_message, merge_tool_messages,
sort_tool_results_by_call_order, _drop_thinking_messages, encode_arguments_to_dsml,
render_tools (TOOLS_TEMPLATE), response_format_template.
"""

import pytest

from dsv4.serve.chat_format.encoding import encode_messages

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

# REF TOOLS_TEMPLATE with {dsml_token}, {thinking_start_token}, {thinking_end_token} filled
# in, split around {tool_schemas} (one JSON line per function, render_tools).
TOOLS_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    "by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_TAIL = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

# REF REASONING_EFFORT_MAX (preview "max"), = REF-0731 "high".
ABSOLUTE_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
# REF-0731 "max".
BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem into its most fundamental components, trace every causal chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_JSON = ('{"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", '
                '"properties": {"city": {"type": "string"}}, "required": ["city"]}}')
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TIME_JSON = '{"name": "get_time", "parameters": {"type": "object", "properties": {}}}'
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web 🔎"}}
SEARCH_JSON = '{"name": "search", "description": "Search the web 🔎"}'


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CASES = {
    # REF render_message: user -> USER_SP_TOKEN + content; last user/developer message is
    # followed by ASSISTANT_SP_TOKEN + thinking_end_token in chat mode.
    "chat_single_user": (
        dict(messages=[{"role": "user", "content": "Hello"}], thinking=False),
        BOS + U + "Hello" + A + "</think>"),
    # REF: thinking mode, index >= last_user_idx -> thinking_start_token.
    "thinking_single_user": (
        dict(messages=[{"role": "user", "content": "Hello"}], thinking=True),
        BOS + U + "Hello" + A + "<think>"),
    # REF system_msg_template "{content}" (no role token); system followed by user adds nothing.
    "system_and_user": (
        dict(messages=[{"role": "system", "content": "You are helpful."},
                       {"role": "user", "content": "Hi"}], thinking=False),
        BOS + "You are helpful." + U + "Hi" + A + "</think>"),
    # REF assistant_msg_template "{reasoning}{content}{tool_calls}" + eos; in chat mode no
    # thinking part; an assistant followed by a user returns early (no transition).
    "chat_multi_turn": (
        dict(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "A?"},
                       {"role": "assistant", "content": "B."}, {"role": "user", "content": "C?"}],
             thinking=False),
        BOS + "S" + U + "A?" + A + "</think>" + "B." + EOS + U + "C?" + A + "</think>"),
    # REF _drop_thinking_messages: reasoning before the last user turn is dropped; earlier user
    # turns get thinking_end_token (index < last_user_idx), the last one thinking_start_token.
    "thinking_multi_turn_drops_reasoning": (
        dict(messages=[{"role": "user", "content": "A?"},
                       {"role": "assistant", "reasoning_content": "old thoughts", "content": "B."},
                       {"role": "user", "content": "C?"}], thinking=True),
        BOS + U + "A?" + A + "</think>" + "B." + EOS + U + "C?" + A + "<think>"),
    # REF: an assistant after the last user keeps "{reasoning}</think>" (index > last_user_idx).
    "thinking_assistant_after_last_user": (
        dict(messages=[{"role": "user", "content": "A?"},
                       {"role": "assistant", "reasoning_content": "R", "content": "B."}], thinking=True),
        BOS + U + "A?" + A + "<think>" + "R</think>" + "B." + EOS),
    # REF: developer -> USER_SP_TOKEN + content; a developer before a user adds no transition.
    "developer_chat": (
        dict(messages=[{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                       {"role": "user", "content": "U"}], thinking=False),
        BOS + "S" + U + "D" + U + "U" + A + "</think>"),
    # REF _drop_thinking_messages: in thinking mode a developer message before the last user
    # message is dropped entirely.
    "developer_thinking_dropped": (
        dict(messages=[{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                       {"role": "user", "content": "U"}], thinking=True),
        BOS + "S" + U + "U" + A + "<think>"),
    # REF find_last_user_index counts developer: a final developer message is kept and gets
    # the generation prompt.
    "developer_last_thinking": (
        dict(messages=[{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}],
             thinking=True),
        BOS + "S" + U + "D" + A + "<think>"),
    # REF: system content + "\n\n" + render_tools(tools); VLLM-WRAP puts request tools on
    # the leading system message.
    "tools_on_system_thinking": (
        dict(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"}],
             tools=[WEATHER], thinking=True),
        BOS + "S\n\n" + TOOLS_HEAD + WEATHER_JSON + TOOLS_TAIL + U + "Weather?" + A + "<think>"),
    # VLLM-WRAP: without a leading system/developer message a system message with no content
    # is inserted, so the prompt starts with "\n\n## Tools".
    "tools_without_system_chat": (
        dict(messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], thinking=False),
        BOS + "\n\n" + TOOLS_HEAD + WEATHER_JSON + TOOLS_TAIL + U + "Weather?" + A + "</think>"),
    # VLLM-WRAP attaches tools to a leading developer message; REF renders them after its
    # content, and (tools present) does not drop the developer message in thinking mode.
    "tools_on_developer_thinking": (
        dict(messages=[{"role": "developer", "content": "D"}, {"role": "user", "content": "U"}],
             tools=[WEATHER, TIME], thinking=True),
        BOS + U + "D\n\n" + TOOLS_HEAD + WEATHER_JSON + "\n" + TIME_JSON + TOOLS_TAIL
        + U + "U" + A + "<think>"),
    # REF: tools present -> drop_thinking off: the assistant keeps "R</think>"; tool calls are
    # "\n\n" + tool_calls block (encode_arguments_to_dsml: str -> string="true", else JSON);
    # merge_tool_messages folds both results into one user turn; sort_tool_results_by_call_order
    # puts them in call order (c1 before c2) although they arrived c2 first.
    "tool_loop_results_out_of_order": (
        dict(messages=[
            {"role": "system", "content": "S"}, {"role": "user", "content": "Weather and time in Paris?"},
            {"role": "assistant", "reasoning_content": "Two tools.", "content": "",
             "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}'),
                            call("c2", "get_time", '{"tz": "Europe/Paris", "fmt": 24}')]},
            {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            tools=[WEATHER, TIME], thinking=True),
        BOS + "S\n\n" + TOOLS_HEAD + WEATHER_JSON + "\n" + TIME_JSON + TOOLS_TAIL
        + U + "Weather and time in Paris?" + A + "<think>" + "Two tools.</think>"
        + "\n\n<｜DSML｜tool_calls>\n"
        + "<｜DSML｜invoke name=\"get_weather\">\n"
        + "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        + "</｜DSML｜invoke>\n"
        + "<｜DSML｜invoke name=\"get_time\">\n"
        + "<｜DSML｜parameter name=\"tz\" string=\"true\">Europe/Paris</｜DSML｜parameter>\n"
        + "<｜DSML｜parameter name=\"fmt\" string=\"false\">24</｜DSML｜parameter>\n"
        + "</｜DSML｜invoke>\n"
        + "</｜DSML｜tool_calls>" + EOS
        + U + "<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>" + A + "<think>"),
    # REF merge_tool_messages: a user message after tool results joins the same user turn as
    # a text block ("\n\n" between blocks); chat mode puts no reasoning in the assistant turn.
    "tool_result_then_user_text_chat": (
        dict(messages=[
            {"role": "user", "content": "Find x"},
            {"role": "assistant", "content": "Searching.",
             "tool_calls": [call("s1", "search", {"query": "x", "limit": 2})]},
            {"role": "tool", "tool_call_id": "s1", "content": "found"},
            {"role": "user", "content": "Summarize"}],
            tools=[SEARCH], thinking=False),
        BOS + "\n\n" + TOOLS_HEAD + SEARCH_JSON + TOOLS_TAIL + U + "Find x" + A + "</think>"
        + "Searching.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"search\">\n"
        + "<｜DSML｜parameter name=\"query\" string=\"true\">x</｜DSML｜parameter>\n"
        + "<｜DSML｜parameter name=\"limit\" string=\"false\">2</｜DSML｜parameter>\n"
        + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
        + U + "<tool_result>found</tool_result>\n\nSummarize" + A + "</think>"),
    # REF sort_tool_results_by_call_order: sort key is the call position, 0 for an unknown id;
    # the sort is stable, so the unknown result (position 0, arrived first) stays ahead of c1.
    "tool_results_unknown_id_sorts_first": (
        dict(messages=[
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": "",
             "tool_calls": [call("c1", "get_time", "{}"), call("c2", "get_time", "{}")]},
            {"role": "tool", "tool_call_id": "c2", "content": "second"},
            {"role": "tool", "tool_call_id": "zz", "content": "unknown"},
            {"role": "tool", "tool_call_id": "c1", "content": "first"}],
            tools=[TIME], thinking=False),
        BOS + "\n\n" + TOOLS_HEAD + TIME_JSON + TOOLS_TAIL + U + "Go" + A + "</think>"
        + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">\n\n</｜DSML｜invoke>\n"
        + "<｜DSML｜invoke name=\"get_time\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
        + U + "<tool_result>unknown</tool_result>\n\n<tool_result>first</tool_result>\n\n"
        + "<tool_result>second</tool_result>" + A + "</think>"),
    # REF encode_arguments_to_dsml: nested objects, booleans and floats as to_json
    # (ensure_ascii=False); multi-line and non-ASCII strings as is; an empty argument object
    # gives an empty line between the invoke tags.
    "tool_call_argument_types": (
        dict(messages=[
            {"role": "user", "content": "Save it"},
            {"role": "assistant", "content": "Done soon.", "tool_calls": [
                call("w", "write_file", '{"path": "a.txt", "content": "line1\\nline2 ✓", "overwrite": true, '
                                        '"meta": {"tags": ["x", "é"], "size": 1.5}, "n": null}'),
                call("t", "now", "{}")]}],
            thinking=False),
        BOS + U + "Save it" + A + "</think>" + "Done soon.\n\n<｜DSML｜tool_calls>\n"
        + "<｜DSML｜invoke name=\"write_file\">\n"
        + "<｜DSML｜parameter name=\"path\" string=\"true\">a.txt</｜DSML｜parameter>\n"
        + "<｜DSML｜parameter name=\"content\" string=\"true\">line1\nline2 ✓</｜DSML｜parameter>\n"
        + "<｜DSML｜parameter name=\"overwrite\" string=\"false\">true</｜DSML｜parameter>\n"
        + "<｜DSML｜parameter name=\"meta\" string=\"false\">{\"tags\": [\"x\", \"é\"], \"size\": 1.5}</｜DSML｜parameter>\n"
        + "<｜DSML｜parameter name=\"n\" string=\"false\">null</｜DSML｜parameter>\n"
        + "</｜DSML｜invoke>\n"
        + "<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS),
    # REF: tools anywhere -> drop_thinking off: earlier reasoning stays and every user turn
    # followed by an assistant opens with thinking_start_token.
    "tools_keep_reasoning_multi_turn": (
        dict(messages=[{"role": "user", "content": "A?"},
                       {"role": "assistant", "reasoning_content": "R1", "content": "B."},
                       {"role": "user", "content": "C?"}], tools=[TIME], thinking=True),
        BOS + "\n\n" + TOOLS_HEAD + TIME_JSON + TOOLS_TAIL + U + "A?" + A + "<think>" + "R1</think>B."
        + EOS + U + "C?" + A + "<think>"),
    # REF response_format_template after the system content (to_json of the object as given).
    "response_format_on_system": (
        dict(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "JSON please"}],
             response_format={"type": "json_object"}, thinking=False),
        BOS + "S\n\n" + RESPONSE_FORMAT + '{"type": "json_object"}' + U + "JSON please" + A + "</think>"),
    # REF: tools first, then the response format, on the same (inserted) system message.
    "tools_and_response_format": (
        dict(messages=[{"role": "user", "content": "Weather as JSON"}], tools=[WEATHER],
             response_format={"type": "json_schema", "json_schema": {
                 "name": "w", "schema": {"type": "object", "properties": {"t": {"type": "number"}}}}},
             thinking=True, reasoning_effort="high"),
        BOS + ABSOLUTE_MAX + "\n\n" + TOOLS_HEAD + WEATHER_JSON + TOOLS_TAIL + "\n\n" + RESPONSE_FORMAT
        + '{"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object", '
          '"properties": {"t": {"type": "number"}}}}}'
        + U + "Weather as JSON" + A + "<think>"),
    # REF (preview): only "max" adds REASONING_EFFORT_MAX, at index 0 in thinking mode.
    "preview_effort_max": (
        dict(messages=[{"role": "user", "content": "Prove it."}], thinking=True,
             reasoning_effort="max", release="preview"),
        BOS + ABSOLUTE_MAX + U + "Prove it." + A + "<think>"),
    "preview_effort_high": (
        dict(messages=[{"role": "user", "content": "Prove it."}], thinking=True,
             reasoning_effort="high", release="preview"),
        BOS + U + "Prove it." + A + "<think>"),
    "preview_effort_none": (
        dict(messages=[{"role": "user", "content": "Prove it."}], thinking=True,
             reasoning_effort=None, release="preview"),
        BOS + U + "Prove it." + A + "<think>"),
    # REF-0731: low adds "", high the "Absolute maximum" text, max the "Beyond maximum" text;
    # None means DEFAULT_REASONING_EFFORT = "low".
    "r0731_effort_low": (
        dict(messages=[{"role": "user", "content": "Prove it."}], thinking=True,
             reasoning_effort="low", release="0731"),
        BOS + U + "Prove it." + A + "<think>"),
    "r0731_effort_none": (
        dict(messages=[{"role": "user", "content": "Prove it."}], thinking=True, release="0731"),
        BOS + U + "Prove it." + A + "<think>"),
    "r0731_effort_high_before_system": (
        dict(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Prove it."}],
             thinking=True, reasoning_effort="high", release="0731"),
        BOS + ABSOLUTE_MAX + "S" + U + "Prove it." + A + "<think>"),
    "r0731_effort_max": (
        dict(messages=[{"role": "user", "content": "Prove it."}], thinking=True,
             reasoning_effort="max", release="0731"),
        BOS + BEYOND_MAX + U + "Prove it." + A + "<think>"),
    # REF-0731: the prefix is only added in thinking mode.
    "r0731_effort_max_chat_mode": (
        dict(messages=[{"role": "user", "content": "Prove it."}], thinking=False,
             reasoning_effort="max", release="0731"),
        BOS + U + "Prove it." + A + "</think>"),
    # Non-ASCII text passes through unchanged (REF templates are plain str.format).
    "non_ascii_multi_turn": (
        dict(messages=[{"role": "system", "content": "你是一个助手。"},
                       {"role": "user", "content": "Ünïcödé 😀 日本語？"},
                       {"role": "assistant", "content": "答案：42 🎉"},
                       {"role": "user", "content": "再说一遍"}], thinking=False),
        BOS + "你是一个助手。" + U + "Ünïcödé 😀 日本語？" + A + "</think>" + "答案：42 🎉" + EOS
        + U + "再说一遍" + A + "</think>"),
    # REF merge_tool_messages: consecutive user messages become one turn, "\n\n" between.
    "consecutive_users_merge": (
        dict(messages=[{"role": "user", "content": "first"}, {"role": "user", "content": "second"}],
             thinking=True),
        BOS + U + "first\n\nsecond" + A + "<think>"),
    # Text parts joined with "\n" (vLLM chat_utils; REF takes a string). A tool result given as
    # parts follows REF render_message: "\n\n" between parts, "[Unsupported TYPE]" otherwise.
    "content_parts": (
        dict(messages=[
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
            {"role": "assistant", "content": "", "tool_calls": [call("c", "get_time", "{}")]},
            {"role": "tool", "tool_call_id": "c", "content": [
                {"type": "text", "text": "12:00"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
            thinking=False),
        BOS + U + "part one\npart two" + A + "</think>"
        + "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_time\">\n\n</｜DSML｜invoke>\n"
        + "</｜DSML｜tool_calls>" + EOS
        + U + "<tool_result>12:00\n\n[Unsupported image_url]</tool_result>" + A + "</think>"),
    # REF: latest_reminder -> LATEST_REMINDER_SP_TOKEN + content; a system followed by it adds
    # nothing; task "action" -> ASSISTANT + thinking_end_token (chat) + <｜action｜>.
    "latest_reminder_and_action_task": (
        dict(messages=[{"role": "system", "content": "System text."},
                       {"role": "latest_reminder", "content": "2026-07-31,Friday,Paris,App,English"},
                       {"role": "user", "content": "Which day?", "task": "action"}], thinking=False),
        BOS + "System text.<｜latest_reminder｜>2026-07-31,Friday,Paris,App,English" + U + "Which day?"
        + A + "</think><｜action｜>"),
    # REF: a non-action task appends only its token after the message.
    "query_task": (
        dict(messages=[{"role": "user", "content": "weather paris", "task": "query"}], thinking=True),
        BOS + U + "weather paris" + "<｜query｜>"),
    # add_generation_prompt=False leaves out the final ASSISTANT + think token.
    "no_generation_prompt": (
        dict(messages=[{"role": "user", "content": "Hello"}], thinking=True, add_generation_prompt=False),
        BOS + U + "Hello"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_prompt(name):
    kwargs, expected = CASES[name]
    assert encode_messages(**kwargs) == expected


def test_golden_case_count():
    assert len(CASES) >= 20
