"""Model output -> `reasoning_content`, `content` and OpenAI `tool_calls`, whole or streamed.

One state machine serves both: `OutputParser.feed` takes text deltas and returns OpenAI-style
deltas; `parse_completion` feeds a whole completion at once. The grammar is the one DeepSeek's
reference parser reads (`parse_message_from_completion_text` in encoding_dsv4.py):

    [reasoning </think>] content [\\n\\n<｜DSML｜tool_calls> ... </｜DSML｜tool_calls>] [EOS]

States: REASONING (thinking mode, until `</think>`), CONTENT, BLOCK (inside a DSML block,
see dsml_parser.py), DONE (after EOS). Rules beyond the reference, which raises instead:
  * text that may be the start of a marker is held back until it is known not to be one, so
    markup never reaches reasoning or content;
  * a block also ends reasoning (the model went on to call tools); text after a closed block
    is content again;
  * a block with tools disabled (tool_choice "none") is parsed and dropped;
  * a malformed block gives back its unparsed raw text to the channel it interrupted;
  * at the end, an unclosed `</think>` or block is reported in `ParsedMessage.unfinished`; a
    cut-off block's markup is dropped, and tool calls already started keep what was streamed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable

from dsv4.serve.chat_format.dsml import BLOCK_OPEN, BLOCK_SEPARATOR
from dsv4.serve.chat_format.dsml_parser import CLOSED, MALFORMED, DsmlBlockParser, held_tail
from dsv4.text.tokens import DSML, EOS, THINK_END, THINK_START

REASONING, CONTENT, BLOCK, DONE = "reasoning", "content", "block", "done"
_BLOCK_START = BLOCK_SEPARATOR + BLOCK_OPEN


@dataclass
class Delta:
    """One streaming chunk's delta (OpenAI chat.completion.chunk `choices[0].delta`)."""
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class ParsedMessage:
    content: str = ""
    reasoning_content: str | None = None    # None when thinking is off
    tool_calls: list[dict] = field(default_factory=list)
    unfinished: str | None = None           # None, "reasoning" or "tool_calls"

    def to_message(self) -> dict:
        """The OpenAI assistant message (content null when only tool calls were made)."""
        message: dict = {"role": "assistant",
                         "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI finish_reason: "tool_calls" when the model stopped after complete calls."""
        if engine_reason == "stop" and self.tool_calls and self.unfinished is None:
            return "tool_calls"
        return engine_reason


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class OutputParser:
    def __init__(self, thinking: bool, tools_enabled: bool,
                 id_factory: Callable[[], str] = _new_call_id):
        self._state = REASONING if thinking else CONTENT
        self._thinking, self._tools_enabled = thinking, tools_enabled
        self._out = _Collector(id_factory)
        self._buf = ""                 # text received but not yet consumed
        self._block: DsmlBlockParser | None = None
        self._block_from = CONTENT     # the channel a block interrupted
        self._reasoning_started = False
        self._unfinished: str | None = None

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        self._run(final=False)
        return self._out.take()

    def finish(self) -> tuple[list[Delta], ParsedMessage]:
        """End of output: flush what was held back and report the message."""
        self._run(final=True)
        if self._state == REASONING:
            self._unfinished = "reasoning"
        self._state = DONE
        message = self._out.message(self._thinking, self._unfinished)
        return self._out.take(), message

    def _run(self, final: bool) -> None:
        steps = {REASONING: self._step_text, CONTENT: self._step_text,
                 BLOCK: self._step_block, DONE: self._step_done}
        while steps[self._state](final):
            pass

    def _step_done(self, final: bool) -> bool:
        self._buf = ""                 # nothing after EOS belongs to this message
        return False

    def _step_text(self, final: bool) -> bool:
        """Reasoning or content up to the next marker; False when waiting for more text."""
        if self._state == REASONING and not self._skip_leading_think(final):
            return False
        markers = (THINK_END, BLOCK_OPEN, EOS) if self._state == REASONING else (BLOCK_OPEN, EOS)
        at, marker = _earliest(self._buf, markers)
        if marker is None:
            self._emit_text_until_marker(final)
            return False
        text, rest = self._buf[:at], self._buf[at + len(marker):]
        if marker == BLOCK_OPEN and text.endswith(BLOCK_SEPARATOR):
            text = text[:-len(BLOCK_SEPARATOR)]
        separator = self._buf[len(text):at]
        self._out.text(self._state, text)
        self._buf = rest
        if marker == THINK_END:
            self._state = CONTENT
        elif marker == EOS:
            self._unfinished = "reasoning" if self._state == REASONING else None
            self._state = DONE
        else:
            self._block, self._block_from = DsmlBlockParser(separator + BLOCK_OPEN), self._state
            self._state = BLOCK
        return True

    def _skip_leading_think(self, final: bool) -> bool:
        """Drop a `<think>` at the very start of the reasoning (the prompt normally ends with
        it already); False while the start may still become one."""
        if not self._reasoning_started:
            maybe_tag = len(self._buf) < len(THINK_START) and THINK_START.startswith(self._buf)
            if maybe_tag and not final:
                return False
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START):]
            self._reasoning_started = True
        return True

    def _emit_text_until_marker(self, final: bool) -> None:
        """Emit the buffer except a tail that may begin a marker. At the end the tail is text,
        unless it is a cut-off DSML block start (its markup is dropped)."""
        markers = (_BLOCK_START, BLOCK_OPEN, EOS) + ((THINK_END,) if self._state == REASONING else ())
        keep = max(held_tail(self._buf, m) for m in markers)
        tail = self._buf[len(self._buf) - keep:]
        if final:
            keep = keep if _is_cut_block_start(tail) else 0
            self._unfinished = "tool_calls" if keep else self._unfinished
        self._out.text(self._state, self._buf[:len(self._buf) - keep])
        self._buf = "" if final else tail

    def _step_block(self, final: bool) -> bool:
        eos_at = self._buf.find(EOS)
        if eos_at >= 0:
            visible = self._buf[:eos_at]
        else:                          # a partial EOS is not block text either
            visible = self._buf[:len(self._buf) - (0 if final else held_tail(self._buf, EOS))]
        used, status = self._block.feed(visible)
        for event in self._block.events:
            if self._tools_enabled:
                self._out.tool_event(event)
        self._block.events.clear()
        self._buf = self._buf[used:]
        if status == CLOSED:
            self._state, self._block = CONTENT, None
            return True
        if status == MALFORMED:
            self._out.text(self._block_from, self._block.raw)
            self._state, self._block = self._block_from, None
            return True
        if final or eos_at >= 0:       # cut off: drop the pending markup
            self._state, self._block, self._buf = DONE, None, ""
            self._unfinished = "tool_calls"
        return False


class _Collector:
    """Accumulates the message and the deltas not yet handed out (adjacent ones merged)."""

    def __init__(self, id_factory: Callable[[], str]):
        self._new_id = id_factory
        self._texts: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        self._calls: list[dict] = []
        self._pending: list[Delta] = []

    def text(self, channel: str, text: str) -> None:
        if not text:
            return
        self._texts[channel].append(text)
        key = "reasoning_content" if channel == REASONING else "content"
        last = self._pending[-1] if self._pending else None
        if last is not None and getattr(last, key) is not None:
            setattr(last, key, getattr(last, key) + text)
        else:
            self._pending.append(Delta(**{key: text}))

    def tool_event(self, event: tuple) -> None:
        if event[0] == "start":
            call = {"id": self._new_id(), "type": "function",
                    "function": {"name": event[1], "arguments": ""}}
            self._calls.append(call)
            self._pending.append(Delta(tool_calls=[{
                "index": len(self._calls) - 1, "id": call["id"], "type": "function",
                "function": {"name": event[1], "arguments": ""}}]))
        elif event[0] == "args":
            self._calls[-1]["function"]["arguments"] += event[1]
            self._add_arguments(len(self._calls) - 1, event[1])

    def _add_arguments(self, index: int, text: str) -> None:
        last = self._pending[-1] if self._pending else None
        if last is not None and last.tool_calls and last.tool_calls[-1]["index"] == index:
            last.tool_calls[-1]["function"]["arguments"] += text
        else:
            self._pending.append(Delta(tool_calls=[{"index": index, "function": {"arguments": text}}]))

    def take(self) -> list[Delta]:
        pending, self._pending = self._pending, []
        return pending

    def message(self, thinking: bool, unfinished: str | None) -> ParsedMessage:
        return ParsedMessage(
            content="".join(self._texts[CONTENT]),
            reasoning_content="".join(self._texts[REASONING]) if thinking else None,
            tool_calls=[{**c, "function": dict(c["function"])} for c in self._calls],
            unfinished=unfinished)


def parse_completion(text: str, *, thinking: bool, tools_enabled: bool = True,
                     id_factory: Callable[[], str] = _new_call_id) -> ParsedMessage:
    """Parse a whole completion with the same state machine the stream uses."""
    parser = OutputParser(thinking, tools_enabled, id_factory)
    parser.feed(text)
    return parser.finish()[1]


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(text), None
    for marker in markers:
        at = text.find(marker)
        if 0 <= at < best:
            best, found = at, marker
    return best, found


def _is_cut_block_start(tail: str) -> bool:
    """A held tail that is the start of a DSML block cut off by the end of output (at least
    "<｜"), as opposed to ordinary trailing newlines or a lone "<"."""
    body = tail.lstrip("\n")
    return len(body) >= 2 and BLOCK_OPEN.startswith(body) and body[1] == DSML[0]
