"""Model output -> `reasoning_content`, `content` and OpenAI `tool_calls`, whole or streamed
(docs/architecture.md, "Chat format").

One state machine serves both: `OutputParser.feed` takes text deltas and returns OpenAI-style
deltas; `parse_completion` feeds a whole completion at once; both give the same message for
any chunking. The grammar is the one DeepSeek's reference parser reads
(`parse_message_from_completion_text` in encoding_dsv4.py):

    [reasoning </think>] content [\\n\\n<｜DSML｜tool_calls> ... </｜DSML｜tool_calls>] [EOS]

read tolerantly. States: REASONING (thinking mode, until `</think>`), CONTENT, BLOCK (DSML
markup, see dsml_parser.py), DONE (after EOS). Where the reference raises instead:
  * markup never reaches reasoning or content: text that may be the start of a marker is
    held back until it is known not to be one, any DSML tag opens a block (a block also
    ends reasoning; text after a block is content), and a DSML token outside a tag is
    dropped (the reference rejects it in content);
  * `</think>` in content and `<think>` in reasoning are dropped; `<think>` in content
    opens reasoning again;
  * no `</think>` before the end: the text stays reasoning and `unfinished` is "reasoning"
    (what DeepSeek's API returns in that case);
  * a block with tools disabled (tool_choice "none") is parsed and dropped;
  * the end of output inside a tool call leaves that call unfinished (message.py).
"""

from __future__ import annotations

from typing import Callable

from dsv4.serve.chat_format.dsml_parser import DsmlBlockParser, held_tail
from dsv4.serve.chat_format.dsml_tags import MARKS
from dsv4.serve.chat_format.message import CONTENT, REASONING, Collector, Delta, ParsedMessage, new_call_id
from dsv4.text.tokens import DSML, EOS, THINK_END, THINK_START

__all__ = ["CONTENT", "REASONING", "Delta", "OutputParser", "ParsedMessage", "parse_completion",
           "tool_schemas"]

BLOCK, DONE = "block", "done"
_SEPARATOR = "\n\n"               # what the encoder puts between content and a block
_MARKERS = (*MARKS, DSML, THINK_START, THINK_END, EOS)   # a bare DSML token is markup too
_HELD = (*_MARKERS, *(_SEPARATOR + mark for mark in MARKS))


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """{function name: its parameters schema} of OpenAI-format tools."""
    schemas = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters") or {}
    return schemas


class OutputParser:
    def __init__(self, thinking: bool, tools_enabled: bool,
                 id_factory: Callable[[], str] = new_call_id, *,
                 tools: list[dict] | None = None, start: str | None = None):
        """`start`: REASONING or CONTENT, where the output begins (default: REASONING in
        thinking mode); `tools`: the request's tools, whose schemas type the arguments."""
        self._state = start or (REASONING if thinking else CONTENT)
        self._thinking, self._tools_enabled = thinking, tools_enabled
        self._schemas = tool_schemas(tools)
        self._out = Collector(id_factory)
        self._buf = ""                 # text received but not yet consumed
        self._block: DsmlBlockParser | None = None
        self._unfinished: str | None = None

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        self._run(final=False)
        return self._out.take()

    def finish(self) -> tuple[list[Delta], ParsedMessage]:
        """End of output: flush what was held back and report the message."""
        self._run(final=True)
        if self._state == REASONING:
            self._unfinished = self._unfinished or REASONING
        self._state = DONE
        return self._out.take(), self._out.message(self._thinking, self._unfinished)

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
        at, marker = _earliest(self._buf, _MARKERS)
        if marker is None:
            self._emit_text_until_marker(final)
            return False
        text = self._buf[:at]
        if marker in MARKS:
            self._out.text(self._state, text.removesuffix(_SEPARATOR))
            self._buf = self._buf[at:]
            self._block, self._state = DsmlBlockParser(self._schemas), BLOCK
            return True
        self._out.text(self._state, text)
        self._buf = self._buf[at + len(marker):]
        if marker == EOS:
            self._unfinished = REASONING if self._state == REASONING else self._unfinished
            self._state = DONE
        elif marker != DSML:
            self._state = CONTENT if marker == THINK_END else REASONING
        return True

    def _emit_text_until_marker(self, final: bool) -> None:
        """Emit the buffer except a tail that may begin a marker. At the end the tail is text,
        unless it is a cut-off DSML mark (markup, dropped)."""
        keep = max(held_tail(self._buf, m) for m in _HELD)
        tail = self._buf[len(self._buf) - keep:]
        if final:
            keep = keep if _is_cut_mark(tail) else 0
            self._unfinished = "tool_calls" if keep else self._unfinished
        self._out.text(self._state, self._buf[:len(self._buf) - keep])
        self._buf = "" if final else tail

    def _step_block(self, final: bool) -> bool:
        eos_at = self._buf.find(EOS)
        if eos_at >= 0:
            visible = self._buf[:eos_at]
        else:                          # a partial EOS is not block text either
            visible = self._buf[:len(self._buf) - (0 if final else held_tail(self._buf, EOS))]
        ends_here = final or eos_at >= 0
        used, ended = self._block.feed(visible, ends_here)
        for event in self._block.events:
            if self._tools_enabled:
                self._out.tool_event(event)
        self._block.events.clear()
        self._buf = self._buf[used:]
        if ended:
            self._state, self._block = CONTENT, None
            return True
        if ends_here:                  # the output ended inside the block
            if self._block.cut():
                self._unfinished = "tool_calls"
            self._state, self._block, self._buf = DONE, None, ""
        return False


def parse_completion(text: str, *, thinking: bool, tools_enabled: bool = True,
                     id_factory: Callable[[], str] = new_call_id, tools: list[dict] | None = None,
                     start: str | None = None) -> ParsedMessage:
    """Parse a whole completion with the same state machine the stream uses."""
    parser = OutputParser(thinking, tools_enabled, id_factory, tools=tools, start=start)
    parser.feed(text)
    return parser.finish()[1]


def _earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(text), None
    for marker in markers:
        at = text.find(marker)
        if 0 <= at < best:
            best, found = at, marker
    return best, found


def _is_cut_mark(tail: str) -> bool:
    """A held tail that is a DSML mark cut off by the end of output (at least "<｜"), as
    opposed to ordinary trailing newlines or a lone "<"."""
    body = tail.lstrip("\n")
    return len(body) >= 2 and DSML[0] in body and any(m.startswith(body) for m in MARKS)
