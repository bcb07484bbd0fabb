"""The endpoints besides generation, in vLLM's shapes: `/v1/models`, `/v1/models/{id}`,
`/tokenize` (a text prompt, or chat messages encoded as `/v1/chat/completions` would),
`/detokenize`, `/version`. No response names a filesystem path: a model's `root` is its
first served name. Tokenising runs in a worker thread, like the generating endpoints.
"""
from __future__ import annotations

import dataclasses
import time
from importlib import metadata

import msgspec
from pydantic import Field

from .body import read_json
from .chat_prompt import plan_chat
from .errors import bad_request
from .protocol import ChatCompletionRequest, _Model, check_model, parse_body, parse_data
from .state import ServerState
from .textstream import TokenTexts

UNLIMITED = 1 << 62   # a context no prompt reaches: /tokenize counts prompts of any length


class TokenizeCompletionRequest(_Model):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True        # BOS, when the checkpoint's tokenizer adds one
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 24)


def model_card(name: str, state: ServerState, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "dsv4", "root": state.model_names[0],
            "parent": None, "max_model_len": state.info.max_model_len}


def list_models(state: ServerState) -> dict:
    created = int(time.time())
    return {"object": "list", "data": [model_card(name, state, created) for name in state.model_names]}


def get_model(model_id: str, state: ServerState) -> dict:
    return model_card(check_model(model_id, state.model_names), state, int(time.time()))


def tokenize(raw: bytes, state: ServerState) -> dict:
    """-> {count, max_model_len, tokens, token_strs} (runs in a worker thread)."""
    data = read_json(raw)
    is_chat = "messages" in data
    req = parse_data(data, TokenizeChatRequest if is_chat else TokenizeCompletionRequest, state.limits.strict_api)
    if is_chat:
        unlimited = msgspec.structs.replace(state.info, max_model_len=UNLIMITED, max_request_tokens=UNLIMITED)
        req.max_tokens = req.max_completion_tokens = None
        ids = plan_chat(req, dataclasses.replace(state, info=unlimited)).prompt_ids
    else:
        check_model(req.model, state.model_names)
        bos = [state.tokenizer.bos_id] if req.add_special_tokens and state.add_bos else []
        ids = bos + state.tokenizer.encode(req.prompt)
    texts = TokenTexts(state.tokenizer)
    return {"count": len(ids), "max_model_len": state.info.max_model_len, "tokens": ids,
            "token_strs": [texts(t) for t in ids] if req.return_token_strs else None}


def detokenize(raw: bytes, state: ServerState) -> dict:
    """-> {prompt} (runs in a worker thread)."""
    req = parse_body(raw, DetokenizeRequest, state.limits.strict_api)
    check_model(req.model, state.model_names)
    bad = [t for t in req.tokens if not 0 <= t < state.info.vocab_size]
    if bad:
        raise bad_request(f"tokens: token id {bad[0]} is outside the vocabulary [0, {state.info.vocab_size})",
                          "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


def version() -> dict:
    try:
        return {"version": metadata.version("dsv4")}
    except metadata.PackageNotFoundError:
        return {"version": "unknown"}

