"""Streaming detokenization: token ids in, text deltas out.

Each step decodes only a short window of recent ids, never the whole sequence. Invariants:
  * `_ids[:_read]` has been emitted (as far as it lies past the prompt), and the decoded text
    of `_ids[_prefix:_read]` ends on a whole character;
  * a step whose window text ends in U+FFFD (an incomplete UTF-8 sequence) emits nothing and
    waits for the next token, so a multi-byte character is never split;
  * concatenating every `push` result and the final `flush` gives `decode(all pushed ids)`.
"""

from __future__ import annotations

from typing import Callable, Sequence

# Prompt ids kept as left context, so the first generated token decodes as it would mid-text.
_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[..., str], prompt_ids: Sequence[int],
                 skip_special_tokens: bool = False):
        self._decode = decode
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0            # start of the decode window
        self._read = len(self._ids)  # ids before this are already emitted (or are prompt)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text it completes ("" if none yet)."""
        self._ids.append(token_id)
        return self._step(final=False)

    def flush(self) -> str:
        """Emit what is still held back (an incomplete character at the very end)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        before = self._text(self._prefix, self._read)
        after = self._text(self._prefix, len(self._ids))
        if after.endswith(_REPLACEMENT) and not final:
            return ""
        return self._advance(after[len(before):])

    def _advance(self, delta: str) -> str:
        # Drop ids left of the new window so memory stays bounded on long generations.
        self._ids = self._ids[self._read:]
        self._prefix, self._read = 0, len(self._ids)
        return delta

    def _text(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._decode(self._ids[start:end], skip_special_tokens=self._skip)
