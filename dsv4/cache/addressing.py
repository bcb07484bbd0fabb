"""A step's cache addressing: the ForwardBatch of the sequences scheduled in a step, built from
their page tables in O(tokens + pages) (docs/architecture.md, "Cache").

One definition, in numpy, for every step: prefill chunks, decode tokens, k + 1 verify tokens,
mixed. `shape` pads it to the fixed sizes of a CUDA graph: rows past the real ones read
nothing (empty ranges, -1 group rows) and write to the storage's scratch page, SWA page and
ring slot. Reads are PagedRows (per-token ranges looked up in the page tables by the kernels),
never [tokens x entries] tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import CSA_RATIO, HCA_RATIO
from ..model.forward_batch import CompressPlan, ForwardBatch
from ..ops.paged import PagedRows
from ..model.vision.visibility import widen_windows
from .batch_tables import PersistentTables
from .layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout
from .step_rows import StepRows, as_rows


@dataclass(slots=True)     # (made per request and step: no instance dict)
class SeqChunk:
    """One sequence's share of a step: tokens [start, start + len(token_ids))."""
    slot: int                     # request state slot (its ring rows)
    start: int                    # absolute position of the first token
    token_ids: list[int]
    page_table: list[int]         # logical 256-token page -> physical page (-1 none)
    swa_table: list[int]          # logical 128-token SWA page -> physical SWA page (-1 freed)
    logits: int = 1               # the last `logits` tokens' logits are wanted
    stage: int = 0                # a page boundary L with start + 4 <= L <= end: its overlap rows [L - 4, L)
                                  # are also written to the CSA rings' staging rows (0: none)
    images: tuple[tuple[int, int], ...] = ()   # image blocks [s, e) inside the chunk: their rows see the
                                               # whole block in the window (dsv4/model/vision/visibility.py)


@dataclass(frozen=True)
class Scratch:
    """Where padding rows write: a history page, an SWA page and a ring slot nobody reads."""
    page: int
    swa_page: int
    slot: int


@dataclass(frozen=True)
class StepShape:
    """The fixed sizes of a padded step: `seqs` sequences of `tokens` tokens each, causal-entry
    widths e4 / e128, and `swa_pages` columns of the sliding-window table."""
    seqs: int
    tokens: int
    e4: int
    e128: int
    swa_pages: int


def step_widths(chunks: list[SeqChunk] | StepRows, window: int) -> tuple[int, int, int]:
    """(E4, E128, SWA table columns) the chunks need: what a StepShape must cover."""
    rows = as_rows(chunks)
    ends = rows.starts + rows.lens
    swa = (ends - 1) // SWA_PAGE_TOKENS - np.maximum(rows.starts - window + 1, 0) // SWA_PAGE_TOKENS + 1
    end = int(ends.max())
    return end // CSA_RATIO, end // HCA_RATIO, int(swa.max())


def build_step(chunks: list[SeqChunk] | StepRows, layout: CacheLayout, ring_slots: int, shape: StepShape | None = None,
               scratch: Scratch | None = None, tables: PersistentTables | None = None) -> ForwardBatch:
    """The step's ForwardBatch on the host (CPU tensors). `ring_slots`: request slots the
    storage's rings have (KVStorage.ring_slots). With `shape`, every chunk must have
    `shape.tokens` tokens and the batch is padded to `shape.seqs` sequences, every row's logits
    kept. With `tables` (synced with every chunk's tables, rows by slot) the page tables are
    gathered from it instead of the chunks' lists: the same batch. `chunks` may be given as
    StepRows (cache/step_rows.py): the same batch again."""
    chunks = as_rows(chunks)
    s = _Seqs.of(chunks)
    W = layout.cfg.sliding_window
    e4, e128, swa_cols = step_widths(chunks, W) if shape is None else (shape.e4, shape.e128, shape.swa_pages)
    rows = shape.seqs if shape is not None else s.R
    T = rows * shape.tokens if shape is not None else s.T
    scratch = scratch or Scratch(0, 0, 0)
    swa_base = np.maximum(s.starts - W + 1, 0) // SWA_PAGE_TOKENS
    if tables is None:
        pages = _table(chunks.page_tables, _history_columns(e4, e128), rows)
        swa = _table([t[b:] for t, b in zip(chunks.swa_tables, swa_base.tolist())], swa_cols, rows)
    else:
        pages = tables.history_rows(s.slots, _history_columns(e4, e128), rows)
        swa = tables.swa_rows(s.slots, swa_base, swa_cols, rows)
    _check_held(s, pages, swa, swa_base, W)
    pos = s.pos
    return ForwardBatch(
        *_swa_part(chunks, s, layout, swa, swa_base, T, scratch),
        c4=_ranges(pages, s, T, 0, (pos + 1) // CSA_RATIO, PAGE_TOKENS // CSA_RATIO, layout.c4_pitch, e4),
        c128=_ranges(_one_item_pages(pages, PAGE_TOKENS // HCA_RATIO, layout.c128_pitch), s, T, 0,
                     (pos + 1) // HCA_RATIO, 1, 1, e128),
        csa=_plan(pages, s, CSA_RATIO, True, (layout.csa_ring, layout.csa_ring_rows), layout.csa_ring_pitch,
                  ring_slots, layout.c4_pitch, T if shape is not None else None, scratch,
                  _staging(chunks, s) if shape is None else None),
        hca=_plan(pages, s, HCA_RATIO, False, (layout.hca_ring, layout.hca_ring), layout.hca_ring_pitch, ring_slots,
                  layout.c128_pitch, T if shape is not None else None, scratch),
        logits_rows=torch.arange(T) if shape is not None else _logits_rows(chunks, s),
        seq_lens=(shape.tokens,) * rows if shape is not None else tuple(s.lens.tolist()))


def build_swa_step(chunks: list[SeqChunk] | StepRows, layout: CacheLayout, shape: StepShape | None = None,
                   scratch: Scratch | None = None) -> ForwardBatch:
    """build_step for a forward whose layers all read only the sliding window (the MTP blocks:
    compress ratio 0, model/mtp.py): token ids, positions, SWA writes and reads exactly as
    build_step makes them; the compressed-entry reads and plans empty (none is read). About
    half build_step's host time; `shape` pads as there (its e4 / e128 are not used)."""
    chunks = as_rows(chunks)
    s = _Seqs.of(chunks)
    W = layout.cfg.sliding_window
    swa_cols = step_widths(chunks, W)[2] if shape is None else shape.swa_pages
    rows = shape.seqs if shape is not None else s.R
    T = rows * shape.tokens if shape is not None else s.T
    scratch = scratch or Scratch(0, 0, 0)
    swa_base = np.maximum(s.starts - W + 1, 0) // SWA_PAGE_TOKENS
    swa = _table([t[b:] for t, b in zip(chunks.swa_tables, swa_base.tolist())], swa_cols, rows)
    _check_swa_held(s, swa, swa_base, W)
    return _swa_only_batch(*_swa_part(chunks, s, layout, swa, swa_base, T, scratch),
                           logits_rows=torch.arange(T) if shape is not None else _logits_rows(chunks, s),
                           seq_lens=(shape.tokens,) * rows if shape is not None else tuple(s.lens.tolist()))


def swa_batch(rows: tuple[np.ndarray, ...], shape: StepShape, layout: CacheLayout) -> ForwardBatch:
    """The padded SWA-only ForwardBatch (CPU tensors sharing `rows`' memory) of one group's
    swa_step_rows."""
    token_ids, positions, swa_write, pages, req, lo, hi = map(torch.from_numpy, rows)
    reads = PagedRows(pages, req, lo, hi, per_page=SWA_PAGE_TOKENS, pitch=layout.swa_pitch,
                      width=layout.cfg.sliding_window)
    return _swa_only_batch(token_ids, positions, swa_write, reads, logits_rows=torch.arange(shape.seqs * shape.tokens),
                           seq_lens=(shape.tokens,) * shape.seqs)


def swa_step_rows(groups: list[list[SeqChunk]], layout: CacheLayout, shapes: list[StepShape],
                  scratch: Scratch) -> list[tuple[np.ndarray, ...]]:
    """What differs between the SWA-only batches (build_swa_step) of one shape, for each group
    padded to its shape, in one numpy pass over all the groups' chunks (the MTP draft graph's
    catch-up and chain steps: one build a draft, not one a forward): per group, int64 (token_ids
    [T], positions [T], swa_write [T], SWA pages [seqs, swa_pages], req [T], lo [T], hi [T]) as
    the ForwardBatch and its `swa` PagedRows hold them. Every chunk of groups[i] has
    shapes[i].tokens tokens; no chunk has images."""
    chunks = StepRows.of([c for g in groups for c in g])
    assert chunks.images is None
    s, W, pitch = _Seqs.of(chunks), layout.cfg.sliding_window, layout.swa_pitch
    swa_base = np.maximum(s.starts - W + 1, 0) // SWA_PAGE_TOKENS
    swa = _table([t[b:] for t, b in zip(chunks.swa_tables, swa_base.tolist())], max(h.swa_pages for h in shapes), s.R)
    _check_swa_held(s, swa, swa_base, W, np.repeat([h.swa_pages for h in shapes], [len(g) for g in groups]))
    pos, shift = s.pos, (swa_base * SWA_PAGE_TOKENS)[s.req]
    swa_write = swa[s.req, (pos - shift) // SWA_PAGE_TOKENS] * pitch + pos % SWA_PAGE_TOKENS
    lo, hi = np.maximum(pos - W + 1, 0) - shift, pos + 1 - shift
    tokens = chunks.token_ids
    out, r0, t0 = [], 0, 0
    for g, shape in zip(groups, shapes):
        R, T = len(g), shape.seqs * shape.tokens
        ts = slice(t0, t0 + R * shape.tokens)
        table = np.full((shape.seqs, shape.swa_pages), -1, np.int64)
        table[:R] = swa[r0:r0 + R, :shape.swa_pages]
        out.append((_pad_rows(tokens[ts], T, 0), _pad_rows(pos[ts], T, 0),
                    _pad_rows(swa_write[ts], T, scratch.swa_page * pitch), table,
                    _pad_rows(s.req[ts] - r0, T, 0), _pad_rows(lo[ts], T, 0), _pad_rows(hi[ts], T, 0)))
        r0, t0 = r0 + R, t0 + R * shape.tokens
    return out


def _pad_rows(a: np.ndarray, rows: int, fill: int) -> np.ndarray:
    """a [n] int64 -> [rows], the rows past n set to `fill`."""
    out = np.full(rows, fill, np.int64)
    out[:len(a)] = a
    return out


def padded_leaf_shapes(shape: StepShape) -> list[tuple[int, ...]]:
    """The shapes of the tensors (all int64) of `build_step`'s batch padded to `shape`, T =
    seqs x tokens: token ids, positions, SWA writes, the logits rows and each read's req / lo /
    hi are [T]; each plan's entry slot, entry position, ring destination and source [T] and its
    groups [T, span]; the page tables [seqs, columns]. What a CUDA graph's static inputs hold
    (engine/cuda_graphs.py), known without building a step."""
    B, T = shape.seqs, shape.seqs * shape.tokens
    columns = _history_columns(shape.e4, shape.e128)
    tables = [(B, shape.swa_pages), (B, columns), (B, columns * (PAGE_TOKENS // HCA_RATIO))]
    plans = [(T, 2 * CSA_RATIO), (T, HCA_RATIO)]
    return [(T,)] * (3 + 3 * 3 + 2 * 4 + 1) + tables + plans


def _swa_only_batch(token_ids, positions, swa_write, swa: PagedRows, logits_rows: torch.Tensor,
                    seq_lens: tuple[int, ...]) -> ForwardBatch:
    """A ForwardBatch whose compressed-entry reads are empty and whose plans close no group."""
    rows, T = swa.pages.shape[0], token_ids.shape[0]
    none = PagedRows(pages=torch.full((rows, 1), -1), req=torch.zeros(T, dtype=torch.long),
                     lo=torch.zeros(T, dtype=torch.long), hi=torch.zeros(T, dtype=torch.long),
                     per_page=1, pitch=1, width=0)
    return ForwardBatch(token_ids, positions, swa_write, swa, c4=none, c128=none, csa=_no_plan(2 * CSA_RATIO),
                        hca=_no_plan(HCA_RATIO), logits_rows=logits_rows, seq_lens=seq_lens)


def _swa_part(chunks: StepRows, s: "_Seqs", layout: CacheLayout, swa: np.ndarray, swa_base: np.ndarray,
              T: int, scratch: Scratch) -> tuple:
    """(token_ids, positions, swa_write, swa) of a ForwardBatch, padded to T rows."""
    W = layout.cfg.sliding_window
    pos, shift = s.pos, (swa_base * SWA_PAGE_TOKENS)[s.req]
    swa_write = swa[s.req, (pos - shift) // SWA_PAGE_TOKENS] * layout.swa_pitch + pos % SWA_PAGE_TOKENS
    lo, hi, width = np.maximum(pos - W + 1, 0), pos + 1, W
    if chunks.images is not None:
        width = max(W, widen_windows(pos, lo, hi, s.offs, s.starts, chunks.images))
    return (_pad(chunks.token_ids, T, 0), _pad(pos, T, 0),
            _pad(swa_write, T, scratch.swa_page * layout.swa_pitch),
            _ranges(swa, s, T, lo - shift, hi - shift, SWA_PAGE_TOKENS, layout.swa_pitch, width))


def _no_plan(span: int) -> CompressPlan:
    """A CompressPlan closing no group and keeping no ring row."""
    empty = torch.zeros(0, dtype=torch.long)
    return CompressPlan(rows=torch.zeros((0, span), dtype=torch.long), entry_slot=empty, entry_pos=empty,
                        ring_dst=empty, ring_src=empty, ring_rows=0)


@dataclass(frozen=True)
class _Seqs:
    R: int
    T: int
    lens: np.ndarray      # [R] tokens of each sequence
    starts: np.ndarray    # [R] first position
    slots: np.ndarray     # [R] request slot
    offs: np.ndarray      # [R] first token row
    req: np.ndarray       # [T] sequence of each token
    pos: np.ndarray       # [T] absolute position of each token
    tok_end: np.ndarray   # [T] one past the last position of each token's sequence

    @classmethod
    def of(cls, rows: StepRows) -> "_Seqs":
        R, lens, starts = len(rows), rows.lens, rows.starts
        offs = np.cumsum(lens) - lens
        T = int(offs[-1] + lens[-1]) if R else 0
        req = np.repeat(np.arange(R), lens)
        pos = starts[req] + np.arange(T) - offs[req]
        return cls(R, T, lens, starts, rows.slots, offs, req, pos, (starts + lens)[req])


def _history_columns(e4: int, e128: int) -> int:
    """Page-table columns that cover every entry e < e4 (64 a page) and e < e128 (2 a page)."""
    per4, per128 = PAGE_TOKENS // CSA_RATIO, PAGE_TOKENS // HCA_RATIO
    return max(-(-e4 // per4), -(-e128 // per128), 1)


def _table(tables: list[list[int]], columns: int, rows: int) -> np.ndarray:
    out = np.full((rows, columns), -1, np.int64)
    for i, t in enumerate(tables):
        n = min(len(t), columns)
        out[i, :n] = t[:n]
    return out


def _one_item_pages(pages: np.ndarray, per_page: int, pitch: int) -> np.ndarray:
    """[R, columns * per_page]: the row of every item of the table's pages (-1 where the page
    is). HCA's 2-entry pages are read this way: the kernels then load one contiguous table row
    per block instead of a page id per pair of entries (measured faster on the H200,
    docs/benchmarks.md)."""
    phys = np.repeat(pages, per_page, axis=1)                # (2.7x the gather's speed at 1M context)
    out = phys * pitch
    out += np.tile(np.arange(per_page), pages.shape[1])
    out[phys < 0] = -1
    return out


def _check_held(s: _Seqs, pages: np.ndarray, swa: np.ndarray, swa_base: np.ndarray, W: int) -> None:
    """Every history page up to each chunk's end and every SWA page its tokens write or their
    windows read must be held (O(R x columns))."""
    ends = s.starts + s.lens
    need = np.maximum(-(-(ends // CSA_RATIO) // (PAGE_TOKENS // CSA_RATIO)),
                      -(-(ends // HCA_RATIO) // (PAGE_TOKENS // HCA_RATIO)))
    if (need > pages.shape[1]).any() or ((np.arange(pages.shape[1]) < need[:, None]) & (pages[:s.R] < 0)).any():
        raise RuntimeError(f"history page missing: sequences ending at {ends.tolist()} need {need.tolist()} "
                           f"pages, tables {pages[:s.R].tolist()}")
    _check_swa_held(s, swa, swa_base, W)


def _check_swa_held(s: _Seqs, swa: np.ndarray, swa_base: np.ndarray, W: int, columns=None) -> None:
    """Every SWA page the chunks' tokens write or their windows read must be held, within the
    first `columns` columns of each chunk's table row (default: all)."""
    ends = s.starts + s.lens
    swa_need = (ends - 1) // SWA_PAGE_TOKENS - swa_base + 1
    held = (np.arange(swa.shape[1]) < swa_need[:, None]) & (swa[:s.R] >= 0)
    if (swa_need > (swa.shape[1] if columns is None else columns)).any() or (held.sum(1) < swa_need).any():
        raise RuntimeError(f"SWA page missing for a position the step reads or writes: positions from "
                           f"{s.starts.tolist()} to {ends.tolist()}, window {W}, tables {swa[:s.R].tolist()}")


def _ranges(table: np.ndarray, s: _Seqs, T: int, lo, hi: np.ndarray, per_page: int, pitch: int,
            width: int) -> PagedRows:
    lo = lo if isinstance(lo, np.ndarray) else np.full(hi.shape, lo, np.int64)
    return PagedRows(pages=torch.from_numpy(table), req=_pad(s.req, T, 0), lo=_pad(lo, T, 0), hi=_pad(hi, T, 0),
                     per_page=per_page, pitch=pitch, width=width)


def _staging(chunks: StepRows, s: _Seqs) -> tuple[np.ndarray, np.ndarray]:
    """(token rows, staging row j) of the overlap positions [L - 4, L) of each chunk's `stage` L."""
    if chunks.stage is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    tokens, rows = [], []
    for i in np.nonzero(chunks.stage)[0].tolist():
        stage, start, n = int(chunks.stage[i]), int(s.starts[i]), int(s.lens[i])
        assert start + CSA_RATIO <= stage <= start + n, (start, stage)
        tokens.append(s.offs[i] + stage - CSA_RATIO - start + np.arange(CSA_RATIO))
        rows.append(np.full(CSA_RATIO, i))
    return np.concatenate(tokens), np.concatenate(rows)


def _plan(pages: np.ndarray, s: _Seqs, ratio: int, overlap: bool, ring: tuple[int, int], ring_pitch: int,
          ring_slots: int, entry_pitch: int, padded: int | None, scratch: Scratch,
          staging: tuple[np.ndarray, np.ndarray] | None = None) -> CompressPlan:
    """Groups of `ratio` closing at the step's tokens, and the rows the ring keeps: the tail, and
    the `staging` token rows (to the rows after the positional ones, in order).

    ring = (cap, rows per slot): position p of slot u is ring row u * ring_pitch + p % cap
    (storage.py). Rows of a group index cat(ring view, the step's fresh projections): ring rows
    first, then fresh token t at ring_rows + t."""
    cap, slot_rows = ring
    ring_rows = (ring_slots - 1) * ring_pitch + slot_rows
    rows, entry_slot, entry_pos = _groups(pages, s, ratio, overlap, cap, ring_pitch, ring_rows, entry_pitch)
    keep = np.nonzero(s.pos >= s.tok_end - cap)[0]
    ring_dst = s.slots[s.req[keep]] * ring_pitch + s.pos[keep] % cap
    if staging is not None and len(staging[0]):
        tokens, seqs = staging
        staged = s.slots[seqs] * ring_pitch + cap + np.arange(len(tokens)) % CSA_RATIO
        keep, ring_dst = np.concatenate([keep, tokens]), np.concatenate([ring_dst, staged])
    return CompressPlan(rows=_pad(rows, padded, -1), entry_slot=_pad(entry_slot, padded, scratch.page * entry_pitch),
                        entry_pos=_pad(entry_pos, padded, 0),
                        ring_dst=_pad(ring_dst, padded, scratch.slot * ring_pitch),
                        ring_src=_pad(keep, padded, 0), ring_rows=ring_rows)


def _groups(pages: np.ndarray, s: _Seqs, ratio: int, overlap: bool, cap: int, ring_pitch: int, ring_rows: int,
            entry_pitch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows [G, span], entry slot [G], first position [G]) of the G groups closing at the
    step's tokens (span = 2 * ratio with the overlap, else ratio)."""
    closing = np.nonzero(s.pos % ratio == ratio - 1)[0]
    if not len(closing):                    # most decode steps of a ratio-128 plan: nothing to index
        return np.zeros((0, 2 * ratio if overlap else ratio), np.int64), closing, closing
    per_page = PAGE_TOKENS // ratio
    r, e = s.req[closing], s.pos[closing] // ratio
    entry_slot = pages[r, e // per_page] * entry_pitch + e % per_page
    q = (e * ratio)[:, None] + np.arange(-ratio if overlap else 0, ratio)[None, :]     # [G, span] positions
    start = s.starts[r][:, None]
    fresh = ring_rows + s.offs[r][:, None] + (q - start)
    rows = np.where(q < 0, -1, np.where(q >= start, fresh, s.slots[r][:, None] * ring_pitch + q % cap))
    return rows, entry_slot, e * ratio


def _logits_rows(chunks: StepRows, s: _Seqs) -> torch.Tensor:
    wanted = chunks.logits
    ends = s.offs + s.lens
    return torch.from_numpy(np.repeat(ends - wanted, wanted) + np.arange(int(wanted.sum()))
                            - np.repeat(np.cumsum(wanted) - wanted, wanted))


def _pad(a: np.ndarray, rows: int | None, fill: int) -> torch.Tensor:
    """a (int64) padded to `rows` rows (None: as many as it has) with `fill`."""
    if rows is None or rows == len(a):                 # nothing to pad (a full bucket): one copy
        return torch.from_numpy(np.array(a, np.int64))
    a = np.asarray(a, np.int64)
    out = np.full((rows, *a.shape[1:]), fill, np.int64)
    out[:a.shape[0]] = a
    return torch.from_numpy(out)
