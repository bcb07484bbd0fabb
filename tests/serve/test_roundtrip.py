"""Encode an assistant message with the encoder, parse the completion back: same message.

The completion text is what `encode_messages` puts after the generation prompt of the turn
before it, i.e. exactly what the model is trained to generate.
"""

import json
import random

import pytest

from dsv4.serve.chat_format.encoding import encode_messages
from dsv4.serve.chat_format.parsers import OutputParser, parse_completion

_PIECES = (list("abcdefgh xyz XYZ 0123 .,;:!?-_=+*/\\'\"(){}[]<>&%$#@") + ["\n", "\n\n", "\t"]
           + list("éüßñ中文字日本語한국") + ["🎉", "🚀", "👍🏽", "—"])
_MARKERS = ("<think>", "</think>")


def rand_text(rng: random.Random, max_len: int) -> str:
    while True:
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randrange(max_len + 1)))
        if not any(m in text for m in _MARKERS):
            return text


def rand_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "multiline", "int", "float", "bool", "null", "list", "dict"])
    if kind == "str":
        return rand_text(rng, 12)
    if kind == "multiline":
        return "\n".join(rand_text(rng, 8) for _ in range(rng.randrange(2, 4)))
    if kind == "int":
        return rng.randrange(-10**6, 10**6)
    if kind == "float":
        return rng.choice([1.5, -0.25, 3.14159, 1e-07, 2.5e+20])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if depth >= 2:
        return rand_text(rng, 6)
    if kind == "list":
        return [rand_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{i}{rand_text(rng, 3)}".replace('"', ""): rand_value(rng, depth + 1)
            for i in range(rng.randrange(3))}


def rand_key(rng: random.Random, i: int) -> str:
    return rng.choice(["city", "path", "query", "n", "données", "名字", "flag_x"]) + str(i)


def rand_message(rng: random.Random, thinking: bool) -> dict:
    message = {"role": "assistant", "content": rand_text(rng, 40)}
    if thinking:
        message["reasoning_content"] = rand_text(rng, 60)
    calls = []
    for c in range(rng.randrange(4)):
        args = {rand_key(rng, i): rand_value(rng) for i in range(rng.randrange(4))}
        calls.append({"id": f"call{c}", "type": "function", "function": {
            "name": rng.choice(["get_weather", "search", "write_file", "工具"]),
            "arguments": json.dumps(args, ensure_ascii=False)}})
    if calls:
        message["tool_calls"] = calls
    return message


def completion_of(message: dict, thinking: bool) -> str:
    """The text after the generation prompt: encode [user, message] minus encode [user]."""
    user = [{"role": "user", "content": "Go."}]
    prompt = encode_messages(user, thinking=thinking)
    full = encode_messages(user + [message], thinking=thinking)
    assert full.startswith(prompt)
    return full[len(prompt):]


def assert_same_message(parsed, message: dict, thinking: bool) -> None:
    assert parsed.unfinished is None
    assert parsed.content == message["content"]
    assert parsed.reasoning_content == (message["reasoning_content"] if thinking else None)
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == expected
    for call in parsed.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")


def concat_deltas(deltas) -> dict:
    """Fold OpenAI-style deltas into the message they describe."""
    out = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for delta in deltas:
        d = delta.to_dict()
        out["reasoning_content"] += d.get("reasoning_content", "")
        out["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = out["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None and tc["type"] == "function"
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            call["arguments"] += tc["function"]["arguments"]
    return out


def stream(chunks, thinking: bool):
    parser = OutputParser(thinking=thinking, tools_enabled=True)
    deltas = [d for chunk in chunks for d in parser.feed(chunk)]
    tail, parsed = parser.finish()
    return deltas + tail, parsed


def assert_deltas_match(deltas, parsed) -> None:
    folded = concat_deltas(deltas)
    assert folded["reasoning_content"] == (parsed.reasoning_content or "")
    assert folded["content"] == parsed.content
    assert [folded["tool_calls"][i] for i in sorted(folded["tool_calls"])] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in parsed.tool_calls]


def chunkings(text: str, rng: random.Random, tok):
    yield "chars", list(text)
    detok = tok.detokenizer()
    yield "tokens", [detok.push(i) for i in tok.encode(text)] + [detok.flush()]
    pieces, at = [], 0
    while at < len(text):
        size = rng.randrange(1, 24)
        pieces.append(text[at:at + size])
        at += size
    yield "random", pieces


@pytest.mark.parametrize("thinking", [True, False])
def test_encode_then_parse_gives_back_the_message(thinking, tok):
    rng = random.Random(7 if thinking else 8)
    for _ in range(120):
        message = rand_message(rng, thinking)
        text = completion_of(message, thinking)
        assert_same_message(parse_completion(text, thinking=thinking), message, thinking)
        for _name, chunks in chunkings(text, rng, tok):
            assert "".join(chunks) == text
            deltas, parsed = stream(chunks, thinking)
            assert_same_message(parsed, message, thinking)
            assert_deltas_match(deltas, parsed)


def test_arguments_stream_while_a_value_arrives():
    message = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "write_file", "arguments": json.dumps({"text": "x" * 200})}}]}
    text = completion_of(message, thinking=False)
    parser = OutputParser(thinking=False, tools_enabled=True)
    cut = text.index("x" * 200) + 100  # half of the value has arrived, its close tag has not
    folded = concat_deltas(parser.feed(text[:cut]))
    assert folded["tool_calls"][0]["arguments"] == '{"text": "' + "x" * 100
