"""A request's state at an arbitrary prompt end, as bytes (docs/architecture.md, "Disaggregation").

Resuming a request at any L (not only a page boundary, unlike cache/checkpoint.py) needs:
  * the history pages of logical pages [0, ceil(L / 256)): whole `KVStorage.page` blocks of
    the C4, indexer-key and C128 kinds (entries of groups closed before L; the rest of the last
    page is overwritten by the receiver before anything reads it);
  * the continuation block, rows by position:
      - SWA keys of [max(0, L - W), L), every SWA layer;
      - CSA compressor and indexer ring rows (kv, gate) of [max(0, g - 4), L), g = L - L % 4:
        the open group and the previous group's overlap rows;
      - HCA ring rows (kv, gate) of [L - L % 128, L): the partial C128 group.
A unit is one header line (JSON: signature, L, pages, byte lengths of the history part and of
the continuation part) and the raw bytes; the history part is kind-major (every C4 page, then indexer keys, then C128),
so history-only and continuation lengths stay apart from the receiver's page-aligned
reservation. The signature is the checkpoint layout signature plus this format's version.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from ..cache.checkpoint import OVERLAP, layout_signature
from ..cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS
from ..config import CSA_RATIO, HCA_RATIO

STATE_FORMAT_VERSION = 1
HISTORY_KINDS = ("c4", "idx", "c128")
CSA_RING_KINDS = ("ring_kv", "ring_gate", "iring_kv", "iring_gate")
HCA_RING_KINDS = ("hring_kv", "hring_gate")


class StateMismatch(ValueError):
    """State written under another model config, dtype, KV dtype or format version."""


@dataclass(frozen=True)
class StateHeader:
    signature: str
    length: int            # L: positions [0, L) are in the state; the receiver resumes at L
    num_pages: int         # history pages of the state: ceil(L / 256)
    history_bytes: int
    continuation_bytes: int
    first_page: int = 0    # pages [first_page, num_pages) are sent (the receiver holds the others)


def state_signature(layout, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str:
    base = layout_signature(layout, dtype, kv_dtype or dtype)
    return hashlib.sha256(f"{base}:disagg-state-v{STATE_FORMAT_VERSION}".encode()).hexdigest()


def signature_summary(layout, dtype: torch.dtype) -> dict:
    """What a mismatch error shows besides the hashes."""
    c = layout.cfg
    return {"layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "head_dim": c.head_dim,
            "dtype": str(dtype), "format": STATE_FORMAT_VERSION,
            "index_topk_producers": str(getattr(c, "index_topk_producers", ""))}


def history_pages(L: int) -> int:
    return -(-L // PAGE_TOKENS)


def continuation_positions(layout, L: int) -> dict[str, range]:
    """Positions each continuation section carries."""
    open_csa = L - L % CSA_RATIO
    return {"swa": range(max(0, L - layout.cfg.sliding_window), L),
            "csa": range(max(0, open_csa - OVERLAP), L),
            "hca": range(L - L % HCA_RATIO, L)}


class StateCodec:
    """Packs a request's state out of a KVStorage and back into another one's pages."""

    def __init__(self, storage, kv_dtype: torch.dtype | None = None):
        self.storage, self.layout = storage, storage.layout
        self.dtype = storage.dtype                  # the model's; packed FP8 kinds are uint8 (layout.kv_fp8)
        self.signature = state_signature(self.layout, self.dtype, kv_dtype)

    # ---- out -------------------------------------------------------------------------
    def export(self, pages: list[int], swa_pages: list[int], slot: int, L: int, first_page: int = 0
               ) -> tuple[StateHeader, bytes]:
        """The state at L; history pages from `first_page` on (the receiver's prefix cache has
        the ones before)."""
        n = history_pages(L)
        if L <= 0 or len(pages) < n or not 0 <= first_page <= n:
            raise ValueError(f"state at {L}: {len(pages)} history pages held, {n} needed, from page {first_page}")
        idx = torch.tensor(pages[first_page:n], dtype=torch.long, device=self.storage.kinds["c4"].device)
        history = [self.storage.kinds[k].index_select(0, idx) for k in HISTORY_KINDS]     # [n, layers, rows, C]
        hist = b"".join(_raw(t) for t in history)
        cont = b"".join(_raw(t) for t in self._continuation(swa_pages, slot, L))
        return StateHeader(self.signature, L, n, len(hist), len(cont), first_page), hist + cont

    def _continuation(self, swa_pages: list[int], slot: int, L: int) -> list[torch.Tensor]:
        pos, k = continuation_positions(self.layout, L), self.storage.kinds
        swa_p, swa_r = self._swa_index(swa_pages, pos["swa"])
        out = [k["swa"][swa_p, :, swa_r].transpose(0, 1)]                                   # [layers, rows, D]
        csa_rows = self._ring_rows(pos["csa"], self.layout.csa_ring)
        out += [k[name][slot][:, csa_rows] for name in CSA_RING_KINDS]
        hca_rows = self._ring_rows(pos["hca"], self.layout.hca_ring)
        out += [k[name][slot][:, hca_rows] for name in HCA_RING_KINDS]
        return out

    # ---- in --------------------------------------------------------------------------
    def check(self, header: StateHeader) -> None:
        if header.signature != self.signature:
            raise StateMismatch(f"state of layout {header.signature[:16]}..., this engine's layout is "
                                f"{self.signature[:16]}... (another model config, dtype, KV dtype, IndexCache "
                                f"producer set or format version)")

    def install(self, header: StateHeader, data: bytes, pages: list[int], swa_pages: list[int], slot: int) -> None:
        """Write a unit into a request's reserved pages and slot (at the same positions)."""
        self.check(header)
        L, n, first = header.length, header.num_pages, header.first_page
        if len(pages) < n or len(data) != header.history_bytes + header.continuation_bytes:
            raise StateMismatch(f"state of {len(data)} bytes for {n} pages; {len(pages)} pages reserved, "
                                f"{header.history_bytes + header.continuation_bytes} bytes announced")
        k, device = self.storage.kinds, self.storage.kinds["c4"].device
        idx = torch.tensor(pages[first:n], dtype=torch.long, device=device)
        view = _Reader(data, device)
        for name in HISTORY_KINDS:
            k[name].index_copy_(0, idx, view.take((n - first, *k[name].shape[1:]), k[name].dtype))
        pos = continuation_positions(self.layout, L)
        swa_p, swa_r = self._swa_index(swa_pages, pos["swa"])
        swa = view.take((k["swa"].shape[1], len(pos["swa"]), k["swa"].shape[3]), k["swa"].dtype)
        k["swa"][swa_p, :, swa_r] = swa.transpose(0, 1)
        for names, p, cap in ((CSA_RING_KINDS, pos["csa"], self.layout.csa_ring),
                              (HCA_RING_KINDS, pos["hca"], self.layout.hca_ring)):
            rows = self._ring_rows(p, cap)
            for name in names:
                k[name][slot][:, rows] = view.take((k[name].shape[1], len(p), k[name].shape[3]), k[name].dtype)
        if view.offset != len(data):
            raise StateMismatch(f"state of {len(data)} bytes, {view.offset} read")

    # ---- addressing ------------------------------------------------------------------
    def _swa_index(self, swa_pages: list[int], positions: range):
        device = self.storage.kinds["swa"].device
        p = torch.tensor(list(positions), dtype=torch.long)
        table = torch.tensor(swa_pages or [-1], dtype=torch.long)
        logical = p // SWA_PAGE_TOKENS
        if len(p) and (int(logical.max()) >= len(swa_pages) or bool((table[logical] < 0).any())):
            raise RuntimeError(f"SWA pages of positions [{positions.start}, {positions.stop}) not held")
        return table[logical].to(device), (p % SWA_PAGE_TOKENS).to(device)

    def _ring_rows(self, positions: range, cap: int) -> torch.Tensor:
        return (torch.tensor(list(positions), dtype=torch.long) % cap).to(self.storage.kinds["swa"].device)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


class _Reader:
    """Consecutive tensors out of one byte string, each of its own dtype (packed FP8 kinds are
    uint8, rings the model dtype; every part's byte length keeps the next one aligned)."""

    def __init__(self, data: bytes, device):
        self.buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        self.device, self.offset = device, 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if self.offset + nbytes > self.buf.numel():
            raise StateMismatch(f"state truncated: {self.buf.numel()} bytes, needs more than {self.offset + nbytes}")
        out = self.buf[self.offset:self.offset + nbytes].view(dtype).view(shape)
        self.offset += nbytes
        return out.to(self.device)


def header_to_json(h: StateHeader) -> dict:
    return {"signature": h.signature, "length": h.length, "num_pages": h.num_pages,
            "history_bytes": h.history_bytes, "continuation_bytes": h.continuation_bytes, "first_page": h.first_page}


def header_from_json(d: dict) -> StateHeader:
    try:
        return StateHeader(str(d["signature"]), int(d["length"]), int(d["num_pages"]), int(d["history_bytes"]),
                           int(d["continuation_bytes"]), int(d.get("first_page", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise StateMismatch(f"not a state header: {e}") from None


def to_json_line(h: StateHeader) -> bytes:
    return json.dumps(header_to_json(h)).encode()
