"""A chat request -> prompt token ids, per-choice sampling parameters and parser settings.

tool_choice: "auto" parses tool calls; "none" keeps the tools in the prompt but drops any
call the model writes; "required" and a named function prefill the assistant turn with the
opening of a DSML tool-call block (and the invoke header for a named one), so the reply
*is* a tool call. A prefilled reply starts right after `</think>`: forced tool choices
run without thinking.

Continuation: an assistant message with `"prefix": true` (DeepSeek's API; the last message
only) or `continue_final_message` (vLLM's name) is continued rather than closed: the prompt
ends inside that turn (encoding.encode_messages) and the parser starts where the turn
stands (reasoning or content). `add_generation_prompt: false` (vLLM) leaves out the
`<｜Assistant｜>` after a final user message; the output is then read as content.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...sampling_params import SamplingParams, StructuredOutputs
from ...structured.grammars import GrammarError
from ..chat_format.tool_grammar import forced_call_grammar
from .structured import request_constraint
from ..chat_format.dsml import BLOCK_OPEN, BLOCK_SEPARATOR, INVOKE_OPEN
from ..chat_format.encoding import continuation_channel, encode_messages
from ...engine.ipc import ImageItem
from ..chat_format.images import take_images
from .chat_images import image_prompt
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
    tools: list[dict] | None = None   # the request's tools (their schemas type the arguments)
    start: str = "content"            # where the output begins: "reasoning" or "content"
    images: list[ImageItem] = dataclasses.field(default_factory=list)   # image blocks (docs/vision.md)


def plan_chat(req: ChatCompletionRequest, state: ServerState) -> ChatPlan:
    model = check_model(req.model, state.model_names)
    check_messages(req, vision=state.info.vision is not None)
    check_tools(req.tools)
    mode = req.tool_choice_mode()
    effort, thinking_allowed = normalize_effort(state.release, req.reasoning_effort)
    thinking = req.thinking and thinking_allowed and mode not in ("required", "named")
    continuing, generation_prompt = _turn(req, mode)
    prefill = _prefill(req, mode)
    messages, images = take_images([m.model_dump(exclude_none=True) for m in req.messages])
    prompt = _prompt_text(req, state, messages, thinking, effort, continuing, generation_prompt)
    prompt_ids, items = image_prompt(prompt + prefill, images, state, state.limits.media if images else None)
    top = _top_logprobs(req)
    info = state.info
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(getattr(req, limit_param), len(prompt_ids), info.max_model_len,
                                    info.max_request_tokens, None, "messages", limit_param,
                                    source=info.context_limit)
    if req.n > MAX_N:
        raise bad_request(f"n: at most {MAX_N} choices per request, got {req.n}", "n")
    start = (continuation_channel(messages, thinking) if continuing
             else "reasoning" if thinking and generation_prompt else "content")
    base = sampling_params(req, info.vocab_size, max_tokens, logprobs=top, skip_special_tokens=False,
                           structured=_constraint(req, mode, start == "reasoning"))
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return ChatPlan(model, prompt_ids, per_choice(base), thinking, mode != "none", prefill, top, tools, start, items)


def per_choice(params: SamplingParams) -> list[SamplingParams]:
    """n requests of n=1; a seeded request gives choice i the seed + i (as LLM.generate)."""
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


def _turn(req: ChatCompletionRequest, mode: str) -> tuple[bool, bool]:
    """(whether the final assistant message is continued, whether the prompt ends with the
    generation prompt); raises APIError(400) for combinations that contradict each other."""
    last = len(req.messages) - 1
    for i, message in enumerate(req.messages):
        if message.prefix and (i != last or message.role != "assistant"):
            raise bad_request(f"messages.{i}.prefix: only the last message, an assistant one, can be "
                              f"a prefix to continue", f"messages.{i}.prefix")
    continuing = req.continue_final_message or req.messages[last].prefix
    if continuing and req.add_generation_prompt:
        raise bad_request("add_generation_prompt: cannot be true when the final message is continued "
                          "(continue_final_message or prefix)", "add_generation_prompt")
    if continuing and req.messages[last].role != "assistant":
        raise bad_request("continue_final_message: the last message must be an assistant message",
                          "continue_final_message")
    if continuing and mode in ("required", "named"):
        raise bad_request("tool_choice: a forced tool call cannot continue an assistant message", "tool_choice")
    return continuing, not continuing and req.add_generation_prompt is not False


def _prompt_text(req: ChatCompletionRequest, state: ServerState, messages: list[dict], thinking: bool,
                 effort: str | None, continuing: bool, generation_prompt: bool) -> str:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        return encode_messages(messages, thinking=thinking, reasoning_effort=effort,
                               tools=tools, response_format=check_response_format(req.response_format),
                               release=state.release, add_generation_prompt=generation_prompt,
                               continue_final_message=continuing)
    except ValueError as e:
        param = next((p for p in ("reasoning_effort", "continue_final_message") if p in str(e)), "messages")
        raise bad_request(f"{param}: {e}", param) from None


def _constraint(req: ChatCompletionRequest, mode: str, thinking: bool) -> StructuredOutputs | None:
    """The grammar the output follows: a forced tool call's DSML block, or the request's
    response_format / guided_* constraint (from `</think>` on when the output starts thinking)."""
    spec = request_constraint(req, check_response_format(req.response_format), thinking)
    if mode not in ("required", "named"):
        return spec
    if spec is not None:
        raise bad_request("tool_choice: a forced tool call cannot be combined with response_format or a "
                          "guided_* / structured_outputs constraint", "tool_choice")
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    named = req.tool_choice.function.name if mode == "named" else None
    try:
        return StructuredOutputs(grammar=forced_call_grammar(tools, named))
    except GrammarError as e:
        param = "tools"
        raise bad_request(str(e) if str(e).startswith("tools") else f"tools: {e}", param) from None


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
