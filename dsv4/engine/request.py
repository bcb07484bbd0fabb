"""One request's bookkeeping. Its cache state lives in the pools; here are the handles.

State machine: WAITING -> RUNNING (prefilling while num_computed < len(all tokens) - 1,
decoding after) -> FINISHED; ABORTED from anywhere; PREEMPTED (by recompute) puts it back
to WAITING with num_computed = 0 and no cache held.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..model.vision.spans import ImageSpan, key_tokens
from ..sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)      # identity: the scheduler's `in` / `remove` on its lists compare by `is`, not field by field
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int                               # admission order; newest = largest
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0                      # tokens whose KV (and compressor state) is written
    batch_row: int = -1                        # its slot in the persistent batch (engine/slot_state.py; -1: none)
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None       # prompt tokens resumed from the prefix cache at first admission
    num_pending: int = 0                       # sampled by steps in flight, not yet in output_token_ids
    pending_row: int = -1                      # the latest one's row in its step's sampled tokens
    spec_token_ids: list[int] = field(default_factory=list)  # drafts the next decode step verifies
    images: tuple[ImageSpan, ...] = ()         # image blocks of the prompt, by position (docs/vision.md)
    grammar_pending: bool = False              # its constraint still compiles: the scheduler leaves it waiting

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def known_tokens(self, start: int, n: int) -> list[int]:
        """all_token_ids[start:start + n] without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:start - p + n]
        return self.prompt_token_ids[start:start + n] + self.output_token_ids[:max(start + n - p, 0)]

    def key_tokens(self, start: int, n: int) -> list[int]:
        """known_tokens with image block positions keyed by their image (the prefix cache's key)."""
        return key_tokens(self.known_tokens(start, n), self.images, start)

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens: the positions this request has to compute."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_remaining(self) -> int:
        """Known tokens whose KV is not written yet (1 for a decoding request)."""
        return self.num_tokens - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.status is Status.RUNNING and self.num_remaining == 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED or self.status is Status.ABORTED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else on its sampling row (no penalties, logit bias, min_tokens
        ban or logprobs): its row of the sampler's inputs is the same as any other such row
        (engine/sampling_inputs.py). `params` never change after admission: read once."""
        p = self.params
        return (p.is_greedy and not p.has_penalties and p.logit_bias is None and p.min_tokens == 0
                and p.logprobs is None)
