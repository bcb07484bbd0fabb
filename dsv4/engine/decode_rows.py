"""A step's rows gathered from the running requests with no Python pass per decode row
(docs/architecture.md, "Engine": the persistent batch).

A decode row — one token at position num_computed, the request's last: known (its last output
token), or sampled by the step in flight and still on the device (its `pending_row` there) —
is a function of its request's fields and of its cache record (slot, page tables). `gather_rows`
reads those of every row of a step at once through C-level maps (operator.attrgetter over the
chunks, the requests and the cache's records by id) into arrays: no SeqChunk, no Python call
per decode row. Any other chunk (a prefill chunk, k + 1 tokens to verify, a request with prompt
logprobs or images) is made by `seq_chunk` as before. The page tables persist by slot
(cache/batch_tables.py) and are rewritten only where they changed.

The result equals the SeqChunk path's: `StepRows.of` of the chunks `seq_chunk` makes, and the
rows `pending_of` fills from the device (tests/engine/test_persistent_batch.py).
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_, itemgetter, not_

import numpy as np

from ..cache.addressing import SeqChunk
from ..cache.step_rows import StepRows

_REQUEST, _NUM_TOKENS, _NUM_LOGITS = attrgetter("request"), attrgetter("num_tokens"), attrgetter("num_logits")
_COMPUTED, _OUTPUT, _ID, _IMAGES = (attrgetter("num_computed"), attrgetter("output_token_ids"),
                                    attrgetter("request_id"), attrgetter("images"))
_PROMPT = attrgetter("prompt_token_ids")
_PENDING, _PENDING_ROW = attrgetter("num_pending"), attrgetter("pending_row")
_PROMPT_LOGPROBS = attrgetter("params.prompt_logprobs")
_SLOT, _PAGES, _SWA = attrgetter("slot"), attrgetter("pages"), attrgetter("swa_pages")
_LAST = itemgetter(-1)


def gather_rows(chunks: list, records: dict, seq_chunk: Callable[[object], SeqChunk]
                ) -> tuple[StepRows, np.ndarray, np.ndarray] | None:
    """(the step's rows, token rows still on the device [P], their rows in the step in flight's
    sampled tokens [P]) for the scheduled chunks, or None when no chunk is a decode row (a
    prefill step: the SeqChunk path). `records`: the cache manager's records by request id;
    `seq_chunk`: the runner's SeqChunk of any other chunk."""
    R = len(chunks)
    reqs = list(map(_REQUEST, chunks))
    n = np.fromiter(map(_NUM_TOKENS, chunks), np.int64, R)
    starts = np.fromiter(map(_COMPUTED, reqs), np.int64, R)
    pending = np.fromiter(map(_PENDING, reqs), np.int64, R)
    outputs = list(map(_OUTPUT, reqs))
    out_len = np.fromiter(map(len, outputs), np.int64, R)
    num_tokens = np.fromiter(map(len, map(_PROMPT, reqs)), np.int64, R) + out_len + pending   # (Request.num_tokens)
    # one token, the last one (start + 1 == num_tokens), known from its outputs or pending
    decode = (n == 1) & (starts + 1 == num_tokens) & ((out_len > 0) | (pending > 0))
    for field, getter in ((chunks, _NUM_LOGITS), (reqs, _PROMPT_LOGPROBS)):   # verify rows, prompt logprobs
        if not all(map(is_, map(getter, field), repeat(None))):
            decode &= np.fromiter(map(is_, map(getter, field), repeat(None)), bool, R)
    if any(map(_IMAGES, reqs)):
        decode &= np.fromiter(map(not_, map(_IMAGES, reqs)), bool, R)
    if not decode.any():
        return None
    held = list(map(records.__getitem__, map(_ID, reqs)))
    offs = np.cumsum(n) - n
    token_ids = np.zeros(int(n.sum()), np.int64)
    logits = decode.astype(np.int64)
    dec = decode.tolist()
    if (pending[decode] > 1).any():
        i = int(np.nonzero(decode & (pending > 1))[0][0])
        raise RuntimeError(f"request {reqs[i].request_id}: tokens up to {starts[i] + 1} scheduled, "
                           f"{starts[i] + 1 - pending[i]} known and {pending[i]} pending")
    on_device = decode & (pending > 0)
    known = (decode & ~on_device).tolist()
    token_ids[offs[decode & ~on_device]] = np.fromiter(map(_LAST, [o for o, k in zip(outputs, known) if k]), np.int64)
    dst, src = [offs[on_device]], [np.fromiter(map(_PENDING_ROW, [r for r, p in zip(reqs, on_device.tolist()) if p]),
                                               np.int64)]
    stage, images = None, None
    for i in (i for i, d in enumerate(dec) if not d):       # prefill / verify chunks: as before
        s = seq_chunk(chunks[i])
        token_ids[offs[i]:offs[i] + n[i]] = s.token_ids
        logits[i] = s.logits
        if s.stage:
            stage = np.zeros(R, np.int64) if stage is None else stage
            stage[i] = s.stage
        if s.images:
            images = [()] * R if images is None else images
            images[i] = s.images
        fill = pending_of(chunks[i], s, int(offs[i]))
        if fill is not None:
            dst.append(np.array([fill[0]]))
            src.append(np.array([fill[1]]))
    rows = StepRows(slots=np.fromiter(map(_SLOT, held), np.int64, R), starts=starts, lens=n, logits=logits,
                    token_ids=token_ids, page_tables=list(map(_PAGES, held)), swa_tables=list(map(_SWA, held)),
                    stage=stage, images=images)
    dst, src = np.concatenate(dst), np.concatenate(src)
    order = np.argsort(dst, kind="stable")
    return rows, dst[order], src[order]


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
