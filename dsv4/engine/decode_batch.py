"""The ForwardBatch of a decode-only step (one token per sequence), built with numpy straight
into the padded shapes of its CUDA graph.

Equal to `batch.build_forward_batch` of the same chunks, padded as DESIGN §5 says: rows
beyond the real batch write to the pools' scratch page / SWA page / ring slot and read
nothing (−1). A decode step's host time is part of every output token's latency, and a few
dozen small torch CPU ops cost more than the numpy here (tests/engine/test_decode_batch.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout
from ..config import CSA_RATIO, HCA_RATIO
from ..model.forward_batch import CompressPlan, ForwardBatch
from .batch import SeqChunk


@dataclass(frozen=True)
class Scratch:
    """Where padding rows write: a history page, an SWA page and a ring slot nobody reads."""
    page: int
    swa_page: int
    slot: int


def decode_widths(chunks: list[SeqChunk]) -> tuple[int, int]:
    """(E4, E128): causal entries of the step's furthest position."""
    top = max(c.start for c in chunks) + 1
    return top // CSA_RATIO, top // HCA_RATIO


def build_decode_batch(chunks: list[SeqChunk], layout: CacheLayout, ring_slots: int,
                       shape: tuple[int, int, int] | None = None, scratch: Scratch | None = None) -> ForwardBatch:
    """chunks: one token each. shape (B, E4, E128) >= the real sizes (default: exact)."""
    R = len(chunks)
    B, E4, E128 = shape if shape is not None else (R, *decode_widths(chunks))
    G = B if shape is not None else None        # plans: padded to B rows, or exactly the closing groups
    scratch = scratch or Scratch(0, 0, 0)
    pos = np.fromiter((c.start for c in chunks), np.int64, R)
    slots = np.fromiter((c.slot for c in chunks), np.int64, R)
    pages, swa = _table([c.page_table for c in chunks]), _table([c.swa_table for c in chunks])
    _check_history(pages, pos)
    rows = np.arange(R)
    W = layout.cfg.sliding_window
    window = pos[:, None] - W + 1 + np.arange(W)[None, :]                    # [R, W] positions
    return ForwardBatch(
        token_ids=_rows(np.fromiter((c.token_ids[0] for c in chunks), np.int64, R), B, 0),
        positions=_rows(pos, B, 0),
        swa_write=_rows(_swa(swa, rows, pos), B, scratch.swa_page * SWA_PAGE_TOKENS),
        swa_idx=_rows(_masked_swa(swa, window), B, -1),
        c4_cand=_rows(_entries(pages, pos, CSA_RATIO, E4), B, -1),
        c128_idx=_rows(_entries(pages, pos, HCA_RATIO, E128), B, -1),
        csa=_plan(pages, pos, slots, CSA_RATIO, True, layout.csa_ring, ring_slots, G, scratch),
        hca=_plan(pages, pos, slots, HCA_RATIO, False, layout.hca_ring, ring_slots, G, scratch),
        logits_rows=torch.arange(B), seq_lens=(1,) * B)


def _table(tables: list[list[int]]) -> np.ndarray:
    out = np.full((len(tables), max([len(t) for t in tables] + [1])), -1, np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def _check_history(pages: np.ndarray, pos: np.ndarray) -> None:
    """Every history page up to each token must be held."""
    needed = -(-(pos + 1) // PAGE_TOKENS)
    held = np.arange(pages.shape[1])[None, :] < needed[:, None]
    if (needed > pages.shape[1]).any() or (held & (pages < 0)).any():
        raise RuntimeError(f"history page missing: positions {pos.tolist()} need {needed.tolist()} pages")


def _lookup(table: np.ndarray, rows: np.ndarray, logical: np.ndarray, what: str) -> np.ndarray:
    if logical.size and int(logical.max()) >= table.shape[1]:
        raise RuntimeError(f"{what} page table too short: needs logical page {int(logical.max())}")
    phys = table[rows, logical]
    if (phys < 0).any():
        raise RuntimeError(f"{what} page missing for a position the step reads or writes")
    return phys


def _swa(swa: np.ndarray, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return _lookup(swa, rows, pos // SWA_PAGE_TOKENS, "SWA") * SWA_PAGE_TOKENS + pos % SWA_PAGE_TOKENS


def _masked_swa(swa: np.ndarray, window: np.ndarray) -> np.ndarray:
    valid = window >= 0
    r = np.broadcast_to(np.arange(window.shape[0])[:, None], window.shape)
    out = np.full(window.shape, -1, np.int64)
    out[valid] = _swa(swa, r[valid], window[valid])
    return out


def _entries(pages: np.ndarray, pos: np.ndarray, ratio: int, width: int) -> np.ndarray:
    """[R, width] slots of entries e < (p+1)//ratio, -1 beyond."""
    per_page = PAGE_TOKENS // ratio
    e = np.arange(width)[None, :]
    logical = np.minimum(e // per_page, pages.shape[1] - 1)
    phys = np.take_along_axis(pages, np.broadcast_to(logical, (len(pos), width)), axis=1)
    return np.where(e < ((pos + 1) // ratio)[:, None], phys * per_page + e % per_page, -1)


def _plan(pages, pos, slots, ratio, overlap, cap, ring_slots, B, scratch: Scratch) -> CompressPlan:
    """Groups closing at the step's tokens: a decode token is its chunk's start, so a group's
    positions before it come from the ring and the token itself is fresh row ring_rows + i."""
    per_page, ring_rows = PAGE_TOKENS // ratio, ring_slots * cap
    closing = np.nonzero((pos + 1) % ratio == 0)[0]
    e = (pos[closing] + 1) // ratio - 1
    entry_slot = _lookup(pages, closing, e // per_page, "history") * per_page + e % per_page
    q = (e * ratio)[:, None] + np.arange(-ratio if overlap else 0, ratio)[None, :]
    start = pos[closing][:, None]
    rows = np.where(q < 0, -1, np.where(q >= start, ring_rows + closing[:, None] + (q - start),
                                        slots[closing][:, None] * cap + q % cap))
    ring = B if B is not None else len(pos)
    return CompressPlan(
        rows=_rows(rows, B, -1), entry_slot=_rows(entry_slot, B, scratch.page * per_page),
        entry_pos=_rows(e * ratio, B, 0), ring_dst=_rows(slots * cap + pos % cap, ring, scratch.slot * cap),
        ring_src=_rows(np.arange(len(pos)), ring, 0), ring_rows=ring_rows)


def _rows(a: np.ndarray, rows: int | None, fill: int) -> torch.Tensor:
    """a padded to `rows` rows (None: as many as it has) with `fill`."""
    out = np.full((rows if rows is not None else a.shape[0], *a.shape[1:]), fill, np.int64)
    out[:a.shape[0]] = a
    return torch.from_numpy(out)
