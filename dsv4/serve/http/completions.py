"""`POST /v1/completions`: a prompt as text or token ids (or a list of either), `n` choices
per prompt (choice index = prompt index * n + i), `echo` (the prompt text, and with
`logprobs` the prompt's logprobs, first the choice's text), legacy-format `logprobs`,
vLLM's `prompt_logprobs`. `max_tokens: 0` with `echo` scores the prompt: the engine runs
one step for the prompt's logprobs and the token it samples is dropped.

Parsing, tokenising and planning run in a worker thread (`plan_completion`), so a huge
prompt never stalls the event loop.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ...sampling_params import MAX_LOGPROBS, SamplingParams
from ..client import NotEncodable
from .chat_prompt import MAX_N, per_choice
from .errors import bad_request
from ...engine.ipc import TokenOutput
from ...disagg.settings import KV_TRANSFER_HEADER
from .fields import with_header
from .limits import check_batch
from .protocol import CompletionRequest, check_model, parse_body, resolve_max_tokens, sampling_params
from .state import ServerState
from .structured import request_constraint
from .streaming import ChunkFormat, Usage, answer, guarded, output_batches, respond_whole, sse, sse_events
from .textstream import LegacyLogprobs, TextStream, TokenTexts, prompt_offsets, vllm_prompt_logprobs

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for completions
PLAIN_CHOICE = ("index", "text", "logprobs", "finish_reason", "stop_reason")    # CompletionChoice.update's keys


@dataclass
class Prompt:
    ids: list[int]
    text: str                              # what echo shows ("" for token ids without echo)
    offsets: list[int] | None = None       # each token's place in `text` (echo with logprobs)


class CompletionChoice:
    def __init__(self, index: int, prompt: Prompt, params: SamplingParams, req: CompletionRequest,
                 state: ServerState, texts: TokenTexts, score_only: bool):
        self.index, self.prompt, self.echo, self.score_only = index, prompt, req.echo, score_only
        self.stream = TextStream(state.tokenizer, prompt.ids, params)
        self.logprobs = None if params.logprobs is None else LegacyLogprobs(params.logprobs, texts)
        self.prompt_top, self.texts = req.prompt_logprobs, texts
        self.text, self.num_tokens, self.started = "", 0, False
        self.lp_all: dict | None = None
        self.prompt_logprobs: list | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def update(self, out: TokenOutput) -> dict:
        """Consume one engine output; return its stream choice."""
        text, lp, first = "", None, not self.started
        if first and self.echo:
            text = self.prompt.text
            if self.logprobs is not None:
                entries = out.prompt_logprobs or [None] * len(self.prompt.ids)
                lp = self.logprobs.build(self.prompt.ids, entries, self.prompt.offsets)
                self.logprobs.offset = len(text)   # generated tokens' offsets follow the echoed text
        if first and self.prompt_top is not None:
            self.prompt_logprobs = vllm_prompt_logprobs(out.prompt_logprobs or [], self.prompt_top, self.texts)
        self.started = True
        if not self.score_only:
            self.num_tokens += len(out.token_ids)
            text += self.stream.push(out)
            if self.logprobs is not None:
                lp = _join(lp, self.logprobs.build(out.token_ids, out.logprobs or []))
        if self.logprobs is not None and lp is not None:
            if self.lp_all is None:
                self.lp_all = {k: list(v) for k, v in lp.items()}
            else:                                       # (in place: a new list per output was quadratic)
                for k, v in lp.items():
                    self.lp_all[k].extend(v)
        self.text += text
        if out.finished:
            self.finish_reason = "length" if self.score_only else out.finish_reason
            self.stop_reason = None if self.score_only else out.stop_reason
        choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": self.finish_reason,
                  "stop_reason": self.stop_reason if out.finished else None}
        if first and self.prompt_top is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs
        return choice

    def whole(self) -> dict:
        choice = {"index": self.index, "text": self.text, "logprobs": self.lp_all,
                  "finish_reason": self.finish_reason, "stop_reason": self.stop_reason}
        if self.prompt_top is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs
        return choice


def _join(a: dict | None, b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in a}


@dataclass
class CompletionPlan:
    req: CompletionRequest
    model: str
    prompts: list[Prompt]
    choices: list[CompletionChoice] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)     # one per choice


def _prompts(req: CompletionRequest, state: ServerState) -> list[Prompt]:
    raw = req.prompt
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise bad_request("prompt: must not be empty", "prompt")
    check_batch(len(items), req.n, state.limits)
    want_offsets = req.echo and req.logprobs is not None
    prompts = []
    for item in items:
        if isinstance(item, str):
            if state.surely_too_long(item):
                raise bad_request(f"prompt: {len(item)} characters are more tokens than this model's context "
                                  f"of {min(state.info.max_model_len, state.info.max_request_tokens)} tokens",
                                  "prompt")
            bos = [state.tokenizer.bos_id] if state.add_bos else []
            prompt = Prompt(bos + state.tokenizer.encode(item), item)
        else:
            bad = [t for t in item if not 0 <= t < state.info.vocab_size]
            if bad:
                raise bad_request(f"prompt: token id {bad[0]} is outside the vocabulary "
                                  f"[0, {state.info.vocab_size})", "prompt")
            text = state.tokenizer.decode(item, skip_special_tokens=req.skip_special_tokens) if req.echo else ""
            prompt = Prompt(list(item), text)       # (the text only echo shows: not decoded without it)
            bos = []
        if not prompt.ids:
            raise bad_request("prompt: must contain at least one token", "prompt")
        if want_offsets:
            prompt.offsets = prompt_offsets(state.tokenizer, prompt.ids, req.skip_special_tokens, bool(bos),
                                            len(prompt.text))
        prompts.append(prompt)
    return prompts


def _check_request(req: CompletionRequest) -> bool:
    """Checks of fields this endpoint only accepts in part; True for prompt scoring."""
    if req.best_of is not None and req.best_of != 1:
        raise bad_request("best_of: only 1 is supported (return n samples with n instead)", "best_of")
    if req.suffix:
        raise bad_request("suffix: not supported (this server has no fill-in-the-middle mode)", "suffix")
    if req.n > MAX_N:
        raise bad_request(f"n: at most {MAX_N} choices per request, got {req.n}", "n")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                          "prompt_logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens: must be >= 1 (0 only with echo, to score the prompt)", "max_tokens")
    return req.max_tokens == 0


def plan_completion(raw: bytes, state: ServerState) -> CompletionPlan:
    """The whole request checked, tokenised and planned (runs in a worker thread)."""
    req = parse_body(raw, CompletionRequest, state.limits.strict_api)
    plan = CompletionPlan(req, check_model(req.model, state.model_names), [])
    score_only = _check_request(req)
    plan.prompts = _prompts(req, state)
    info, texts = state.info, TokenTexts(state.tokenizer)
    lp = req.logprobs
    echo_top = lp if req.echo and lp is not None else None
    prompt_top = max(t for t in (echo_top, req.prompt_logprobs, -1) if t is not None)
    constraint = request_constraint(req, None, thinking=False)
    for p in plan.prompts:
        max_tokens = resolve_max_tokens(1 if score_only else req.max_tokens, len(p.ids), info.max_model_len,
                                        info.max_request_tokens, DEFAULT_MAX_TOKENS, "prompt",
                                        source=info.context_limit)
        params = sampling_params(req, info.vocab_size, max_tokens, logprobs=lp,
                                 skip_special_tokens=req.skip_special_tokens,
                                 prompt_logprobs=None if prompt_top < 0 else prompt_top, structured=constraint)
        for child in per_choice(params):
            plan.choices.append(CompletionChoice(len(plan.choices), p, child, req, state, texts, score_only))
            plan.params.append(child)
    return plan


async def create_completion(request: Request, state: ServerState) -> Response:
    plan = await run_in_threadpool(plan_completion, await request.body(), state)
    req, choices = plan.req, plan.choices
    rid = "cmpl-" + request.headers.get("x-request-id", uuid.uuid4().hex)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": plan.model}
    try:
        group = state.client.submit([c.prompt.ids for c in choices], plan.params, uuid.uuid4().hex,
                                    kv_transfer=request.headers.get(KV_TRANSFER_HEADER))
    except NotEncodable as e:
        raise bad_request(str(e)) from None
    prompt_tokens = sum(len(p.ids) for p in plan.prompts)
    tracker = state.metrics.track(len(choices), prompt_tokens)
    usage = Usage(prompt_tokens, choices, group,
                  [next(i for i, p in enumerate(plan.prompts) if p is c.prompt) for c in choices])
    response = await answer(request, group, tracker, rid, lambda: respond_whole(group, tracker, head, choices, usage),
                            (lambda: _stream(group, tracker, head, choices, usage, req.include_usage))
                            if req.stream else None)
    return with_header(response, req.ignored_fields)


def _stream(group, tracker, head: dict, choices: list[CompletionChoice], usage: Usage, include_usage: bool):
    chunks = ChunkFormat(head, {"usage": None} if include_usage else {}, PLAIN_CHOICE)

    async def events():
        with guarded(group, tracker):
            async for batch in output_batches(group, tracker):      # one write per batch
                yield "".join([chunks.event(choices[index].update(out)) for index, out in batch])
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage.to_dict()})
    return sse_events(events())
