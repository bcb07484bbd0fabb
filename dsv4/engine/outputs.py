"""What the engine reports per request."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)     # (made per request and step: no instance dict)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                       # all generated so far
    new_token_ids: list[int]                   # generated in this step
    finished: bool = False
    finish_reason: str | None = None           # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    text: str | None = None                    # when the checkpoint has a tokenizer
    logprobs: list[dict[int, float]] | None = None          # per generated token: id -> logprob
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
