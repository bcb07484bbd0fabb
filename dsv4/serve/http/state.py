"""What every route handler needs: the engine client, the tokenizer and the model facts."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..client import EngineClient
from ...engine.ipc import Ready
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

    @classmethod
    def create(cls, client: EngineClient, model_dir: str, model_names: list[str],
               api_key: str | None = None, tokenizer_dir: str | None = None) -> "ServerState":
        """`tokenizer_dir`: where the tokenizer (and the chat release) is read; the model folder when None."""
        text_dir = tokenizer_dir or model_dir
        return cls(client=client, info=client.info, tokenizer=Tokenizer.from_dir(text_dir),
                   model_dir=model_dir, model_names=list(model_names), release=detect_release(text_dir),
                   add_bos=_adds_bos(text_dir), metrics=ServerMetrics(model_names[0], client.info.num_pages),
                   api_key=api_key)


def _adds_bos(model_dir: str) -> bool:
    """tokenizer_config.json's add_bos_token (False when absent)."""
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("add_bos_token") is True
    except (OSError, ValueError, AttributeError):
        return False
