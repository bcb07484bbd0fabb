"""`POST /v1/chat/completions`: whole responses and SSE streams.

Each choice turns engine tokens into text (`TextStream`), the text into reasoning, content
and tool-call deltas (`OutputParser`), and carries its logprobs; a stream sends a role
chunk per choice first, the finish_reason on each choice's last chunk, then the usage chunk
when `stream_options.include_usage`, then `[DONE]`.
"""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from .chat_prompt import ChatPlan, plan_chat
from ...engine.ipc import TokenOutput
from ..chat_format.parsers import Delta, OutputParser, ParsedMessage
from .protocol import ChatCompletionRequest, parse_body
from .state import ServerState
from .streaming import DONE, RequestError, Usage, answer, guarded, outputs, respond_whole, sse, sse_error
from .textstream import TextStream, TokenTexts, chat_logprobs


class ChatChoice:
    def __init__(self, index: int, plan: ChatPlan, state: ServerState, texts: TokenTexts):
        self.index, self.top, self.texts = index, plan.top_logprobs, texts
        self.text = TextStream(state.tokenizer, plan.prompt_ids, plan.params[index])
        self.parser = OutputParser(plan.thinking, plan.tools_enabled, tools=plan.tools, start=plan.start)
        self.initial = self.parser.feed(plan.prefill) if plan.prefill else []
        self.num_tokens = 0
        self.logprobs: list[dict] = []
        self._unsent_logprobs: list[dict] = []
        self.message: ParsedMessage | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def update(self, out: TokenOutput) -> list[dict]:
        """Consume one engine output; return the stream choices it produces."""
        self.num_tokens += len(out.token_ids)
        if self.top is not None and out.logprobs:
            items = chat_logprobs(out.logprobs, self.top, self.texts)
            self.logprobs += items
            self._unsent_logprobs += items
        released = self.text.push(out)
        deltas = self.parser.feed(released) if released else []
        if out.finished:
            more, self.message = self.parser.finish()
            deltas += more
            self.finish_reason = self.message.finish_reason(out.finish_reason)
            self.stop_reason = out.stop_reason
        return self._stream_choices(deltas, out.finished)

    def _stream_choices(self, deltas: list[Delta], finished: bool) -> list[dict]:
        choices = [self.delta_choice(d.to_dict()) for d in deltas]
        if finished and not choices:
            choices.append(self.delta_choice({}))
        if choices and self._unsent_logprobs:
            choices[0]["logprobs"] = {"content": self._unsent_logprobs}
            self._unsent_logprobs = []
        if finished:
            choices[-1].update(finish_reason=self.finish_reason, stop_reason=self.stop_reason)
        return choices

    def delta_choice(self, delta: dict) -> dict:
        return {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}

    def role_choice(self) -> dict:
        return self.delta_choice({"role": "assistant", "content": ""})

    def whole(self) -> dict:
        return {"index": self.index, "message": self.message.to_message(),
                "logprobs": {"content": self.logprobs} if self.top is not None else None,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    req = parse_body(await request.body(), ChatCompletionRequest)
    plan = plan_chat(req, state)
    rid = "chatcmpl-" + request.headers.get("x-request-id", uuid.uuid4().hex)
    head = {"id": rid, "created": int(time.time()), "model": plan.model}
    texts = TokenTexts(state.tokenizer)
    choices = [ChatChoice(i, plan, state, texts) for i in range(req.n)]
    group = state.client.submit([plan.prompt_ids] * req.n, plan.params, uuid.uuid4().hex)
    tracker = state.metrics.track(req.n, len(plan.prompt_ids))
    usage = Usage(len(plan.prompt_ids), choices, group)
    return await answer(request, group, tracker, rid, lambda: respond_whole(group, tracker, head, choices, usage,
                                                                  {"object": "chat.completion"}),
                        (lambda: _stream(group, tracker, head, choices, usage, req.include_usage))
                        if req.stream else None)


async def _stream(group, tracker, head: dict, choices: list[ChatChoice], usage: Usage, include_usage: bool):
    head = {**head, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    try:
        with guarded(group, tracker):
            for c in choices:
                yield sse({**head, "choices": [c.role_choice()], **extra})
                for delta in c.initial:
                    yield sse({**head, "choices": [c.delta_choice(delta.to_dict())], **extra})
            async for index, out in outputs(group, tracker):
                for choice in choices[index].update(out):
                    yield sse({**head, "choices": [choice], **extra})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage.to_dict()})
    except RequestError as e:
        yield sse_error(e)
    yield DONE
