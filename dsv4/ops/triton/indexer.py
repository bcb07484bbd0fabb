"""Lightning indexer in Triton: scores of one tile of entries in one kernel
(dsv4/ops/triton/indexer_scores.py: per token for decode, tiled over tokens and candidates for a
prefill chunk), the tile's top k by radix select (dsv4/ops/triton/radix_topk.py: many programs
per row), merged into a running top-k (dsv4/ops/stream_topk.py: score desc, ties to the lower
offset, the reference's order), tile after tile; a single tile (every decode step up to
SCORE_TILE / T entries) needs no merge.

The reference (dsv4/ops/indexer.py, the definition) gathers key tiles in torch; here each
program reads its key rows straight from the pool by index. A tile holds at most SCORE_TILE
scores (or T x k), so a step's memory is O(T * k + tile) at any context length; a decode
step up to SCORE_TILE / T entries is one tile.

cand may be a PagedRows (dsv4/ops/paged.py; E = its width): the score kernels compute the rows
from the page table, and one more kernel turns the chosen positions into rows
(PagedRows.rows_at where the score is finite, in one pass instead of a dozen torch ops), so
scores and selection are bit-identical to those of its dense form. `indexer_topk_offsets` has
the same kernel also write the chosen positions (offsets into each token's range, IndexCache's
raw top-k: dsv4/ops/translate.py). The tiling depends only on T, k and the width, never on the
data (CUDA-graph safe).
"""
from functools import partial

import torch
import triton
import triton.language as tl

from ..paged import PagedRows, index_width
from ..stream_topk import RunningTopk
from .indexer_scores import BLOCK_E, indexer_scores
from .indexer_scores_heads import HEAD_TILES, heads_ok, indexer_scores_heads
from .radix_topk import radix_topk
from .row_topk import RowTopk

ROWS_BLOCK = 1024   # chosen positions per program of the paged rows kernel (top-k 512: one a token)
# scores of one tile: 64M fp32 (256 MiB transient, whatever the context; its top k by radix select
# needs O(T * k) more); a decode step of T <= 256 tokens at 1M context (262,144 C4 entries) is one tile
SCORE_TILE = 1 << 26
ROWS_MIN = 256      # rows from which a program per row (row_topk) fills an H200's 132 SMs twice
# a prefill chunk's tiles of scores: "heads", the head-loop kernel at HEAD_TILES (q by TMA boxes,
# dsv4/ops/triton/indexer_scores_heads.py; 1.74 against 2.08 ms a 32,768-entry tile of a 2,048-token
# chunk at 900k for GEMM_TILES, docs/benchmarks.md); None, indexer_scores' tiled kernel
# (GEMM_TILES). "heads" where it takes the inputs (model-dtype keys, paged candidates), else
# indexer_scores' own choice.
TILED_SCORES: str | None = "heads"
# a prefill chunk's tiles: each tile's top-k on a high-priority side stream, under the next tile's
# scores (tensor-core bound; the top-k reads the tile, memory and ALU bound), the scores in two
# buffers of a tile; the same selection (False: in order, one tile's scores at a time)
OVERLAP_TOPK = True
SCORE_BUFFERS = 2   # score buffers of a tile each while the tiles' top-k runs beside (_rows_topk_beside)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("K", "n_kblk", "pitch", "stride_pr"))
def _chosen_rows_kernel(pos_ptr, pages_ptr, req_ptr, lo_ptr, out_ptr, K, n_kblk, pitch,
                        stride_pr, stride_pc, PER_PAGE: tl.constexpr, BLOCK: tl.constexpr):
    # positions/out [T, K] contiguous: out = the pool row of item lo[t] + pos where pos >= 0 (a
    # chosen entry, so pos < hi - lo: the rest scored -inf), else -1.
    pid = tl.program_id(0).to(tl.int64)
    t = pid // n_kblk
    offs = t * K + (pid % n_kblk) * BLOCK + tl.arange(0, BLOCK)
    ok = (pid % n_kblk) * BLOCK + tl.arange(0, BLOCK) < K
    pos = tl.load(pos_ptr + offs, mask=ok, other=-1)
    chosen = ok & (pos >= 0)
    item = tl.load(lo_ptr + t).to(tl.int32) + pos.to(tl.int32)
    page = tl.load(pages_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_pr + (item // PER_PAGE) * stride_pc,
                   mask=chosen, other=-1).to(tl.int64)
    tl.store(out_ptr + offs, tl.where(chosen, page * pitch + item % PER_PAGE, -1), mask=ok)


def _chosen_rows(cand: PagedRows, offsets: torch.Tensor) -> torch.Tensor:
    """cand.rows_at(offsets) for chosen offsets ([T, k] long, -1 = none) in one kernel."""
    T, k = offsets.shape
    out = torch.empty((T, k), dtype=torch.long, device=offsets.device)
    block = min(ROWS_BLOCK, triton.next_power_of_2(k))
    n_kblk = triton.cdiv(k, block)
    _chosen_rows_kernel[(T * n_kblk,)](
        offsets.contiguous(), cand.pages, cand.req.contiguous(), cand.lo.contiguous(), out, k, n_kblk,
        cand.pitch, cand.pages.stride(0), cand.pages.stride(1), PER_PAGE=cand.per_page, BLOCK=block, num_warps=4)
    return out


def tile_width(T: int, k: int, block_e: int = BLOCK_E) -> int:
    """Entries per tile: SCORE_TILE / T, at least k, a multiple of block_e."""
    width = max(k, SCORE_TILE // max(T, 1), 1)
    return triton.cdiv(width, block_e) * block_e


def score_bytes(T: int, k: int, E: int, side_stream: bool) -> int:
    """fp32 bytes of the scores `_topk_offsets` holds at once for T tokens over E entries (k <= E):
    SCORE_BUFFERS buffers [T, tile_width] where the tiles' top-k runs beside the scores (T >=
    ROWS_MIN, more than one tile, `side_stream`: what `_side_stream` gives), else one tile
    [T, min(E, tile_width)]. The top-k's own O(T * k) is not counted."""
    width = tile_width(T, k)
    if T >= ROWS_MIN and E > width and side_stream:
        return SCORE_BUFFERS * T * width * 4
    return T * min(E, width) * 4


def _topk_offsets(q, weights, keys, cand, k, weight_scale) -> torch.Tensor:
    """[T, k] chosen offsets (-1 = none). Many rows (prefill): a program per row merges each
    tile into a running set (dsv4/ops/triton/row_topk.py). Few rows (decode): each tile's top k
    by radix select, many programs per row (dsv4/ops/triton/radix_topk.py); with several tiles,
    merged into a running top-k."""
    T, E = q.shape[0], index_width(cand)
    width = tile_width(T, k)
    if T >= ROWS_MIN:
        tiles = [(e0, min(e0 + width, E)) for e0 in range(0, E, width)]
        score = partial(_tile_scores, q, weights, keys, cand, weight_scale)     # (e0, e1[, out]) -> scores
        side = _side_stream(q.device) if len(tiles) > 1 else None
        return _rows_topk(tiles, score, k) if side is None else _rows_topk_beside(tiles, score, k, side, T, width)
    if E <= width:      # one tile (every decode step up to SCORE_TILE / T entries)
        return radix_topk(indexer_scores(q, weights, keys, cand, weight_scale=weight_scale), k)[1]
    running = RunningTopk(T, k, q.device)
    for e0 in range(0, E, width):
        scores = indexer_scores(q, weights, keys, cand, weight_scale=weight_scale, e0=e0, e1=min(e0 + width, E))
        running.merge(radix_topk(scores, k, e0)[0])
    return running.offsets()


def _side_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """A high-priority stream (torch's pool) for the tiles' top-k, or None where they run in
    order: not CUDA, OVERLAP_TOPK off, or a CUDA graph being captured."""
    if not OVERLAP_TOPK or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    return torch.cuda.Stream(device, priority=-1)


def _rows_topk(tiles: list[tuple[int, int]], score, k: int) -> torch.Tensor:
    """[T, k] chosen offsets of the entry ranges `tiles` (score(e0, e1): their scores [T, e1 - e0]),
    one after the other."""
    rows = RowTopk(k)
    for e0, e1 in tiles:
        rows.add(score(e0, e1), e0)
    return rows.offsets()


def _rows_topk_beside(tiles: list[tuple[int, int]], score, k: int, side: "torch.cuda.Stream", T: int,
                      width: int) -> torch.Tensor:
    """_rows_topk with each tile's top-k on `side`, after its scores on the current stream and
    under the next tile's. The scores alternate between SCORE_BUFFERS (two) buffers of [T, width]: a tile's
    scores wait (on the device) until the side stream has read the tile two before. The same
    offsets, ordered before the current stream's next work."""
    main = torch.cuda.current_stream(side.device)
    buffers = torch.empty((SCORE_BUFFERS, T * width), dtype=torch.float32, device=side.device)
    read: list = [None] * SCORE_BUFFERS     # the side stream's event after its top-k of buffer b's tile
    rows = RowTopk(k)
    for i, (e0, e1) in enumerate(tiles):
        b = i % SCORE_BUFFERS
        if read[b] is not None:
            main.wait_event(read[b])
        tile = score(e0, e1, buffers[b, :T * (e1 - e0)].view(T, e1 - e0))
        side.wait_stream(main)
        with torch.cuda.stream(side):
            rows.add(tile, e0)
        read[b] = side.record_event()
    with torch.cuda.stream(side):
        out = rows.offsets()
    main.wait_stream(side)             # (before `buffers` return to the current stream's pool)
    out.record_stream(main)
    return out


def _tile_scores(q, weights, keys, cand, weight_scale, e0, e1, out=None) -> torch.Tensor:
    """The scores [T, e1 - e0] of a prefill chunk's tile (into `out` when given), by
    TILED_SCORES' kernel."""
    assert TILED_SCORES in (None, "heads"), "TILED_SCORES: None or 'heads'"
    if TILED_SCORES == "heads" and heads_ok(q, keys, cand, HEAD_TILES):
        return indexer_scores_heads(q, weights, keys, cand, HEAD_TILES, weight_scale=weight_scale, e0=e0, e1=e1,
                                    out=out)
    return indexer_scores(q, weights, keys, cand, weight_scale=weight_scale, e0=e0, e1=e1, out=out)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor | PagedRows,
                 topk: int, weight_scale: float = 1.0) -> torch.Tensor:
    """Same contract as dsv4.ops.indexer.indexer_topk: [T, min(topk, E)] flat rows of the
    chosen entries, -1 where fewer are valid (long for a PagedRows, as its dense form)."""
    paged = isinstance(cand, PagedRows)
    T, k = q.shape[0], min(topk, index_width(cand))
    if T == 0 or k == 0:
        return torch.full((T, k), -1, dtype=torch.long if paged else cand.dtype, device=q.device)
    offsets = _topk_offsets(q, weights, keys, cand, k, weight_scale)
    if paged:
        return _chosen_rows(cand, offsets)
    return torch.where(offsets >= 0, cand.gather(1, offsets.clamp(min=0)), -1)


def indexer_topk_offsets(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: PagedRows, topk: int,
                         weight_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as dsv4.ops.indexer.indexer_topk_offsets: (rows, offsets) [T, min(topk, E)]
    long."""
    T, k = q.shape[0], min(topk, cand.width)
    if T == 0 or k == 0:
        return (torch.full((T, k), -1, dtype=torch.long, device=q.device),
                torch.full((T, k), -1, dtype=torch.long, device=q.device))
    offsets = _topk_offsets(q, weights, keys, cand, k, weight_scale)
    return _chosen_rows(cand, offsets), offsets
