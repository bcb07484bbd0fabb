"""An incremental parser for one DSML tool-call block (the text after `<｜DSML｜tool_calls>`).

It reads the canonical form the reference encoder writes (see dsml.py), which is what the
reference parser (`parse_tool_calls` in encoding_dsv4.py) reads, and turns it into events as
early as the text allows: ("start", name) once an invoke's header and its first parameter's
header (or its close tag) are valid; ("args", text) pieces of the OpenAI arguments JSON, a
parameter's value streaming as it arrives; ("end",) when the invoke closes. The pieces of one
invoke concatenate to the reference's decode_dsml_to_arguments: `{"k": <value>, ...}`, where
a string="true" value becomes a JSON string and a string="false" value is spliced in raw.

Invariant: `raw` is the consumed text not yet reflected in an event (since the last complete
header or close tag); when the block turns out malformed the caller gives it back as text,
and an invoke already started is closed with the parameters it has (valid JSON).
"""

from __future__ import annotations

from dsv4.serve.chat_format.dsml import (BLOCK_CLOSE, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN,
                             to_json)
from dsv4.text.tokens import EOS

_INVOKE_HEADER_END = '">\n'
_PARAM_NAME_END = '" string="'
_FLAGS = {'true">': True, 'false">': False}
_MAX_NAME = 512  # a header longer than this without its terminator is malformed

MORE, CLOSED, MALFORMED = "more", "closed", "malformed"


class _Malformed(Exception):
    pass


class DsmlBlockParser:
    def __init__(self, raw: str):
        self.raw = raw                 # see the module invariant
        self.events: list[tuple] = []  # produced since the caller last cleared it
        self._state = self._between
        self._params: set[str] = set()
        self._pending_name: str | None = None  # an invoke header not yet reported
        self._in_invoke = False                # "start" reported, "end" not yet
        self._is_string = False
        self._accounted = False        # the current step produced an event or closed a tag

    def feed(self, buf: str) -> tuple[int, str]:
        """Consume a prefix of `buf`; return (chars consumed, MORE | CLOSED | MALFORMED)."""
        pos = 0
        try:
            while self._state is not None:
                self._accounted = False
                used = self._state(buf, pos)
                if used == 0:
                    return pos, MORE
                self.raw = "" if self._accounted else self.raw + buf[pos:pos + used]
                pos += used
        except _Malformed:
            if self._in_invoke:
                self._end_invoke()
            return pos, MALFORMED
        return pos, CLOSED

    # Each state reads buf from pos and returns the chars it used (0: wait for more text).

    def _between(self, buf: str, pos: int) -> int:
        found = _match(buf, pos, ("\n" + INVOKE_OPEN, "\n" + BLOCK_CLOSE))
        if found is not None:
            self._state = self._invoke_name if INVOKE_OPEN in found else None
        return len(found or "")

    def _invoke_name(self, buf: str, pos: int) -> int:
        name = _read_name(buf, pos, _INVOKE_HEADER_END)
        if name is None:
            return 0
        self._pending_name, self._params = name, set()
        self._state = self._invoke_body
        return len(name) + len(_INVOKE_HEADER_END)

    def _invoke_body(self, buf: str, pos: int) -> int:
        """Right after an invoke header: its first parameter, or (no parameters) its close."""
        found = _match(buf, pos, (PARAM_OPEN, "\n" + INVOKE_CLOSE))
        return self._open_param_or_close(found)

    def _after_param(self, buf: str, pos: int) -> int:
        found = _match(buf, pos, ("\n" + PARAM_OPEN, "\n" + INVOKE_CLOSE))
        return self._open_param_or_close(found)

    def _open_param_or_close(self, found: str | None) -> int:
        if found is None:
            return 0
        if PARAM_OPEN in found:
            self._state = self._param_header
        else:
            self._start_invoke()
            self._end_invoke()
            self._state = self._between
        return len(found)

    def _start_invoke(self) -> None:
        if self._pending_name is not None:
            self._emit("start", self._pending_name)
            self._pending_name, self._in_invoke = None, True

    def _end_invoke(self) -> None:
        self._emit("args", "}" if self._params else "{}")
        self._emit("end")
        self._in_invoke = False

    def _param_header(self, buf: str, pos: int) -> int:
        name = _read_name(buf, pos, _PARAM_NAME_END)
        if name is None:
            return 0
        flag_at = pos + len(name) + len(_PARAM_NAME_END)
        flag = _match(buf, flag_at, tuple(_FLAGS))
        if flag is None:
            return 0
        if name in self._params:
            raise _Malformed  # the reference rejects a repeated parameter name
        self._is_string = _FLAGS[flag]
        self._start_invoke()
        opener = ", " if self._params else "{"
        self._params.add(name)
        self._emit("args", opener + to_json(name) + ": " + ('"' if self._is_string else ""))
        self._state = self._param_value
        return flag_at + len(flag) - pos

    def _param_value(self, buf: str, pos: int) -> int:
        end = buf.find(PARAM_CLOSE, pos)
        if end < 0:
            keep = max(held_tail(buf, PARAM_CLOSE, pos), held_tail(buf, EOS, pos))
            self._emit_value(buf[pos:len(buf) - keep])
            return len(buf) - keep - pos
        self._emit_value(buf[pos:end])
        if self._is_string:
            self._emit("args", '"')
        self._accounted = True
        self._state = self._after_param
        return end + len(PARAM_CLOSE) - pos

    def _emit_value(self, text: str) -> None:
        if text:
            self._emit("args", to_json(text)[1:-1] if self._is_string else text)

    def _emit(self, *event) -> None:
        self.events.append(event)
        self._accounted = True


def _match(buf: str, pos: int, alternatives: tuple[str, ...]) -> str | None:
    """The alternative `buf` continues with at `pos`; None while it may still become one."""
    rest = buf[pos:]
    for alt in alternatives:
        if rest.startswith(alt):
            return alt
    if any(alt.startswith(rest) for alt in alternatives):
        return None
    raise _Malformed


def _read_name(buf: str, pos: int, terminator: str) -> str | None:
    """The name before `terminator`; None while incomplete. Names are single-line."""
    end = buf.find(terminator, pos)
    name = buf[pos:end] if end >= 0 else buf[pos:]
    if "\n" in name or len(name) > _MAX_NAME:
        raise _Malformed
    return name if end >= 0 else None


def held_tail(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of `marker`: text
    that must wait, since the next characters may complete the marker."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
