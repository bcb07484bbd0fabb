"""A step's rows read from the persistent batch with no Python pass per decode row
(docs/architecture.md, "Engine": the persistent batch).

A decode row — one token at position num_computed, the request's last: known (its last output
token), or sampled by the step in flight and still on the device (its `pending_row` there) —
is a function of its request's row of the persistent batch (engine/slot_state.py: position,
lengths, last token, pending token and row, page tables, kept by slot between steps).
`gather_rows` takes the step's rows (one C-level map over the chunks, `SlotState.step_slots`) and
reads the rest by fancy indexing into arrays: no SeqChunk, no Python call and no attribute read
per decode row. Any other chunk (a prefill chunk, k + 1 tokens to verify, a request with prompt
logprobs or images) is made by `seq_chunk` as before. The page tables persist by slot
(cache/batch_tables.py) and are rewritten only where they changed.

The result equals the SeqChunk path's: `StepRows.of` of the chunks `seq_chunk` makes, and the
rows `pending_of` fills from the device (tests/engine/test_persistent_batch.py).
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_

import numpy as np

from ..cache.addressing import SeqChunk
from ..cache.step_rows import StepRows
from .slot_state import DECODE_FROM, LAST, NUM_TOKENS, PENDING, PENDING_ROW, POSITION, SlotState, StepSlots

_NUM_LOGITS = attrgetter("num_logits")
# steps of fewer chunks take the SeqChunk path: the batch's fixed numpy calls a step (step inputs,
# `launched`, `completed`) cost more than a SeqChunk a chunk below ~10-16 chunks (CPU, hot loop,
# µs a request: c8 4.5 against 3.6; c16 3.3 against 4.2; c32 1.8 against 2.4; c256 0.58 against 3.1)
GATHER_MIN_ROWS = 32


def gather_rows(chunks: list, rows: StepSlots, batch: SlotState,
                seq_chunk: Callable[[object], SeqChunk]) -> tuple[StepRows, np.ndarray, np.ndarray] | None:
    """(the step's rows, token rows still on the device [P], their rows in the step in flight's
    sampled tokens [P], by token row) for the scheduled chunks, or None when no chunk is a
    decode row (a prefill step: the SeqChunk path). `rows`: the chunks' slots in `batch`
    (`SlotState.step_slots`); `seq_chunk`: the runner's SeqChunk of any other chunk."""
    R, slots, n = len(chunks), rows.slots, rows.lens
    fields = batch.fields.take(slots, axis=1)            # [6, R] every field of the step's slots
    starts, pending, num_tokens = fields[POSITION], fields[PENDING], fields[NUM_TOKENS]
    # one token, the request's last, known or pending (past its prompt), not a verify chunk
    decode = (n == 1) & (starts + 1 == num_tokens) & (num_tokens > fields[DECODE_FROM])
    if not all(map(is_, map(_NUM_LOGITS, chunks), repeat(None))):
        decode &= np.fromiter(map(is_, map(_NUM_LOGITS, chunks), repeat(None)), bool, R)
    if not decode.any():
        return None
    if pending.max() > 1 and (pending[decode] > 1).any():
        i = int(np.nonzero(decode & (pending > 1))[0][0])
        raise RuntimeError(f"request {chunks[i].request.request_id}: tokens up to {starts[i] + 1} scheduled, "
                           f"{starts[i] + 1 - pending[i]} known and {pending[i]} pending")
    tables = list(map(batch.pages.__getitem__, rows.slot_list)), list(map(batch.swa.__getitem__, rows.slot_list))
    on_device = pending > 0
    if decode.all():                                    # a decode step: row i is token row i
        dst = np.flatnonzero(on_device)
        step = StepRows(slots, starts, n, np.ones(R, np.int64), np.where(on_device, 0, fields[LAST]), *tables)
        return step, dst, fields[PENDING_ROW][dst]
    step = StepRows(slots, starts, n, decode.astype(np.int64), np.zeros(int(n.sum()), np.int64), *tables)
    offs = np.cumsum(n) - n
    on_device &= decode
    known = decode & ~on_device
    step.token_ids[offs[known]] = fields[LAST][known]
    dst, src = [offs[on_device]], [fields[PENDING_ROW][on_device]]
    for i in np.nonzero(~decode)[0].tolist():           # prefill / verify chunks: as before
        fill = _add_chunk(step, i, int(offs[i]), chunks[i], seq_chunk(chunks[i]))
        if fill is not None:
            dst.append(np.array([fill[0]]))
            src.append(np.array([fill[1]]))
    dst, src = np.concatenate(dst), np.concatenate(src)
    order = np.argsort(dst, kind="stable")
    return step, dst[order], src[order]


def _add_chunk(rows: StepRows, i: int, row: int, chunk, seq: SeqChunk) -> tuple[int, int] | None:
    """Row i of `rows` from its SeqChunk (tokens from step row `row`, logits, stage, images);
    returns its token still on the device (`pending_of`)."""
    rows.token_ids[row:row + len(seq.token_ids)] = seq.token_ids
    rows.logits[i] = seq.logits
    if seq.stage:
        rows.stage = np.zeros(len(rows), np.int64) if rows.stage is None else rows.stage
        rows.stage[i] = seq.stage
    if seq.images:
        rows.images = [()] * len(rows) if rows.images is None else rows.images
        rows.images[i] = seq.images
    return pending_of(chunk, seq, row)


def pending_of(chunk, seq: SeqChunk, row: int) -> tuple[int, int] | None:
    """(token row, row in the step in flight's sampled tokens) of the one token of `chunk`
    (its SeqChunk `seq`, first token at step row `row`) still on the device: position `known`
    (the first unknown one) when the chunk reaches past its request's known tokens; None when
    it does not."""
    req = chunk.request
    last = seq.start + len(seq.token_ids)                 # one past the chunk's last position
    known = len(req.prompt_token_ids) + len(req.output_token_ids) + len(req.spec_token_ids)
    if last <= known:
        return None
    if req.num_pending != 1 or last != known + 1:
        raise RuntimeError(f"request {req.request_id}: tokens up to {last} scheduled, "
                           f"{known} known and {req.num_pending} pending")
    return row + known - seq.start, req.pending_row
