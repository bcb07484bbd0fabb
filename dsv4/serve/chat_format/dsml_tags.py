"""Reading one DSML tag out of model output, tolerantly (see docs/architecture.md, "Chat
format"): the canonical tags of dsml.py and the variants models emit.

A tag starts at `<｜DSML｜` or `</｜DSML｜` and has the form `<｜DSML｜word attr="v" ...>` (or
`.../>`, self-closing). A tag whose attributes do not parse is *damaged*
(`<｜DSML｜toolcalls>`, `<｜DSML｜tool_calls...`, `<｜DSML｜ SugarPanel>`): it ends at its
first `>` (included) or newline (left in place), whatever comes first. A tag missing its
`>` ends where the next DSML tag starts. Attribute values are single-line and quoted with
`"` or `'`.

`read_tag` is chunk-invariant: it answers None (wait for more text) exactly while more
text could change the answer, unless `final` says no more text will come.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dsv4.text.tokens import DSML

OPEN_MARK = f"<{DSML}"
CLOSE_MARK = f"</{DSML}"
MARKS = (OPEN_MARK, CLOSE_MARK)
MAX_TAG = 1024   # a tag with no end within this many characters ends there

_WORD = re.compile(r"[A-Za-z_]*")
_ATTR = re.compile(r"""([A-Za-z_][A-Za-z_0-9-]*)[ \t]*=[ \t]*("[^"\n]*"|'[^'\n]*')""")
_ATTR_START = re.compile(r"""[A-Za-z_][A-Za-z_0-9-]*[ \t]*(=[ \t]*(["'][^\n]*)?)?""")


@dataclass
class Tag:
    closing: bool                 # </｜DSML｜...>
    word: str                     # "tool_calls", "invoke", "parameter", or what a damaged tag has
    attrs: dict[str, str] = field(default_factory=dict)
    self_closing: bool = False    # <... />
    damaged: bool = False
    cut: bool = False             # ended by the end of output, not by its own end
    end: int = 0                  # index in the buffer right after the tag

    @property
    def kind(self) -> str:
        """"invoke", "parameter" or "wrapper" (any other word: the block's wrapper)."""
        word = self.word.lower()
        return word if word in ("invoke", "parameter") else "wrapper"


def mark_at(buf: str, pos: int) -> str | None:
    """The DSML mark `buf` has at `pos`, else None."""
    return next((m for m in MARKS if buf.startswith(m, pos)), None)


def may_be_mark(buf: str, pos: int) -> bool:
    """Whether buf[pos:] (shorter than a mark) may still become one."""
    rest = buf[pos:]
    return any(m.startswith(rest) and len(rest) < len(m) for m in MARKS)


def read_tag(buf: str, pos: int, final: bool) -> Tag | None:
    """The tag whose mark starts at `pos` (mark_at(buf, pos) is not None); None: wait."""
    mark = mark_at(buf, pos)
    at = pos + len(mark)
    word = _WORD.match(buf, at).group()
    at += len(word)
    tag = Tag(closing=mark == CLOSE_MARK, word=word)
    limit = pos + MAX_TAG
    while True:
        while at < len(buf) and buf[at] in " \t":
            at += 1
        if at >= min(len(buf), limit):
            if at < limit and not final:
                return None
            tag.cut = at < limit
            return _ended(tag, min(len(buf), limit))
        if buf.startswith("/>", at) or buf[at] == ">":
            tag.self_closing = buf[at] == "/"
            return _ended(tag, at + (2 if tag.self_closing else 1))
        if buf[at] == "/" and at + 1 == len(buf) and not final:
            return None
        if mark_at(buf, at):                       # no ">": the next tag starts here
            return _ended(tag, at)
        if buf[at] == "<" and may_be_mark(buf, at) and not final:
            return None
        attr = _ATTR.match(buf, at)
        if attr and attr.end() <= limit:
            tag.attrs.setdefault(attr.group(1).lower(), attr.group(2)[1:-1])
            at = attr.end()
            continue
        partial = _ATTR_START.match(buf, at)
        if partial and partial.end() == len(buf) and len(buf) < limit and not final:
            return None                            # an attribute still arriving
        return _damaged(tag, buf, at, limit, final)


def _ended(tag: Tag, end: int) -> Tag:
    tag.end = end
    return tag


def _damaged(tag: Tag, buf: str, at: int, limit: int, final: bool) -> Tag | None:
    """A tag that does not parse ends at its first `>` (included) or newline (excluded)."""
    tag.damaged = True
    for i in range(at, min(len(buf), limit)):
        if buf[i] == ">":
            return _ended(tag, i + 1)
        if buf[i] == "\n":
            return _ended(tag, i)
    if len(buf) >= limit or final:
        tag.cut = len(buf) < limit
        return _ended(tag, min(len(buf), limit))
    return None
