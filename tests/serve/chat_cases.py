"""Helpers for the ported parser cases: DSML builders, and `parse_all`, which parses one
model output whole, char by char, in fixed and random chunks and per token of the test
tokenizer, and checks that every way gives the same message, that the streamed deltas fold
into it, and that no markup reaches content or reasoning."""
from __future__ import annotations

import itertools
import json
import random

from dsv4.serve.chat_format.parsers import OutputParser, parse_completion

D = "｜DSML｜"
TC_START, TC_END = f"<{D}tool_calls>", f"</{D}tool_calls>"
INV_END, PARAM_END = f"</{D}invoke>", f"</{D}parameter>"
EOS = "<｜end▁of▁sentence｜>"
MARKUP = (D, EOS, "<think>", "</think>")


def param(name: str, value: str, string: str = "true") -> str:
    return f'<{D}parameter name="{name}" string="{string}">{value}{PARAM_END}'


def invoke(name: str, *params: str, sep: str = "\n") -> str:
    """An invoke; `sep` goes after its header and after each parameter (canonical: "\\n")."""
    return f'<{D}invoke name="{name}">{sep}' + "".join(p + sep for p in params) + INV_END


def block(*invokes: str, sep: str = "\n") -> str:
    return f"{TC_START}{sep}" + sep.join(invokes) + f"{sep}{TC_END}"


def tool(name: str, **properties) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties}}}


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _chunkings(text: str, tok):
    yield [text]
    yield list(text)
    for size in (2, 3, 5, 7, 11, 23):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    rng = random.Random(len(text))
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    if tok is not None:
        detok = tok.detokenizer()
        yield [detok.push(i) for i in tok.encode(text)] + [detok.flush()]


def _fold(deltas) -> tuple[str, str, list[tuple[str, str]]]:
    content, reasoning, calls = "", "", {}
    for delta in deltas:
        d = delta.to_dict()
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            name, args = calls.get(tc["index"], ("", ""))
            calls[tc["index"]] = (name + tc["function"].get("name", ""), args + tc["function"]["arguments"])
    return content, reasoning, [calls[i] for i in sorted(calls)]


def parse_all(text: str, *, thinking: bool = False, tools: list[dict] | None = None,
              tools_enabled: bool = True, start: str | None = None, tok=None):
    """The message for `text`, checked to be the same for every chunking (see module doc)."""
    whole = parse_completion(text, thinking=thinking, tools_enabled=tools_enabled, id_factory=_ids(),
                             tools=tools, start=start)
    for chunks in _chunkings(text, tok):
        assert "".join(chunks) == text
        parser = OutputParser(thinking, tools_enabled, _ids(), tools=tools, start=start)
        deltas = [d for chunk in chunks for d in parser.feed(chunk)]
        tail, message = parser.finish()
        assert message == whole, chunks
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls + message.cut_calls]
        assert _fold(deltas + tail) == (message.content, message.reasoning_content or "", calls), chunks
    for channel in (whole.content, whole.reasoning_content or ""):
        assert not any(m in channel for m in MARKUP), channel
    return whole


def calls_of(message) -> list[tuple[str, dict]]:
    """(name, parsed arguments) of the message's complete calls; arguments must be JSON."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.tool_calls]
