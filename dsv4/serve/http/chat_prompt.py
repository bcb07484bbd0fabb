"""A chat request -> prompt token ids, per-choice sampling parameters and parser settings.

tool_choice: "auto" parses tool calls; "none" keeps the tools in the prompt but drops any
call the model writes; "required" and a named function prefill the assistant turn with the
opening of a DSML tool-call block (and the invoke header for a named one), so the reply
*is* a tool call. A prefilled reply starts right after `</think>`: forced tool choices
run without thinking.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...sampling_params import SamplingParams
from ..chat_format.dsml import BLOCK_OPEN, BLOCK_SEPARATOR, INVOKE_OPEN
from ..chat_format.encoding import encode_messages
from .errors import bad_request
from ..chat_format.release import normalize_effort
from .protocol import (ChatCompletionRequest, check_messages, check_model, check_response_format,
                       check_tools, resolve_max_tokens, sampling_params)
from .state import ServerState

MAX_N = 128


@dataclass
class ChatPlan:
    model: str
    prompt_ids: list[int]
    params: list[SamplingParams]      # one per choice
    thinking: bool
    tools_enabled: bool
    prefill: str                      # assistant text already at the end of the prompt
    top_logprobs: int | None          # None: no logprobs


def plan_chat(req: ChatCompletionRequest, state: ServerState) -> ChatPlan:
    model = check_model(req.model, state.model_names)
    check_messages(req)
    check_tools(req.tools)
    mode = req.tool_choice_mode()
    effort, thinking_allowed = normalize_effort(state.release, req.reasoning_effort)
    thinking = req.thinking and thinking_allowed and mode not in ("required", "named")
    prefill = _prefill(req, mode)
    prompt_ids = state.tokenizer.encode(_prompt_text(req, state, thinking, effort) + prefill)
    top = _top_logprobs(req)
    info = state.info
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(getattr(req, limit_param), len(prompt_ids), info.max_model_len,
                                    info.max_request_tokens, None, "messages", limit_param)
    if req.n > MAX_N:
        raise bad_request(f"n: at most {MAX_N} choices per request, got {req.n}", "n")
    base = sampling_params(req, info.vocab_size, max_tokens, logprobs=top, skip_special_tokens=False)
    return ChatPlan(model, prompt_ids, per_choice(base), thinking, mode != "none", prefill, top)


def per_choice(params: SamplingParams) -> list[SamplingParams]:
    """n requests of n=1; a seeded request gives choice i the seed + i (as LLM.generate)."""
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


def _prompt_text(req: ChatCompletionRequest, state: ServerState, thinking: bool, effort: str | None) -> str:
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        return encode_messages(messages, thinking=thinking, reasoning_effort=effort,
                               tools=tools, response_format=check_response_format(req.response_format),
                               release=state.release)
    except ValueError as e:
        param = "reasoning_effort" if "reasoning_effort" in str(e) else "messages"
        raise bad_request(f"{param}: {e}", param) from None


def _prefill(req: ChatCompletionRequest, mode: str) -> str:
    if mode == "required":
        return f"{BLOCK_SEPARATOR}{BLOCK_OPEN}\n"
    if mode == "named":
        return f'{BLOCK_SEPARATOR}{BLOCK_OPEN}\n{INVOKE_OPEN}{req.tool_choice.function.name}">\n'
    return ""


def _top_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None
