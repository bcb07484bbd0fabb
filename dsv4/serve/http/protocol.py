"""OpenAI request bodies: pydantic models (strict types; unknown fields collected by
`fields.take_unknown`) and the checks pydantic cannot express. Everything here runs in the
API process before the engine sees anything, and raises `APIError` (400) naming the
offending field.

Sampling fields keep OpenAI's names; `sampling_params` maps them onto the engine's
`SamplingParams` and validates the values with its own rules (vLLM extensions included:
top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, skip_special_tokens).
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from ...sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from .body import read_json
from .errors import APIError, bad_request, from_value_error, validation_error
from .fields import take_unknown

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
IMAGE_PARTS = ("image_url", "input_image", "image")


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)   # extras: see fields.take_unknown
    _ignored: list[str] = PrivateAttr(default_factory=list)   # the unknown fields, removed

    @property
    def ignored_fields(self) -> list[str]:
        return self._ignored

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """`"field": null` is the same as leaving the field out (OpenAI accepts both)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Model):
    include_usage: bool = False


class SamplingFields(_Model):
    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None      # token id (as a JSON key) -> bias in [-100, 100]
    prompt_logprobs: int | None = None              # vLLM's: logprobs of the prompt tokens
    user: str | None = None
    # output constraints (vLLM's names; serve/http/structured.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None       # accepted and ignored: xgrammar is the one backend

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ---- chat ------------------------------------------------------------------------------
class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    prefix: bool = False           # DeepSeek's "continue this assistant message" (last only)


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class Thinking(_Model):
    """DeepSeek's API field: `"thinking": {"type": "enabled"}`."""
    type: Literal["enabled", "disabled"]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    continue_final_message: bool = False       # vLLM's names for prefix continuation
    add_generation_prompt: bool | None = None  # None: true unless continuing

    thinking_field: Thinking | None = Field(None, alias="thinking")
    include_reasoning: bool = True        # false: reasoning is generated but not returned

    @property
    def thinking(self) -> bool:
        """Whether to think: DeepSeek's `thinking` field or chat_template_kwargs' `thinking`
        (`enable_thinking`) when given (a 400 when they disagree), else on exactly when a
        reasoning_effort other than "none" is given, as in DeepSeek's API."""
        kwargs = self.chat_template_kwargs or {}
        value = kwargs.get("thinking", kwargs.get("enable_thinking"))
        if value is not None and not isinstance(value, bool):
            raise bad_request("chat_template_kwargs.thinking: must be true or false", "chat_template_kwargs")
        if self.thinking_field is not None:
            enabled = self.thinking_field.type == "enabled"
            if value is not None and value != enabled:
                raise bad_request(f"thinking: {self.thinking_field.type!r} contradicts "
                                  f"chat_template_kwargs.thinking={str(value).lower()}", "thinking")
            return enabled
        if value is not None:
            return value
        return self.reasoning_effort is not None and self.reasoning_effort != "none"

    def tool_choice_mode(self) -> str:
        """"none", "auto", "required" or "named" (checked against the tools)."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if choice in ("none", "auto"):
            return choice
        if not self.tools:
            raise bad_request("tool_choice: requires tools", "tool_choice")
        if choice == "required":
            return choice
        if choice.function.name not in {t.function.name for t in self.tools}:
            raise bad_request(f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
        return "named"


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    best_of: int | None = None           # only 1 (= n) is supported
    suffix: str | None = None            # not supported (no fill-in-the-middle)


# ---- parsing and checks --------------------------------------------------------------------
def parse_body(raw: bytes, model: type[_Model], strict: bool = False) -> Any:
    """The validated request; unknown fields are removed and listed in `ignored_fields`
    (with `strict`, the first one is a 400)."""
    return parse_data(read_json(raw), model, strict)


def parse_data(data: dict, model: type[_Model], strict: bool = False) -> Any:
    """`parse_body` of a body already read by `body.read_json`."""
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise bad_request("the request body nests too deeply") from None
    req._ignored = take_unknown(req, strict)
    return req


def check_messages(req: ChatCompletionRequest, vision: bool = False) -> None:
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                _check_part(part, f"messages.{i}.content.{j}", vision)


def _check_part(part: dict, where: str, vision: bool) -> None:
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text: must be a string", f"{where}.text")
    elif kind in IMAGE_PARTS:
        if not vision:
            raise bad_request(f"{where}: image content is not supported: this server runs without "
                              f"vision (text-only model)", where)
    else:
        raise bad_request(f"{where}: unsupported content part type {kind!r}", f"{where}.type")


def check_tools(tools: list[Tool] | None) -> None:
    for i, tool in enumerate(tools or []):
        fn = tool.function
        if not _FUNCTION_NAME.match(fn.name):
            raise bad_request(f"tools.{i}.function.name: {fn.name!r} must be 1-64 letters, digits, "
                              f"'_', '.' or '-'", f"tools.{i}.function.name")
        if fn.parameters is not None and fn.parameters.get("type", "object") != "object":
            raise bad_request(f"tools.{i}.function.parameters: must be a JSON schema of type "
                              f"'object'", f"tools.{i}.function.parameters")
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")


def check_response_format(fmt: ResponseFormat | None) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        if not fmt.json_schema or not isinstance(fmt.json_schema.get("schema", {}), dict):
            raise bad_request("response_format.json_schema: required with a 'schema' object",
                              "response_format.json_schema")
    return fmt.model_dump(exclude_none=True)


def sampling_params(req: SamplingFields, vocab_size: int, max_tokens: int, **extra) -> SamplingParams:
    """The engine's parameters for one choice (n=1); raises APIError(400) for bad values."""
    defaults = SamplingParams()
    values = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty")}
    params = SamplingParams(
        n=req.n, seed=req.seed, stop=req.stop, max_tokens=max_tokens, min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=_logit_bias(req.logit_bias),
        **{k: (getattr(defaults, k) if v is None else v) for k, v in values.items()}, **extra)
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise from_value_error(e, rename={"logprobs": "top_logprobs" if isinstance(req, ChatCompletionRequest)
                                          else "logprobs"}) from None
    return params


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's JSON keys are token ids written as strings."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            raise bad_request(f"logit_bias: key {key[:40]!r} is not a token id", "logit_bias")
        out[int(key)] = value
    return out


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, max_request_tokens: int,
                       default: int | None, prompt_param: str, param: str = "max_tokens", source: str = "") -> int:
    """max_tokens for a prompt of `prompt_len` tokens: the request's, else `default` (None: up
    to the context), never past the context or what the KV cache can hold for one request.
    `source`: what sets the limit (Ready.context_limit), named in the error."""
    limit = min(max_model_len, max_request_tokens)
    limit_text = f"{limit} tokens" + (f" (set by {source})" if source else "")
    if prompt_len >= limit:
        raise bad_request(f"{prompt_param}: this model's maximum context length is {limit_text}; "
                          f"the prompt has {prompt_len} tokens (and needs room for at least one more)",
                          prompt_param)
    if requested is None:
        return limit - prompt_len if default is None else min(default, limit - prompt_len)
    if requested < 1:
        raise bad_request(f"{param}: must be >= 1, got {requested}", param)
    if prompt_len + requested > limit:
        raise bad_request(f"{param}: this model's maximum context length is {limit_text}; you "
                          f"requested {prompt_len + requested} ({prompt_len} in the prompt, {requested} "
                          f"for the completion)", param)
    return requested


def check_model(requested: str | None, served: list[str]) -> str:
    if requested is None or requested in served:
        return requested or served[0]
    raise APIError(404, f"The model `{requested}` does not exist; this server serves {served}",
                   "model", "model_not_found")
