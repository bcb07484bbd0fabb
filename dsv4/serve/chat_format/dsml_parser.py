"""An incremental, tolerant parser for DSML tool-call markup (docs/architecture.md, "Chat
format"): from the first `<｜DSML｜` (or `</｜DSML｜`) tag to the end of the block.

It reads the canonical block the reference encoder writes (dsml.py) and what models emit
besides: no `tool_calls` wrapper (bare invokes), damaged wrappers (dsml_tags.py), compact
or indented layout (whitespace between tags is ignored), self-closing invokes, a missing
`</｜DSML｜parameter>` (the value ends at the next parameter, `</｜DSML｜invoke>` or the
wrapper's close), a
missing `</｜DSML｜invoke>` (the invoke ends at the next invoke or the wrapper's close), and
an invoke body given as a JSON object. Stray tags are dropped: markup never becomes text.

States: OUT (between invokes), INVOKE (inside one, between parameters), VALUE (inside a
parameter). The block ends at the wrapper's close tag, or at text outside any invoke (that
text is content again). Events, in `events`: ("start", name) as soon as an invoke's header
is read, ("args", piece) as the arguments JSON grows (arguments.py), ("end",) when it
closes. An invoke cut by the end of output gets no "end".
"""

from __future__ import annotations

from dsv4.serve.chat_format.arguments import ArgumentWriter
from dsv4.serve.chat_format.dsml_tags import MARKS, Tag, mark_at, may_be_mark, read_tag
from dsv4.text.tokens import DSML

OUT, INVOKE, VALUE = "out", "invoke", "value"
PARAM_CLOSE = f"</{DSML}parameter>"
# Where a value ends when its close tag is missing (the text before loses one newline).
_LOOKAHEADS = (f"<{DSML}parameter name=", f"</{DSML}invoke>", f"</{DSML}tool_calls>")
_VALUE_ENDS = (PARAM_CLOSE, *_LOOKAHEADS)
_VALUE_HOLD = (*_VALUE_ENDS, *("\n" + end for end in _LOOKAHEADS))
_FLAGS = {"true": True, "false": False}


class DsmlBlockParser:
    def __init__(self, schemas: dict[str, dict] | None = None):
        self.events: list[tuple] = []     # produced since the caller last cleared it
        self._schemas = schemas or {}
        self._state = OUT
        self._writer: ArgumentWriter | None = None
        self._call_open = False           # "start" sent, "end" not yet
        self._after_value = INVOKE        # the state a parameter's value returns to
        self._cut_tag = False             # the end of output came inside a tag

    def feed(self, buf: str, final: bool) -> tuple[int, bool]:
        """Consume a prefix of `buf`; return (chars consumed, whether the block ended).
        `final`: no more text will come (the end of output)."""
        pos = 0
        while True:
            state = self._state
            used, ended = {OUT: self._out, INVOKE: self._invoke, VALUE: self._value}[state](buf, pos, final)
            pos += used
            if ended or (used == 0 and self._state == state):
                return pos, ended

    def cut(self) -> bool:
        """End of output inside the block; True when it came inside an invoke or a tag (an
        open call then stays unfinished: it never gets its "end")."""
        unfinished = self._state != OUT or self._cut_tag
        self._state, self._writer, self._call_open = OUT, None, False
        return unfinished

    # ---- states: each reads buf from pos, returns (chars used, block ended) -----------------
    def _out(self, buf: str, pos: int, final: bool) -> tuple[int, bool]:
        start = pos
        while pos < len(buf) and buf[pos].isspace():
            pos += 1
        if pos < len(buf) and mark_at(buf, pos):
            return self._tag(buf, start, pos, final)
        if pos < len(buf) and may_be_mark(buf, pos):
            if not final:
                return pos - start, False
            self._cut_tag = True                   # a tag cut off by the end of output
            return len(buf) - start, False
        if pos == len(buf):
            return pos - start, False
        return pos - start, True                   # text outside any invoke: content again

    def _invoke(self, buf: str, pos: int, final: bool) -> tuple[int, bool]:
        at = _next_mark(buf, pos)
        if at == pos:
            return self._tag(buf, pos, pos, final)
        end = at if at >= 0 else len(buf) - _held(buf, pos, MARKS)
        self._writer.body_text(buf[pos:end])
        return (len(buf) if final and at < 0 else end) - pos, False

    def _value(self, buf: str, pos: int, final: bool) -> tuple[int, bool]:
        at, end = _earliest(buf, pos, _VALUE_ENDS)
        if end is None:                            # at the end, a partial terminator is dropped
            stop = len(buf) - _held(buf, pos, _VALUE_HOLD)
            self._writer.value(buf[pos:stop])
            return (len(buf) if final else stop) - pos, False
        text = buf[pos:at]
        if end != PARAM_CLOSE and text.endswith("\n"):
            text = text[:-1]
        self._writer.value(text)
        self._writer.close_param()
        self._state = self._after_value
        return at - pos + (len(end) if end == PARAM_CLOSE else 0), False

    # ---- tags --------------------------------------------------------------------------------
    def _tag(self, buf: str, start: int, pos: int, final: bool) -> tuple[int, bool]:
        tag = read_tag(buf, pos, final)
        if tag is None:
            return pos - start, False
        used = tag.end - start
        if tag.cut:                                # never completed: no effect, and unfinished
            self._cut_tag = True
            return used, False
        if tag.kind == "invoke":
            return used, self._on_invoke(tag)
        if tag.kind == "parameter":
            if not tag.closing:
                self._open_param(tag)
            return used, False
        if tag.closing:                            # the wrapper's close ends the block
            self._end_call()
            return used, True
        return used, False                         # a wrapper's open (damaged or not)

    def _on_invoke(self, tag: Tag) -> bool:
        self._end_call()
        if tag.closing:
            return False
        name = tag.attrs.get("name") or None       # an invoke without a name is read, then dropped
        emit = self._emit_args if name else _ignore
        self._writer = ArgumentWriter(name or "(unnamed)", self._schemas.get(name), emit)
        if name:
            self.events.append(("start", name))
            self._call_open = True
        self._state = INVOKE
        if tag.self_closing:
            self._end_call()
        return False

    def _open_param(self, tag: Tag) -> None:
        if self._state == OUT:                     # a parameter outside any invoke: dropped
            self._writer = ArgumentWriter("(none)", None, _ignore)
        self._after_value = self._state
        self._writer.open_param(tag.attrs.get("name"), _FLAGS.get(tag.attrs.get("string", "").lower()))
        self._state = VALUE
        if tag.self_closing:
            self._writer.close_param()
            self._state = self._after_value

    def _end_call(self) -> None:
        if self._state == VALUE:
            self._writer.close_param()
        if self._writer is not None and self._state != OUT:
            self._writer.close()
            if self._call_open:
                self.events.append(("end",))
        self._state, self._writer, self._call_open = OUT, None, False

    def _emit_args(self, piece: str) -> None:
        self.events.append(("args", piece))


def _ignore(piece: str) -> None:
    pass


def _next_mark(buf: str, pos: int) -> int:
    found = [i for i in (buf.find(m, pos) for m in MARKS) if i >= 0]
    return min(found) if found else -1


def _earliest(buf: str, pos: int, ends: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(buf), None
    for end in ends:
        at = buf.find(end, pos)
        if 0 <= at < best:
            best, found = at, end
    return best, found


def _held(buf: str, pos: int, markers: tuple[str, ...]) -> int:
    return max(held_tail(buf, m, pos) for m in markers)


def held_tail(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of `marker`: text
    that must wait, since the next characters may complete the marker."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
