"""A step's sequences as arrays: what `build_step` reads of them (docs/architecture.md, "Cache").

`StepRows.of` turns a list of SeqChunks into it; the engine's persistent decode path
(engine/decode_rows.py) gathers it straight from the running requests, with no SeqChunk per
decode row. Both give build_step the same batch for the same sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np

_START, _SLOT, _LOGITS, _STAGE = attrgetter("start"), attrgetter("slot"), attrgetter("logits"), attrgetter("stage")
_TOKENS, _IMAGES = attrgetter("token_ids"), attrgetter("images")
_PAGES, _SWA = attrgetter("page_table"), attrgetter("swa_table")


@dataclass(slots=True)
class StepRows:
    """R sequences of a step, T tokens in all, rows in step order. Sequence r adds tokens
    [starts[r], starts[r] + lens[r]) at token rows offs[r] = sum(lens[:r]) onwards."""
    slots: np.ndarray                  # [R] int64 request state slot (its ring rows, its table rows)
    starts: np.ndarray                 # [R] int64 absolute position of the first token
    lens: np.ndarray                   # [R] int64 tokens of the sequence (>= 1)
    logits: np.ndarray                 # [R] int64 the last `logits` tokens' logits are wanted
    token_ids: np.ndarray              # [T] int64 (a token still on the device: 0, filled there)
    page_tables: list[list[int]]       # [R] logical 256-token page -> physical page (SeqChunk.page_table)
    swa_tables: list[list[int]]        # [R] logical 128-token SWA page -> physical (-1 freed)
    stage: np.ndarray | None = None    # [R] SeqChunk.stage (None: no sequence stages)
    images: list[tuple] | None = None  # [R] SeqChunk.images (None: no sequence has any)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of(cls, chunks: list) -> "StepRows":
        """The rows of SeqChunks (O(R) C-level maps, no Python call per chunk)."""
        R = len(chunks)
        lens = np.fromiter(map(len, map(_TOKENS, chunks)), np.int64, R)
        stage = np.fromiter(map(_STAGE, chunks), np.int64, R)
        images = list(map(_IMAGES, chunks))
        return cls(slots=np.fromiter(map(_SLOT, chunks), np.int64, R),
                   starts=np.fromiter(map(_START, chunks), np.int64, R), lens=lens,
                   logits=np.fromiter(map(_LOGITS, chunks), np.int64, R),
                   token_ids=np.fromiter(chain.from_iterable(map(_TOKENS, chunks)), np.int64, int(lens.sum())),
                   page_tables=list(map(_PAGES, chunks)), swa_tables=list(map(_SWA, chunks)),
                   stage=stage if stage.any() else None, images=images if any(images) else None)


def as_rows(seqs) -> StepRows:
    """`seqs` (a StepRows or a list of SeqChunks) as StepRows."""
    return seqs if isinstance(seqs, StepRows) else StepRows.of(seqs)
