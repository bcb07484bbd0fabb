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
from itertools import compress, repeat
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
# steps of fewer chunks take the SeqChunk path: the gather's ~25 us of numpy calls a step cost
# more than a SeqChunk a chunk below ~30 chunks (CPU, c4 29 against 6 us; c256 240 against 630)
GATHER_MIN_ROWS = 32


def gather_rows(chunks: list, records: dict, seq_chunk: Callable[[object], SeqChunk]
                ) -> tuple[StepRows, np.ndarray, np.ndarray] | None:
    """(the step's rows, token rows still on the device [P], their rows in the step in flight's
    sampled tokens [P], by token row) for the scheduled chunks, or None when no chunk is a
    decode row (a prefill step: the SeqChunk path). `records`: the cache manager's records by
    request id; `seq_chunk`: the runner's SeqChunk of any other chunk."""
    R = len(chunks)
    reqs = list(map(_REQUEST, chunks))
    n = np.fromiter(map(_NUM_TOKENS, chunks), np.int64, R)
    starts = np.fromiter(map(_COMPUTED, reqs), np.int64, R)
    pending = np.fromiter(map(_PENDING, reqs), np.int64, R)
    outputs = list(map(_OUTPUT, reqs))
    decode = _decode_rows(chunks, reqs, n, starts, pending, outputs)
    if not decode.any():
        return None
    if (pending[decode] > 1).any():
        i = int(np.nonzero(decode & (pending > 1))[0][0])
        raise RuntimeError(f"request {reqs[i].request_id}: tokens up to {starts[i] + 1} scheduled, "
                           f"{starts[i] + 1 - pending[i]} known and {pending[i]} pending")
    held = list(map(records.__getitem__, map(_ID, reqs)))
    rows = StepRows(slots=np.fromiter(map(_SLOT, held), np.int64, R), starts=starts, lens=n,
                    logits=decode.astype(np.int64), token_ids=np.zeros(int(n.sum()), np.int64),
                    page_tables=list(map(_PAGES, held)), swa_tables=list(map(_SWA, held)))
    offs = np.cumsum(n) - n
    on_device, known = decode & (pending > 0), decode & (pending == 0)
    rows.token_ids[offs[known]] = np.fromiter(map(_LAST, compress(outputs, known.tolist())), np.int64)
    dst = [offs[on_device]]
    src = [np.fromiter(map(_PENDING_ROW, compress(reqs, on_device.tolist())), np.int64)]
    for i in np.nonzero(~decode)[0].tolist():           # prefill / verify chunks: as before
        fill = _add_chunk(rows, i, int(offs[i]), chunks[i], seq_chunk(chunks[i]))
        if fill is not None:
            dst.append(np.array([fill[0]]))
            src.append(np.array([fill[1]]))
    dst, src = np.concatenate(dst), np.concatenate(src)
    order = np.argsort(dst, kind="stable")
    return rows, dst[order], src[order]


def _decode_rows(chunks: list, reqs: list, n: np.ndarray, starts: np.ndarray, pending: np.ndarray,
                 outputs: list[list[int]]) -> np.ndarray:
    """[R] bool: the chunks that are decode rows: one token, the request's last (start + 1 ==
    num_tokens), known from its outputs or pending, not a verify chunk, of a request with no
    prompt logprobs and no images."""
    R = len(chunks)
    out_len = np.fromiter(map(len, outputs), np.int64, R)
    num_tokens = np.fromiter(map(len, map(_PROMPT, reqs)), np.int64, R) + out_len + pending   # (Request.num_tokens)
    decode = (n == 1) & (starts + 1 == num_tokens) & ((out_len > 0) | (pending > 0))
    for items, getter in ((chunks, _NUM_LOGITS), (reqs, _PROMPT_LOGPROBS)):
        if not all(map(is_, map(getter, items), repeat(None))):
            decode &= np.fromiter(map(is_, map(getter, items), repeat(None)), bool, R)
    if any(map(_IMAGES, reqs)):
        decode &= np.fromiter(map(not_, map(_IMAGES, reqs)), bool, R)
    return decode


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
