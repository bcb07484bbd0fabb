"""`POST /v1/completions`: a prompt as text or token ids (or a list of either), `n` choices
per prompt (choice index = prompt index * n + i), `echo` (the prompt text, and with
`logprobs` the prompt's logprobs, first the choice's text), legacy-format `logprobs`."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from ...sampling_params import SamplingParams
from .chat_prompt import MAX_N, per_choice
from .errors import bad_request
from ...engine.ipc import TokenOutput
from .protocol import CompletionRequest, check_model, parse_body, resolve_max_tokens, sampling_params
from .state import ServerState
from .streaming import DONE, RequestError, Usage, answer, guarded, outputs, respond_whole, sse, sse_error
from .textstream import LegacyLogprobs, TextStream, TokenTexts

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for completions


@dataclass
class Prompt:
    ids: list[int]
    text: str                 # what echo shows


class CompletionChoice:
    def __init__(self, index: int, prompt: Prompt, params: SamplingParams, echo: bool, state: ServerState,
                 texts: TokenTexts):
        self.index, self.prompt, self.echo = index, prompt, echo
        self.stream = TextStream(state.tokenizer, prompt.ids, params)
        self.logprobs = None if params.logprobs is None else LegacyLogprobs(params.logprobs, texts)
        self.text, self.num_tokens, self.started = "", 0, False
        self.lp_all: dict | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def update(self, out: TokenOutput) -> dict:
        """Consume one engine output; return its stream choice."""
        text, lp = "", None
        if not self.started and self.echo:
            text = self.prompt.text
            if self.logprobs is not None:
                lp = self.logprobs.build(self.prompt.ids, out.prompt_logprobs or [None] * len(self.prompt.ids))
                self.logprobs.offset = len(text)   # generated tokens' offsets follow the echoed text
        self.started = True
        self.num_tokens += len(out.token_ids)
        text += self.stream.push(out)
        if self.logprobs is not None:
            lp = _join(lp, self.logprobs.build(out.token_ids, out.logprobs or []))
            self.lp_all = _join(self.lp_all, lp)
        self.text += text
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return {"index": self.index, "text": text, "logprobs": lp, "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason if out.finished else None}

    def whole(self) -> dict:
        return {"index": self.index, "text": self.text, "logprobs": self.lp_all,
                "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}


def _join(a: dict | None, b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in a}


def _prompts(req: CompletionRequest, state: ServerState) -> list[Prompt]:
    raw = req.prompt
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise bad_request("prompt: must not be empty", "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            ids = ([state.tokenizer.bos_id] if state.add_bos else []) + state.tokenizer.encode(item)
            prompts.append(Prompt(ids, item))
        else:
            bad = [t for t in item if not 0 <= t < state.info.vocab_size]
            if bad:
                raise bad_request(f"prompt: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {state.info.vocab_size})", "prompt")
            prompts.append(Prompt(list(item), state.tokenizer.decode(item, skip_special_tokens=req.skip_special_tokens)))
        if not prompts[-1].ids:
            raise bad_request("prompt: must contain at least one token", "prompt")
    return prompts


async def create_completion(request: Request, state: ServerState) -> Response:
    req = parse_body(await request.body(), CompletionRequest)
    model = check_model(req.model, state.model_names)
    prompts = _prompts(req, state)
    if req.n > MAX_N:
        raise bad_request(f"n: at most {MAX_N} choices per request, got {req.n}", "n")
    info, children, choices = state.info, [], []
    texts = TokenTexts(state.tokenizer)
    for p in prompts:
        max_tokens = resolve_max_tokens(req.max_tokens, len(p.ids), info.max_model_len, info.max_request_tokens,
                                        DEFAULT_MAX_TOKENS, "prompt")
        lp = req.logprobs
        params = sampling_params(req, info.vocab_size, max_tokens, logprobs=lp, skip_special_tokens=req.skip_special_tokens,
                                 prompt_logprobs=lp if req.echo and lp is not None else None)
        for child in per_choice(params):
            choices.append(CompletionChoice(len(choices), p, child, req.echo, state, texts))
            children.append(child)
    rid = "cmpl-" + request.headers.get("x-request-id", uuid.uuid4().hex)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    group = state.client.submit([c.prompt.ids for c in choices], children, uuid.uuid4().hex)
    tracker = state.metrics.track(len(choices), sum(len(p.ids) for p in prompts))
    usage = Usage(sum(len(p.ids) for p in prompts), choices, group,
                  [next(i for i, p in enumerate(prompts) if p is c.prompt) for c in choices])
    return await answer(request, group, tracker, rid, lambda: respond_whole(group, tracker, head, choices, usage),
                        (lambda: _stream(group, tracker, head, choices, usage, req.include_usage))
                        if req.stream else None)


async def _stream(group, tracker, head: dict, choices: list[CompletionChoice], usage: Usage, include_usage: bool):
    extra = {"usage": None} if include_usage else {}
    try:
        with guarded(group, tracker):
            async for index, out in outputs(group, tracker):
                yield sse({**head, "choices": [choices[index].update(out)], **extra})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage.to_dict()})
    except RequestError as e:
        yield sse_error(e)
    yield DONE
