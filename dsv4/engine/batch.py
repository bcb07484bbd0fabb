"""Build the per-step `ForwardBatch` from the sequences scheduled in a step.

Vectorised over tokens (no Python loop over tokens); one short loop over sequences to pad
their page tables. Built on the CPU, then moved to the device in one transfer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout
from ..config import CSA_RATIO, HCA_RATIO
from ..model.forward_batch import CompressPlan, ForwardBatch
from .upload import HostToDevice, upload_tree


@dataclass
class SeqChunk:
    """One sequence's share of a step: tokens [start, start + len(token_ids))."""
    slot: int                     # request state slot (its ring rows)
    start: int                    # absolute position of the first token
    token_ids: list[int]
    page_table: list[int]         # logical 256-token page -> physical page (-1 none)
    swa_table: list[int]          # logical 128-token SWA page -> physical SWA page (-1 freed)
    logits: str = "last"          # "last", "all" or "none"
    extra: dict = field(default_factory=dict)


def build_forward_batch(chunks: list[SeqChunk], layout: CacheLayout, ring_slots: int,
                        device, h2d: HostToDevice | None = None) -> ForwardBatch:
    """`ring_slots`: request slots the pools' rings have (KVPools.ring_slots). The index
    tensors are built on the CPU and cross to `device` in one transfer (through `h2d`)."""
    lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.long)
    starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
    slots = torch.tensor([c.slot for c in chunks], dtype=torch.long)
    offs = torch.cumsum(lens, 0) - lens
    req = torch.repeat_interleave(torch.arange(len(chunks)), lens)
    pos = starts[req] + torch.arange(int(lens.sum())) - offs[req]
    pages = _pad([c.page_table for c in chunks])
    swa_pages = _pad([c.swa_table for c in chunks])
    W = layout.cfg.sliding_window
    _check_pages(chunks, W)
    seq = _Seqs(req, pos, starts, starts + lens, offs, slots)
    host = (torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long), pos,
            _compress_plan(pages, seq, CSA_RATIO, True, layout.csa_ring, ring_slots),
            _compress_plan(pages, seq, HCA_RATIO, False, layout.hca_ring, ring_slots),
            _logits_rows(chunks, offs, lens), pages, swa_pages, req)
    token_ids, pos_d, csa, hca, rows, pages_d, swa_d, req_d = upload_tree(
        host, h2d if h2d is not None else HostToDevice(device))
    # the [T, W] and [T, E] tables are the large ones: built where the step runs
    max_pos = int(pos.max()) if pos.numel() else 0
    return ForwardBatch(
        token_ids=token_ids, positions=pos_d, swa_write=_swa_slots(swa_d, req_d, pos_d),
        swa_idx=_swa_window(swa_d, req_d, pos_d, W),
        c4_cand=_causal_entries(pages_d, req_d, pos_d, CSA_RATIO, max_pos),
        c128_idx=_causal_entries(pages_d, req_d, pos_d, HCA_RATIO, max_pos),
        csa=csa, hca=hca, logits_rows=rows, seq_lens=tuple(lens.tolist()))


@dataclass
class _Seqs:
    req: torch.Tensor     # [T] sequence of each token
    pos: torch.Tensor     # [T] absolute position of each token
    starts: torch.Tensor  # [R]
    ends: torch.Tensor    # [R]
    offs: torch.Tensor    # [R] first token row of each sequence
    slots: torch.Tensor   # [R]


def _pad(tables: list[list[int]]) -> torch.Tensor:
    width = max([len(t) for t in tables] + [1])
    out = torch.full((len(tables), width), -1, dtype=torch.long)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    return out


def _lookup(table: torch.Tensor, req: torch.Tensor, logical: torch.Tensor, what: str) -> torch.Tensor:
    if logical.numel() and int(logical.max()) >= table.shape[1]:
        raise RuntimeError(f"{what} page table too short: needs logical page {int(logical.max())}")
    phys = table[req, logical]
    if (phys < 0).any():
        raise RuntimeError(f"{what} page missing for a position the step reads or writes")
    return phys


def _swa_slots(swa_pages, req, pos):
    return swa_pages[req, pos // SWA_PAGE_TOKENS] * SWA_PAGE_TOKENS + pos % SWA_PAGE_TOKENS


def _swa_window(swa_pages, req, pos, W):
    """[T, W] SWA slots of positions (p-W, p], -1 before position 0."""
    q = pos[:, None] - W + 1 + torch.arange(W, device=pos.device)[None, :]
    qc = q.clamp(min=0)
    return torch.where(q >= 0, _swa_slots(swa_pages, req[:, None], qc), -1)


def _check_pages(chunks: list[SeqChunk], W: int) -> None:
    """Every history page up to each chunk's end, and every SWA page its tokens write or
    their windows read, must be held (checked per sequence, O(R) on the host)."""
    for c in chunks:
        end = c.start + len(c.token_ids)
        needed = -(-end // PAGE_TOKENS)
        if len(c.page_table) < needed or any(p < 0 for p in c.page_table[:needed]):
            raise RuntimeError(f"history page missing: positions up to {end} need "
                               f"{needed} pages, table {c.page_table[:needed]}")
        first, last = max(c.start - W + 1, 0) // SWA_PAGE_TOKENS, (end - 1) // SWA_PAGE_TOKENS
        if len(c.swa_table) <= last or any(p < 0 for p in c.swa_table[first:last + 1]):
            raise RuntimeError(f"SWA page missing for a position the step reads or writes: positions "
                               f"[{c.start}, {end}) window {W}, SWA table {c.swa_table[first:last + 1]}")


def _causal_entries(pages, req, pos, ratio, max_pos: int):
    """[T, E] slots of entries e < (p+1)//ratio, -1 beyond; E from the largest position
    (known on the CPU, so building this on the device needs no host sync)."""
    per_page = PAGE_TOKENS // ratio
    width = (max_pos + 1) // ratio
    e = torch.arange(width, device=pos.device)[None, :]
    valid = e < ((pos + 1) // ratio)[:, None]
    phys = pages[req[:, None], (e // per_page).clamp(max=pages.shape[1] - 1)]
    return torch.where(valid, phys * per_page + e % per_page, -1)


def _compress_plan(pages, s: _Seqs, ratio, overlap, cap, ring_slots) -> CompressPlan:
    per_page = PAGE_TOKENS // ratio
    tok = torch.nonzero((s.pos + 1) % ratio == 0).flatten()
    r = s.req[tok]
    e = (s.pos[tok] + 1) // ratio - 1
    entry_slot = _lookup(pages, r, e // per_page, "history") * per_page + e % per_page
    ring_rows = ring_slots * cap
    span = torch.arange(-ratio if overlap else 0, ratio)
    q = (e * ratio)[:, None] + span[None, :]                               # [G, span] positions
    start = s.starts[r][:, None]
    fresh_row = ring_rows + s.offs[r][:, None] + (q - start)
    ring_row = s.slots[r][:, None] * cap + q % cap
    rows = torch.where(q < 0, -1, torch.where(q >= start, fresh_row, ring_row))
    keep = torch.nonzero(s.pos >= s.ends[s.req] - cap).flatten()          # tail rows the ring keeps
    ring_dst = s.slots[s.req[keep]] * cap + s.pos[keep] % cap
    return CompressPlan(rows=rows, entry_slot=entry_slot, entry_pos=e * ratio, ring_dst=ring_dst,
                        ring_src=keep, ring_rows=ring_rows)


def _logits_rows(chunks, offs, lens):
    rows = []
    for c, o, n in zip(chunks, offs.tolist(), lens.tolist()):
        if c.logits == "all":
            rows.extend(range(o, o + n))
        elif c.logits == "last":
            rows.append(o + n - 1)
    return torch.tensor(rows, dtype=torch.long)
