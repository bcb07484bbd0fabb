"""A launched step whose sampled tokens are still on their way to the host (docs/architecture.md, "Engine").

With async scheduling the engine launches step k+1 before it reads step k's tokens: the
host's bookkeeping of step k (appending tokens, stop checks, detokenising) overlaps the
GPU's work on step k+1, which takes step k's tokens straight from the device
(runner.PendingFill). Rows of requests that finished in between are discarded.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .scheduler import ScheduledChunk
from .upload import ALIGN, views


class HostCopy:
    """Device tensors copied into pinned host memory behind an event; `get()` waits for it.
    On the device they are packed into one byte buffer first (one concatenation), so one pinned
    buffer and one copy cross, not one a tensor (`pack`: do that on a CPU too, as tests do)."""

    def __init__(self, tensors: list[torch.Tensor], pack: bool = False):
        self.event = None
        on_cuda = bool(tensors) and tensors[0].is_cuda
        if on_cuda or (pack and tensors):
            flat, offsets = _packed(tensors)
            host = torch.empty(-(-flat.numel() // ALIGN) * ALIGN, dtype=torch.uint8, pin_memory=on_cuda)
            host[:flat.numel()].copy_(flat, non_blocking=on_cuda)
            self.host = views(host, tensors, offsets)
            if on_cuda:
                self.event = torch.cuda.Event()
                self.event.record()
        else:
            self.host = tensors

    def get(self) -> list[list]:
        """The tensors as nested lists (a tensor with no columns: one shared empty tuple per row,
        not a fresh list each)."""
        if self.event is not None:
            self.event.synchronize()
        return [t.tolist() if t.ndim != 2 or t.shape[1] else [()] * t.shape[0] for t in self.host]


def _packed(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """(the tensors' bytes in one uint8 tensor on their device, each one's byte offset): widest
    dtypes first, so every offset is a multiple of its tensor's element size."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    offsets, at = [0] * len(tensors), 0
    for i in order:
        offsets[i], at = at, at + tensors[i].nbytes
    flat = torch.cat([tensors[i].contiguous().view(-1).view(torch.uint8) for i in order])
    return flat, offsets


@dataclass
class PromptLogprobRows:
    """Prompt logprobs of one chunk, computed on the device at launch."""
    request: object
    start: int                       # the chunk's first position
    next_ids: list[int]              # the prompt tokens its rows predict
    values: HostCopy                 # token logprobs [n], top ids [n, k], top logprobs [n, k]


@dataclass
class StepInFlight:
    chunks: list[ScheduledChunk]
    sampled: list[int]               # chunk indices that sampled a token, in row order
    tokens: torch.Tensor | None      # [len(sampled)] long on the device (feeds the next step)
    values: HostCopy | None          # tokens, logprobs [N], top ids [N, k], top logprobs [N, k]
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    # set when sampling waits for the previous step's tokens (grammar masks): the engine calls
    # it after reading that step back, before anything reads `tokens` or `values`
    sample_later: Callable[[], None] | None = None
    masks: object | None = None      # structured/masks.PendingMask its sampling waits for (or None)

    def set_sampled(self, tokens: torch.Tensor | None, values: HostCopy | None) -> None:
        self.tokens, self.values, self.sample_later, self.masks = tokens, values, None, None

    def sampled_tokens(self) -> torch.Tensor | None:
        """The sampled tokens on the device, sampling now if the sampling waits for grammar masks
        (`sample_later`, the masks started when the step before was read back). The next step's
        launch asks for them only when its forward first reads them (`PendingFill.apply`: after
        the host scheduled that step, built and uploaded its inputs), so the masks fill while the
        host does all that; the sampling is enqueued before that forward on the same stream."""
        if self.sample_later is not None:
            with torch.inference_mode():
                self.sample_later()
        return self.tokens
