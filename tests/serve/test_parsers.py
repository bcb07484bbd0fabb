import itertools
import json
import random

import pytest

from dsv4.serve.chat_format.parsers import Delta, OutputParser, ParsedMessage, parse_completion

EOS = "<｜end▁of▁sentence｜>"
BLOCK = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
         '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
ARGS = '{"city": "Paris", "days": 3}'


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def streamed(text: str, thinking: bool, tools: bool = True, size: int = 1):
    """Parse `text` fed in chunks of `size` chars; return (deltas, message)."""
    parser = OutputParser(thinking, tools, id_factory=ids())
    deltas = [d for i in range(0, len(text), size) for d in parser.feed(text[i:i + size])]
    tail, message = parser.finish()
    return deltas + tail, message


def both(text: str, thinking: bool, tools: bool = True) -> ParsedMessage:
    """The whole-text parse, checked to equal the char-by-char streamed parse."""
    whole = parse_completion(text, thinking=thinking, tools_enabled=tools, id_factory=ids())
    assert streamed(text, thinking, tools)[1] == whole
    assert streamed(text, thinking, tools, size=7)[1] == whole
    return whole


def test_chat_content():
    msg = both("Hello there" + EOS, thinking=False)
    assert (msg.content, msg.reasoning_content, msg.tool_calls, msg.unfinished) == ("Hello there", None, [], None)
    assert msg.finish_reason("stop") == "stop"
    assert msg.to_message() == {"role": "assistant", "content": "Hello there"}


def test_reasoning_then_content():
    msg = both("Let me think.\n</think>The answer is 4." + EOS, thinking=True)
    assert (msg.reasoning_content, msg.content, msg.unfinished) == ("Let me think.\n", "The answer is 4.", None)
    assert msg.to_message()["reasoning_content"] == "Let me think.\n"


def test_leading_think_tag_is_not_reasoning():
    assert both("<think>R</think>C", thinking=True).reasoning_content == "R"


@pytest.mark.parametrize("ending", ["", EOS + "ignored"])
def test_unclosed_reasoning_is_reported(ending):
    msg = both("thinking and thinking" + ending, thinking=True)
    assert (msg.reasoning_content, msg.content, msg.unfinished) == ("thinking and thinking", "", "reasoning")
    assert msg.finish_reason("length") == "length"
    assert msg.finish_reason("stop") == "stop"


def test_text_after_eos_is_ignored():
    assert both("done" + EOS + "more text" + BLOCK, thinking=False).content == "done"


def test_tool_call():
    msg = both("R</think>Let me check." + BLOCK + EOS, thinking=True)
    assert msg.content == "Let me check." and msg.reasoning_content == "R"
    assert msg.tool_calls == [{"id": "call_0", "type": "function",
                               "function": {"name": "get_weather", "arguments": ARGS}}]
    assert msg.finish_reason("stop") == "tool_calls"
    assert msg.to_message()["tool_calls"] == msg.tool_calls


def test_only_tool_calls_gives_null_content():
    msg = both(BLOCK + EOS, thinking=False)
    assert msg.to_message()["content"] is None and len(msg.tool_calls) == 1


def test_tool_call_deltas_have_openai_shape():
    deltas, _ = streamed("Hi" + BLOCK, thinking=False)
    tool_deltas = [d.to_dict()["tool_calls"][0] for d in deltas if d.tool_calls]
    first = tool_deltas[0]
    assert {k: first[k] for k in ("index", "id", "type")} == {"index": 0, "id": "call_0", "type": "function"}
    assert first["function"]["name"] == "get_weather"
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
               for d in tool_deltas[1:])
    assert "".join(d["function"]["arguments"] for d in tool_deltas) == ARGS
    assert Delta(content="x").to_dict() == {"content": "x"}


def test_calls_across_blocks_are_numbered_and_text_after_a_block_is_content():
    msg = both(BLOCK + "between" + BLOCK, thinking=False)
    assert [c["id"] for c in msg.tool_calls] == ["call_0", "call_1"]
    assert msg.content == "between"


def test_block_inside_reasoning_ends_reasoning():
    msg = both("planning" + BLOCK + EOS, thinking=True)
    assert (msg.reasoning_content, msg.content, len(msg.tool_calls), msg.unfinished) == ("planning", "", 1, None)


@pytest.mark.parametrize("text", ["Hi\n\n", "a <", "x\n", "ends with <｜end"])
def test_held_back_text_is_flushed_at_the_end(text):
    assert both(text, thinking=False).content == text


@pytest.mark.parametrize("thinking", [True, False])
def test_cut_off_block_never_leaks_markup(thinking):
    head = "R</think>Hi" if thinking else "Hi"
    full = head + BLOCK
    invoke_at, header_end = full.index("<｜DSML｜invoke"), full.index('">\n', full.index("invoke")) + 2
    invoke_end = full.index("</｜DSML｜invoke>") + len("</｜DSML｜invoke>")
    for cut in range(len(head), len(full)):
        msg = both(full[:cut], thinking)
        assert msg.content in ("Hi", "Hi\n", "Hi\n\n", "Hi\n\n<"), cut
        assert "｜" not in msg.content and "｜" not in (msg.reasoning_content or "")
        # Only a closed invoke is a call; one cut inside is unfinished, its streamed
        # arguments a prefix of the real ones.
        assert [c["function"]["arguments"] for c in msg.tool_calls] == ([ARGS] if cut >= invoke_end else []), cut
        assert len(msg.cut_calls) == (header_end <= cut < invoke_end), cut
        if msg.cut_calls:
            assert ARGS.startswith(msg.cut_calls[0]["function"]["arguments"]), cut
        if invoke_at < cut < invoke_end:
            assert msg.unfinished == "tool_calls" and msg.finish_reason("stop") == "stop", cut


def test_eos_inside_a_block_cuts_it():
    text = BLOCK[:BLOCK.index("Paris") + 3] + EOS + "ignored"
    msg = both(text, thinking=False)
    assert (msg.unfinished, msg.tool_calls) == ("tool_calls", [])
    assert msg.cut_calls[0]["function"]["arguments"] == '{"city": "Par'
    assert msg.finish_reason("stop") == "stop" and msg.finish_reason("length") == "length"


def test_tools_disabled_drops_the_block():
    deltas, msg = streamed("Let me check." + BLOCK + EOS, thinking=False, tools=False)
    assert (msg.content, msg.tool_calls, msg.unfinished) == ("Let me check.", [], None)
    assert not any(d.tool_calls for d in deltas)
    assert msg.finish_reason("stop") == "stop"


# Markup the reference parser rejects: each is read as far as it goes, and none of it
# reaches the content (dsv4's rule; the reference raises, it never returns such text).
ODD_MARKUP = [  # (block, the calls' arguments)
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜oops>\n</｜DSML｜tool_calls>', []),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="maybe">1'
     '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', ['{"a": 1}']),
    ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f\nx">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', []),
    ('\n\n<｜DSML｜tool_calls><｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>', ["{}"]),
]


@pytest.mark.parametrize("block,arguments", ODD_MARKUP)
def test_odd_markup_never_reaches_content(block, arguments):
    msg = both("Hi" + block + EOS, thinking=False)
    assert (msg.content, [c["function"]["arguments"] for c in msg.tool_calls]) == ("Hi", arguments)


def test_a_damaged_invoke_after_a_good_one_keeps_the_call():
    bad = '\n<｜DSML｜invok3 name="x">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    msg = both(BLOCK[:-len("\n</｜DSML｜tool_calls>")] + bad, thinking=False)
    assert [c["function"]["arguments"] for c in msg.tool_calls] == [ARGS]
    assert msg.content == ""


def test_repeated_parameter_keeps_the_first_value_and_leaks_nothing():
    block = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
             '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="a" string="false">2</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    msg = both(block, thinking=False)
    assert (msg.content, msg.tool_calls[0]["function"]["arguments"]) == ("", '{"a": 1}')


def test_random_corruption_never_raises_and_stream_equals_whole():
    rng = random.Random(3)
    base = "R</think>Some content." + BLOCK + BLOCK.replace("Paris", "Rome") + EOS
    alphabet = list('<>/"\n=｜ DSMLtoolinvkeparm') + ["</think>", EOS, "<｜DSML｜"]
    for _ in range(300):
        text = list(base)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(text))
            op = rng.choice(["insert", "delete", "replace"])
            if op == "delete":
                del text[at]
            else:
                text[at:at + (op == "replace")] = [rng.choice(alphabet)]
        text = "".join(text)
        for thinking, tools in [(True, True), (False, True), (True, False)]:
            whole = parse_completion(text, thinking=thinking, tools_enabled=tools, id_factory=ids())
            assert streamed(text, thinking, tools, size=rng.randrange(1, 9))[1] == whole


def test_random_variants_keep_markup_out_and_stream_equals_whole():
    """Fuzz with the pieces real output varies in (bare or damaged wrappers, self-closing
    invokes, missing close tags, compact layout): no chunking changes the message, and no
    tag, think marker or EOS ever reaches content or reasoning."""
    rng = random.Random(11)
    pieces = ["<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "<｜DSML｜toolcalls>", '<｜DSML｜invoke name="f">',
              '<｜DSML｜invoke name="g"/>', "</｜DSML｜invoke>", '<｜DSML｜parameter name="a" string="true">',
              '<｜DSML｜parameter name="b" string="false">', "<｜DSML｜parameter name='c'>", "</｜DSML｜parameter>",
              "<think>", "</think>", EOS, "\n", "\n\n", " ", "x", "42", '{"k": [1]}', "<", ">", "/", '"', "｜", "｜DSML｜"]
    markup = ("｜DSML｜", EOS, "<think>", "</think>")
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 25)))
        for thinking in (True, False):
            whole = parse_completion(text, thinking=thinking, id_factory=ids())
            assert streamed(text, thinking, size=rng.randrange(1, 9))[1] == whole, text
            assert streamed(text, thinking, size=1)[1] == whole, text
            for channel in (whole.content, whole.reasoning_content or ""):
                assert not any(m in channel for m in markup), (text, channel)
            for call in whole.tool_calls:
                json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("text,calls", [
    # Variants seen in agents' DSML recovery code: a "｜" before the wrapper's ">", no
    # string="..." flag (JSON when it parses), single quotes, extra spaces.
    ('<｜DSML｜tool_calls｜><｜DSML｜invoke name="read"><｜DSML｜parameter name="path">/a</｜DSML｜parameter>'
     '<｜DSML｜parameter name="limit">20</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls｜>',
     [("read", {"path": "/a", "limit": 20})]),
    ("<｜DSML｜tool_calls>\n<｜DSML｜invoke  name='glob' >\n<｜DSML｜parameter name='pattern'  string='true'>**/*.ts"
     "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>", [("glob", {"pattern": "**/*.ts"})]),
])
def test_attribute_variants(text, calls):
    msg = both(text + EOS, thinking=False)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls] == calls
    assert msg.content == ""


@pytest.mark.parametrize("schema", [{"type": "array"}, {"anyOf": 5}, {"oneOf": "ab"}], ids=str)
def test_a_value_too_deep_to_parse_stays_text_and_odd_schemas_type_nothing(schema):
    """Output a constraint can force: a parameter nested deeper than `json` parses (it was a
    RecursionError 500 after the whole generation); a request's schema whose anyOf is no list
    (a TypeError 500 once the model wrote a call)."""
    deep = "[" * 5000 + "]" * 5000
    text = BLOCK.replace('"true">Paris', f'"false">{deep}') + EOS
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": schema, "days": schema}}}}]
    whole = parse_completion(text, thinking=False, tools=tools, id_factory=ids())
    assert json.loads(whole.tool_calls[0]["function"]["arguments"]) == {"city": deep, "days": 3}
