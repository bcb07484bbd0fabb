"""Reasoning/content splitting against the peers' DeepSeek-V4 reasoning-parser cases, whole and
at every chunking (serve/chat_cases.py). Sources, in sgl-project/sglang:
  C = test/registered/unit/parser/test_dsv4_chunk_invariance.py
  I = test/registered/unit/parser/test_dsv4_reasoning_integration.py
(their expectedFailure cases are what SGLang means to do; dsv4 does it).
"""
import pytest

from serve.chat_cases import D, EOS, calls_of, parse_all

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START = f"<{D}"
TOOL_CALL = (f'<{D}tool_calls><{D}invoke name="search"><{D}parameter name="query" string="true">hello'
             f"</{D}parameter></{D}invoke></{D}tool_calls>")
LS_CALL = (f'<{D}tool_calls>\n<{D}invoke name="ls">\n<{D}parameter name="command" string="true">pwd'
           f"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")


def test_reasoning_then_content_at_every_chunk_size(tok):
    # C::test_pure_reasoning_*_chunk_invariant, I::test_chunk_size_invariance_*
    msg = parse_all(f"{THINK_START}reasoning content here{THINK_END}normal content", thinking=True, tok=tok)
    assert (msg.reasoning_content, msg.content) == ("reasoning content here", "normal content")


def test_reasoning_then_a_tool_call(tok):
    # C::test_reasoning_tool_*_chunk_invariant, I::test_non_streaming_dsml_routes_to_normal
    msg = parse_all(f"{THINK_START}my reasoning{THINK_END}{TOOL_CALL}", thinking=True, tok=tok)
    assert (msg.reasoning_content, msg.content, calls_of(msg)) == ("my reasoning", "", [("search", {"query": "hello"})])


@pytest.mark.parametrize("split", range(1, len(THINK_END)))
def test_think_end_split_across_chunks(split):
    # C::TestThinkEndBoundarySplit, C::TestDetokenizerHoldback::test_partial_think_end_*
    from dsv4.serve.chat_format.parsers import OutputParser
    parser = OutputParser(thinking=True, tools_enabled=True)
    parser.feed(f"{THINK_START}reasoning{THINK_END[:split]}")
    parser.feed(f"{THINK_END[split:]} normal")
    msg = parser.finish()[1]
    assert (msg.reasoning_content, msg.content) == ("reasoning", " normal")


@pytest.mark.parametrize("split", range(1, len(TOOL_START)))
def test_a_tool_block_right_after_reasoning_ends_it(split):
    # C::TestToolStartBoundarySplit (every split of "<｜DSML｜"), I::test_dsml_block_routes_to_normal_not_reasoning
    from dsv4.serve.chat_format.parsers import OutputParser
    parser = OutputParser(thinking=True, tools_enabled=True)
    parser.feed(f"{THINK_START}reasoning{TOOL_START[:split]}")
    parser.feed(f"{TOOL_START[split:]}{TOOL_CALL[len(TOOL_START):]}")
    msg = parser.finish()[1]
    assert msg.reasoning_content == "reasoning" and calls_of(msg) == [("search", {"query": "hello"})]


def test_reasoning_then_a_call_without_think_end():
    # I::test_joint_reasoning_then_tool_call_streaming, I::test_tool_call_arguments_parsed
    msg = parse_all(f"{THINK_START}I should list files.{LS_CALL}", thinking=True)
    assert msg.reasoning_content == "I should list files." and calls_of(msg) == [("ls", {"command": "pwd"})]


def test_multi_token_batches():
    # C::TestMTPScenario
    msg = parse_all(f"{THINK_START}Let me reason about it.{THINK_END}The command is{TOOL_CALL}", thinking=True)
    assert (msg.reasoning_content, msg.content) == ("Let me reason about it.", "The command is")


def test_a_second_think_block_is_reasoning_again():
    # I::test_multi_think_block_cycling (expectedFailure there). The reference has one
    # reasoning block and rejects think tags in content; dsv4 keeps the tags out of the
    # content, as SGLang wants and as vLLM's DeepSeekV4Parser does.
    msg = parse_all(f"{THINK_START}first reasoning{THINK_END}first answer"
                    f"{THINK_START}second reasoning{THINK_END}second answer", thinking=True)
    assert msg.reasoning_content == "first reasoningsecond reasoning"
    assert msg.content == "first answersecond answer"


def test_stray_think_tags_are_dropped():
    # vLLM vllm/parser/deepseek_v4.py transitions: a bare </think> in content and a repeated
    # <think> in reasoning are absorbed.
    msg = parse_all(f"a{THINK_START}b{THINK_END}c{THINK_END}d", thinking=True)
    assert (msg.reasoning_content, msg.content) == ("ab", "cd")


@pytest.mark.parametrize("ending", ["", EOS, EOS + "ignored"])
def test_no_think_end_keeps_the_text_in_reasoning(ending):
    # DeepSeek's API returns such a reply in the reasoning channel with empty content (as
    # observed by lobehub/lobehub PR #16294 against api.deepseek.com), and vLLM's V4
    # reasoning parser (R1-based, tests/reasoning/test_deepseekv4_reasoning_parser.py) and
    # SGLang's (force_reasoning) do the same. The message says so: unfinished "reasoning".
    msg = parse_all("The answer is 4." + ending, thinking=True)
    assert (msg.reasoning_content, msg.content, msg.unfinished) == ("The answer is 4.", "", "reasoning")
    assert msg.finish_reason("stop") == "stop" and msg.to_message()["content"] == ""


def test_thinking_off_with_a_think_block():
    # Chat mode: a <think> block the model writes anyway is reasoning, not content.
    msg = parse_all(f"{THINK_START}hm{THINK_END}Hi", thinking=False)
    assert (msg.reasoning_content, msg.content) == ("hm", "Hi")
    assert parse_all("Hi", thinking=False).reasoning_content is None


def test_continuation_can_start_in_content():
    # A continued assistant turn whose reasoning is closed starts in the content.
    msg = parse_all("more text" + EOS, thinking=True, start="content")
    assert (msg.reasoning_content, msg.content, msg.unfinished) == ("", "more text", None)
