"""The persistent batch: what a decode row reads of its request, kept by request state slot
between steps (docs/architecture.md, "Engine").

One column per slot (the request's cache record's slot) of a pre-allocated [fields, slots] array:
its position (num_computed), its token count (Request.num_tokens: prompt, output and pending
tokens), the count past which it may be a decode row (its prompt length; never with prompt
logprobs or images), its last output token, tokens still on the device (num_pending) and the
latest one's row in its step's sampled tokens (pending_row); and per slot its cache record's page
tables (the record's own lists, changed in place by the cache). `Request.batch_row` is the
column a request was joined into (-1: none).

Updated incrementally, vectorised over a step, where the requests' fields change:
  * join (`step_slots`): a request of a step that has no column yet (admitted, resumed from the
    prefix cache, resumed after a preemption, forgotten) is read once from its fields;
  * launch (`launched`, after `Scheduler.advance_step`): positions advance by the chunks' tokens
    less the rejected drafts; sampled requests get one more pending token (and token) and its row;
  * read-back (`completed`, after the engine appended the step's tokens): one pending token less,
    the last token known;
  * leave: `Scheduler.finish` / `preempt` set batch_row = -1 (the slot's next request joins
    afresh); a step the runner builds without the batch `forget`s its requests (their fields
    change without the arrays following).
Nothing else changes those fields of a request holding a column (spec drafts are read by verify
chunks, which take the SeqChunk path). `check` compares every field with the requests
(tests/engine/test_persistent_batch.py calls it after every step). A step reads every field of
its slots by one `take` and updates them field by field: a few numpy calls a step, none a row.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

_SLOT = attrgetter("request.batch_row")
_NUM_TOKENS, _REJECTED = attrgetter("num_tokens"), attrgetter("num_rejected")


@dataclass(slots=True)
class StepSlots:
    """A step's chunks in the persistent batch."""
    slot_list: list[int]            # [R] each chunk's column (its request's state slot)
    slots: np.ndarray               # [R] int64, the same
    lens: np.ndarray                # [R] int64 the chunks' num_tokens


# the fields of a slot: rows of SlotState.fields
POSITION, DECODE_FROM, LAST, PENDING_ROW, NUM_TOKENS, PENDING = range(6)   # (NUM_TOKENS, PENDING: adjacent)
NEVER = np.iinfo(np.int64).max          # DECODE_FROM of a request whose rows are never decode rows


class SlotState:
    def __init__(self, slots: int):
        # [6, S] int64: one row a field (the names above), one column a slot
        self.fields = np.zeros((6, slots), np.int64)
        self.fields[[LAST, PENDING_ROW]] = -1
        (self.position,         # [S] num_computed
         self.decode_from,      # [S] len(prompt_token_ids), NEVER with prompt logprobs or images
         self.last,             # [S] output_token_ids[-1] (-1: none yet)
         self.pending_row,      # [S] pending_row (while pending > 0)
         self.num_tokens,       # [S] Request.num_tokens (prompt + output + pending)
         self.pending) = self.fields        # [S] num_pending (views: rows of `fields`)
        self.pages: list[list[int]] = [[] for _ in range(slots)]   # [S] its record's history table
        self.swa: list[list[int]] = [[] for _ in range(slots)]     # [S] its record's SWA table
        self.owner: list[object | None] = [None] * slots           # [S] the request joined there
        self.joins = 0                  # requests read from their fields so far (how incremental)

    def step_slots(self, chunks: list, records: dict) -> StepSlots:
        """The chunks' slots, joining the requests that have none. `records`: the cache
        manager's records by request id."""
        slots = list(map(_SLOT, chunks))
        if min(slots, default=0) < 0:
            for i in [i for i, s in enumerate(slots) if s < 0]:
                req = chunks[i].request
                slots[i] = self.join(req, records[req.request_id])
        return StepSlots(slots, np.array(slots, np.int64), np.fromiter(map(_NUM_TOKENS, chunks), np.int64, len(chunks)))

    def join(self, req, held) -> int:
        """Read `req` (its cache record `held`) into its slot's column; returns the slot."""
        s = held.slot
        if s is None:
            raise RuntimeError(f"request {req.request_id}: scheduled without a state slot")
        out = req.output_token_ids
        self.fields[:, s] = (req.num_computed, _decode_from(req), out[-1] if out else -1, req.pending_row,
                             req.num_tokens, req.num_pending)
        self.pages[s], self.swa[s], self.owner[s] = held.pages, held.swa_pages, req
        req.batch_row = s
        self.joins += 1
        return s

    @staticmethod
    def forget(chunks: list) -> None:
        """A step built without the batch: its requests' columns stop following them."""
        for c in chunks:
            c.request.batch_row = -1

    def launched(self, step: StepSlots, chunks: list, sampled: list[int], verify: bool) -> None:
        """After a launched step of `chunks` (their slots `step`) advanced num_computed by
        num_tokens - num_rejected and gave each chunk in `sampled` (row order, a chunk once a
        token) a pending token at its row there. `verify`: a speculative step (chunks may
        reject drafts and sample several tokens); else each chunk samples at most once.
        (Field by field: a 1-D fancy index costs a fraction of a 2-D one's.)"""
        n = step.lens
        if verify:
            n = n - np.fromiter(map(_REJECTED, chunks), np.int64, len(chunks))
        self.position[step.slots] += n                # (a request once a step: slots distinct)
        if not sampled:
            return
        s = step.slots if len(sampled) == len(chunks) and not verify else step.slots[np.array(sampled)]
        if not verify:
            self.num_tokens[s] += 1
            self.pending[s] += 1
            self.pending_row[s] = np.arange(len(s))
        else:                                         # several tokens of a chunk: the last one's row
            np.add.at(self.num_tokens, s, 1)
            np.add.at(self.pending, s, 1)
            last, at = _last_of(s)
            self.pending_row[last] = at

    def completed(self, chunks: list, sampled: list[int], tokens: list[int], verify: bool) -> None:
        """After the engine appended a read-back step's `tokens` (one per entry of `sampled`)
        to its requests (those of requests that have left since: batch_row -1, skipped).
        `verify` as in `launched`."""
        full = len(sampled) == len(chunks) and not verify         # (sampled == range(R))
        s = np.fromiter(map(_SLOT, chunks if full else map(chunks.__getitem__, sampled)), np.int64, len(sampled))
        t = np.fromiter(tokens, np.int64, len(sampled))
        if not len(s) or s.min() < 0:
            keep = s >= 0
            s, t = s[keep], t[keep]
            if not len(s):
                return
        if not verify:
            self.pending[s] -= 1
            self.last[s] = t
        else:
            np.subtract.at(self.pending, s, 1)
            last, at = _last_of(s)
            self.last[last] = t[at]

    def check(self, requests, records: dict) -> None:
        """Debug: every request holding a column agrees with it field by field (AssertionError
        naming the request and field otherwise); columns are held once."""
        held = [r for r in requests if r.batch_row >= 0]
        assert len({r.batch_row for r in held}) == len(held), "two requests hold one column"
        for req in held:
            s, rec = req.batch_row, records.get(req.request_id)
            out = req.output_token_ids
            want = {"slot": (rec.slot if rec is not None else None, s), "owner": (True, self.owner[s] is req),
                    "position": (req.num_computed, self.position[s]),
                    "num_tokens": (req.num_tokens, self.num_tokens[s]),
                    "decode_from": (_decode_from(req), self.decode_from[s]),
                    "pending": (req.num_pending, self.pending[s]), "last": (out[-1] if out else -1, self.last[s]),
                    "pages": (True, rec is not None and self.pages[s] is rec.pages),
                    "swa": (True, rec is not None and self.swa[s] is rec.swa_pages)}
            if req.num_pending:
                want["pending_row"] = (req.pending_row, self.pending_row[s])
            for name, (value, column) in want.items():
                assert value == column, f"request {req.request_id}: {name} {value} but slot {s} holds {column}"


def _decode_from(req) -> int:
    """The token count past which a request's one-token chunks at its last token are decode
    rows (it has an output or pending token): its prompt's length; NEVER for requests with
    prompt logprobs or images (their chunks take the SeqChunk path)."""
    return len(req.prompt_token_ids) if req.params.prompt_logprobs is None and not req.images else NEVER


def _last_of(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values of s, the index of each one's last occurrence)."""
    values, first_from_end = np.unique(s[::-1], return_index=True)
    return values, len(s) - 1 - first_from_end
