"""`POST /v1/chat/completions`: whole responses and SSE streams.

Each choice turns engine tokens into text (`TextStream`), the text into reasoning, content
and tool-call deltas (`OutputParser`), and carries its logprobs; a stream sends a role
chunk per choice first, the finish_reason on each choice's last chunk, then the usage chunk
when `stream_options.include_usage`, then `[DONE]`. `include_reasoning: false` drops the
reasoning from the answer (the model still thinks); vLLM's `prompt_logprobs` come as a
top-level `prompt_logprobs` (whole responses only). Parsing, chat encoding and tokenising
run in a worker thread (`_plan`), so a huge prompt never stalls the event loop.
"""
from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ...sampling_params import MAX_LOGPROBS
from ..client import NotEncodable
from .chat_prompt import ChatPlan, plan_chat
from ...engine.ipc import TokenOutput
from ..chat_format.parsers import Delta, OutputParser, ParsedMessage
from .errors import bad_request
from ...disagg.settings import KV_TRANSFER_HEADER
from .fields import with_header
from .limits import check_batch
from .protocol import ChatCompletionRequest, parse_body
from .state import ServerState
from .streaming import ChunkFormat, Usage, answer, guarded, output_batches, respond_whole, sse, sse_events
from .textstream import TextStream, TokenTexts, chat_logprobs, vllm_prompt_logprobs


class ChatChoice:
    def __init__(self, index: int, plan: ChatPlan, state: ServerState, texts: TokenTexts,
                 include_reasoning: bool = True):
        self.index, self.top, self.texts = index, plan.top_logprobs, texts
        self.include_reasoning = include_reasoning
        self.prompt_logprobs = None       # the engine's entries, with the first output
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
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
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
        if not self.include_reasoning:
            deltas = [dataclasses.replace(d, reasoning_content=None) for d in deltas]
        choices = [self.delta_choice(d.to_dict()) for d in deltas if d.to_dict()]
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
        message = self.message.to_message()
        if not self.include_reasoning:
            message.pop("reasoning_content", None)
        return {"index": self.index, "message": message,
                "logprobs": {"content": self.logprobs} if self.top is not None else None,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}


def _plan(raw: bytes, state: ServerState) -> tuple[ChatCompletionRequest, ChatPlan]:
    """The request checked, encoded, tokenised and planned (runs in a worker thread)."""
    req = parse_body(raw, ChatCompletionRequest, state.limits.strict_api)
    check_batch(1, req.n, state.limits)
    plan = plan_chat(req, state)
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                              "prompt_logprobs")
        if req.stream:
            raise bad_request("prompt_logprobs: not supported with stream (ask for a whole response)",
                              "prompt_logprobs")
        # one prompt for every choice: its logprobs are computed once, by the first
        plan.params[0] = dataclasses.replace(plan.params[0], prompt_logprobs=req.prompt_logprobs)
    return req, plan


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    req, plan = await run_in_threadpool(_plan, await request.body(), state)
    rid = "chatcmpl-" + request.headers.get("x-request-id", uuid.uuid4().hex)
    head = {"id": rid, "created": int(time.time()), "model": plan.model}
    texts = TokenTexts(state.tokenizer)
    choices = [ChatChoice(i, plan, state, texts, req.include_reasoning) for i in range(req.n)]
    try:
        group = state.client.submit([plan.prompt_ids] * req.n, plan.params, uuid.uuid4().hex, images=plan.images,
                                    kv_transfer=request.headers.get(KV_TRANSFER_HEADER))
    except NotEncodable as e:
        raise bad_request(str(e)) from None
    tracker = state.metrics.track(req.n, len(plan.prompt_ids))
    usage = Usage(len(plan.prompt_ids), choices, group)
    extra = _whole_fields(req.prompt_logprobs, choices[0], texts)
    response = await answer(request, group, tracker, rid,
                            lambda: respond_whole(group, tracker, head, choices, usage, extra),
                            (lambda: _stream(group, tracker, head, choices, usage, req.include_usage))
                            if req.stream else None)
    return with_header(response, req.ignored_fields)


def _whole_fields(prompt_top: int | None, first: ChatChoice, texts: TokenTexts):
    """The whole response's fields besides choices and usage (asked once all is in)."""
    def fields() -> dict:
        if prompt_top is None:
            return {"object": "chat.completion"}
        return {"object": "chat.completion",
                "prompt_logprobs": vllm_prompt_logprobs(first.prompt_logprobs or [], prompt_top, texts)}
    return fields


def _stream(group, tracker, head: dict, choices: list[ChatChoice], usage: Usage, include_usage: bool):
    head = {**head, "object": "chat.completion.chunk"}
    chunks = ChunkFormat(head, {"usage": None} if include_usage else {})

    async def events():
        with guarded(group, tracker):
            for c in choices:
                yield chunks.event(c.role_choice())
                for delta in c.initial:
                    yield chunks.event(c.delta_choice(delta.to_dict()))
            async for batch in output_batches(group, tracker):      # one write per batch
                text = "".join([chunks.event(choice) for index, out in batch for choice in choices[index].update(out)])
                if text:
                    yield text
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage.to_dict()})
    return sse_events(events())
