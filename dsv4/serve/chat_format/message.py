"""What the output parser produces: OpenAI streaming deltas and the whole assistant message
(docs/architecture.md, "Chat format").

A tool call whose invoke never closed (the output was cut inside it) is *unfinished*: its
streamed deltas went out, but it is not one of the message's `tool_calls`, and the finish
reason is never "tool_calls" for such an output.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable

REASONING, CONTENT = "reasoning", "content"


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
    reasoning_content: str | None = None    # None when thinking is off and none was written
    tool_calls: list[dict] = field(default_factory=list)      # complete calls only
    unfinished: str | None = None           # None, "reasoning" or "tool_calls"
    cut_calls: list[dict] = field(default_factory=list)       # started, never closed

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
        """OpenAI finish_reason: "tool_calls" when the model stopped after complete calls;
        otherwise the engine's ("length" for max_tokens, "stop" for EOS or a stop string)."""
        if engine_reason == "stop" and self.tool_calls and self.unfinished is None:
            return "tool_calls"
        return engine_reason


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class Collector:
    """Accumulates the message and the deltas not yet handed out (adjacent ones merged)."""

    def __init__(self, id_factory: Callable[[], str]):
        self._new_id = id_factory
        self._texts: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        self._calls: list[dict] = []
        self._closed: list[bool] = []
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
            self._closed.append(False)
            self._pending.append(Delta(tool_calls=[{
                "index": len(self._calls) - 1, "id": call["id"], "type": "function",
                "function": {"name": event[1], "arguments": ""}}]))
        elif event[0] == "args":
            self._calls[-1]["function"]["arguments"] += event[1]
            self._add_arguments(len(self._calls) - 1, event[1])
        else:
            self._closed[-1] = True

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
        reasoning = "".join(self._texts[REASONING])
        calls = [{**c, "function": dict(c["function"])} for c in self._calls]
        return ParsedMessage(
            content="".join(self._texts[CONTENT]),
            reasoning_content=reasoning if thinking or reasoning else None,
            tool_calls=[c for c, closed in zip(calls, self._closed) if closed],
            unfinished=unfinished,
            cut_calls=[c for c, closed in zip(calls, self._closed) if not closed])
