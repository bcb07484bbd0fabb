"""What every route handler needs: the engine client, the tokenizer and the model facts."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..client import EngineClient
from ...engine.ipc import Ready
from .limits import ServerLimits
from .metrics import ServerMetrics
from ..chat_format.release import detect_release
from ...text.tokenizer import Tokenizer


@dataclass
class ServerState:
    client: EngineClient
    info: Ready
    tokenizer: Tokenizer
    model_dir: str
    model_names: list[str]
    release: str
    add_bos: bool                 # prepend BOS to text prompts of /v1/completions
    metrics: ServerMetrics
    api_key: str | None = None
    limits: ServerLimits = ServerLimits()
    max_token_chars: int = 0      # no token decodes to more characters (0: unknown)

    @classmethod
    def create(cls, client: EngineClient, model_dir: str, model_names: list[str],
               api_key: str | None = None, limits: ServerLimits = ServerLimits(),
               tokenizer_dir: str | None = None) -> "ServerState":
        """`tokenizer_dir`: where the tokenizer (and the chat release) is read; the model folder when None."""
        text_dir = tokenizer_dir or model_dir
        tokenizer = Tokenizer.from_dir(text_dir)
        api_server = (client.index, client.count) if client.count > 1 else None
        client.tokenizer = tokenizer          # stop strings are checked in this process (serve/client.py)
        return cls(client=client, info=client.info, tokenizer=tokenizer,
                   model_dir=model_dir, model_names=list(model_names), release=detect_release(text_dir),
                   add_bos=_adds_bos(text_dir), metrics=ServerMetrics(model_names[0], client.info.num_pages, api_server),
                   api_key=api_key, limits=limits, max_token_chars=tokenizer.max_token_chars())

    def surely_too_long(self, text: str) -> bool:
        """True when `text` must encode to more tokens than any request may hold (decided
        from its length alone: a token never stands for more than `max_token_chars`)."""
        limit = min(self.info.max_model_len, self.info.max_request_tokens)
        return self.max_token_chars > 0 and len(text) > limit * self.max_token_chars


def _adds_bos(model_dir: str) -> bool:
    """tokenizer_config.json's add_bos_token (False when absent)."""
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("add_bos_token") is True
    except (OSError, ValueError, AttributeError):
        return False
