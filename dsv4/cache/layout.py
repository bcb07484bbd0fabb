"""Page math for V4's cache (docs/architecture.md, "Cache").

* compressed history: shareable 256-token pages. Per page and layer: 64 C4 slots + 64
  indexer-key slots (CSA layers) or 2 C128 slots (HCA layers). Entry e of ratio m sits on
  logical page e*m // 256, slot e % (256 // m).
* sliding-window keys: request-private 128-slot pages, logical page = pos // 128, every layer.
* with `kv_fp8` (`--kv-cache-dtype fp8`) SWA keys, C4 and C128 entries are packed FP8 rows
  (584 bytes on V4) and indexer keys FP8 + an fp32 scale (132 bytes), dsv4/ops/kv_fp8.py;
  the rings keep the model dtype.
* compressor continuation: request-private rings addressed by position, `span + S` rows
  per request (span 8 for CSA compressor and indexer, 128 for HCA), S = speculative slots.
  The CSA rings have 4 more rows per request, never addressed by position: the staging rows
  where a prefill chunk also writes the overlap rows [L - 4, L) of the last page boundary L
  inside it, for the prefix cache's checkpoint at L (checkpoint.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import CSA_RATIO, HCA_RATIO, ConfigError, ModelConfig
from ..ops.kv_fp8 import entry_bytes, index_key_bytes

PAGE_TOKENS = 256
SWA_PAGE_TOKENS = 128
CSA_SPAN = 2 * CSA_RATIO  # open group + previous group (overlap)
CSA_STAGING = CSA_RATIO   # rows of the overlap of a page boundary inside a chunk
HCA_SPAN = HCA_RATIO


def dtype_bytes(dtype) -> int:
    import torch
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheLayout:
    cfg: ModelConfig
    spec_slots: int = 0          # S: most speculative tokens in flight
    with_mtp: bool = False       # also keep SWA keys for the MTP layer
    kv_fp8: bool = False         # packed FP8 SWA keys, C4/C128 entries and indexer keys (ops/kv_fp8.py)

    @property
    def entry_width(self) -> int:
        """Row width (C) of the SWA, C4 and C128 storage: D values, or packed bytes."""
        c = self.cfg
        return entry_bytes(c.head_dim, c.qk_rope_head_dim) if self.kv_fp8 else c.head_dim

    @property
    def index_width(self) -> int:
        """Row width of the indexer-key storage: Di values, or packed bytes."""
        return index_key_bytes(self.cfg.index_head_dim) if self.kv_fp8 else self.cfg.index_head_dim

    def row_elem(self, elem: int) -> int:
        """Bytes of one element of a packed-able kind: 1 (packed bytes) or the model dtype's."""
        return 1 if self.kv_fp8 else elem

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.cfg.compress_ratios) if r == CSA_RATIO)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.cfg.compress_ratios) if r == HCA_RATIO)

    @property
    def num_swa_layers(self) -> int:
        return self.cfg.num_hidden_layers + (self.cfg.num_nextn_predict_layers if self.with_mtp else 0)

    @property
    def csa_ring(self) -> int:
        return CSA_SPAN + self.spec_slots

    @property
    def csa_ring_rows(self) -> int:
        """Rows of a request's CSA ring: `csa_ring` by position, then the staging rows."""
        return self.csa_ring + CSA_STAGING

    @property
    def hca_ring(self) -> int:
        return HCA_SPAN + self.spec_slots

    @property
    def swa_pitch(self) -> int:
        """Rows from one SWA page to the next (every layer's 128 slots)."""
        return self.num_swa_layers * SWA_PAGE_TOKENS

    @property
    def c4_pitch(self) -> int:
        """Rows from one history page to the next in the C4 and indexer-key storage."""
        return len(self.csa_layers) * (PAGE_TOKENS // CSA_RATIO)

    @property
    def c128_pitch(self) -> int:
        return len(self.hca_layers) * (PAGE_TOKENS // HCA_RATIO)

    @property
    def csa_ring_pitch(self) -> int:
        """Rows from one request slot to the next in the CSA compressor and indexer rings."""
        return len(self.csa_layers) * self.csa_ring_rows

    @property
    def hca_ring_pitch(self) -> int:
        return len(self.hca_layers) * self.hca_ring

    @property
    def swa_keep(self) -> int:
        """Positions of SWA keys a request must keep behind its end: W + S."""
        return self.cfg.sliding_window + self.spec_slots

    # ---- bytes ------------------------------------------------------------------------
    def page_bytes(self, elem: int) -> int:
        """One 256-token compressed-history page across all layers."""
        per_csa = (PAGE_TOKENS // CSA_RATIO) * (self.entry_width + self.index_width)
        per_hca = (PAGE_TOKENS // HCA_RATIO) * self.entry_width
        return self.row_elem(elem) * (len(self.csa_layers) * per_csa + len(self.hca_layers) * per_hca)

    def swa_page_bytes(self, elem: int) -> int:
        return self.row_elem(elem) * SWA_PAGE_TOKENS * self.entry_width * self.num_swa_layers

    def ring_bytes(self, elem: int) -> int:
        """Compressor rings of one request (kv + gate, all compressed layers)."""
        c = self.cfg
        csa = self.csa_ring_rows * 2 * 2 * (c.head_dim + c.index_head_dim)
        hca = self.hca_ring * 2 * c.head_dim
        return elem * (len(self.csa_layers) * csa + len(self.hca_layers) * hca)

    def swa_pages_needed(self, max_num_seqs: int, max_batched_tokens: int) -> int:
        """SWA pages for the worst step: every sequence keeps W + S positions behind it
        (plus a partly filled page at each end), and the step's new tokens (at most
        `max_batched_tokens` in all) need pages of their own."""
        per_seq = -(-self.swa_keep // SWA_PAGE_TOKENS) + 2
        return max_num_seqs * per_seq + -(-max_batched_tokens // SWA_PAGE_TOKENS)

    def plan(self, budget_bytes: int, elem: int, max_num_seqs: int, max_chunk: int, checkpoint_bytes: int = 0,
             num_checkpoints: int | None = None) -> "CachePlan":
        """Split a memory budget: rings and SWA pages for `max_num_seqs`, prefix-cache checkpoints
        of `checkpoint_bytes` each (none when 0; `num_checkpoints`, or `default_checkpoints`), the
        rest history pages. Without compressed layers a history page holds no bytes: then as
        many pages as `max_num_seqs` requests at the model's longest context use (the page
        allocator keeps host bookkeeping per page, so a budget of bytes must not count them)."""
        swa_pages = self.swa_pages_needed(max_num_seqs, max_chunk)
        page = max(self.page_bytes(elem), 1)
        # + one scratch unit of each kind (storage.py): the budget holds what is allocated
        fixed = (max_num_seqs + 1) * self.ring_bytes(elem) + (swa_pages + 1) * self.swa_page_bytes(elem) + page
        if not checkpoint_bytes:
            checkpoints = 0
        elif num_checkpoints is not None:
            checkpoints = num_checkpoints
        else:    # as many as default_checkpoints gives for the pages that are left
            checkpoints = max(2 * max_num_seqs, (budget_bytes - fixed) // (CHECKPOINT_EVERY * page + checkpoint_bytes))
        fixed += checkpoints * checkpoint_bytes
        pages = (budget_bytes - fixed) // page
        if not self.page_bytes(elem):    # no compressed layer: a page holds nothing, the budget bounds none
            pages = min(pages, max_num_seqs * -(-self.cfg.max_position_embeddings // PAGE_TOKENS))
        if pages < 1:
            raise ConfigError("cache_memory_gb", f"cache memory budget of {budget_bytes / 2**20:.1f} MiB is too "
                              f"small: {fixed / 2**20:.1f} MiB go to rings and sliding-window pages of "
                              f"{max_num_seqs} requests and {checkpoints} prefix-cache checkpoints, and one "
                              f"history page needs {page / 2**20:.2f} MiB more; lower --max-num-seqs or "
                              f"raise --cache-memory-gb")
        return CachePlan(num_pages=int(pages), num_swa_pages=swa_pages, max_num_seqs=max_num_seqs,
                         num_checkpoints=int(checkpoints))


CHECKPOINT_EVERY = 16    # by default one prefix-cache checkpoint per 16 history pages (4096 tokens)


def default_checkpoints(num_pages: int, max_num_seqs: int) -> int:
    """Checkpoints of the prefix cache when not given: one per CHECKPOINT_EVERY history pages,
    and at least two per request slot (a request's prompt end and its latest decode boundary)."""
    return max(2 * max_num_seqs, num_pages // CHECKPOINT_EVERY)


@dataclass(frozen=True)
class CachePlan:
    num_pages: int       # 256-token compressed-history pages
    num_swa_pages: int   # 128-slot sliding-window pages
    max_num_seqs: int    # ring rows (request state slots)
    num_checkpoints: int = 0   # prefix-cache checkpoints (checkpoint.py); 0: no prefix cache

    @property
    def max_tokens(self) -> int:
        return self.num_pages * PAGE_TOKENS
