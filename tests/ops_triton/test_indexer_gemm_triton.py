"""The indexer's tiled scores kernel (dsv4/ops/triton/indexer_scores.py, `_scores_gemm_kernel`)
against the per-token kernel and the torch reference: prefill chunks (blocks of tokens that
share their key rows: one tensor-core dot per head), blocks mixing requests or windows (scored
token by token: the per-token kernel's code, bit for bit), causal tails, blocks wholly past
every token's limit, padding tokens; bf16, fp32 and packed FP8 keys; paged and dense
candidates; the selection downstream."""
import pytest
import torch
import triton
import triton.language as tl
from test_indexer_triton import assert_same_selection, assert_scores_close, reference_scores

from dsv4.ops import backend
from dsv4.ops import indexer as ref
from dsv4.ops.kv_fp8 import pack_index_keys, unpack_index_keys
from dsv4.ops.paged import PagedRows
from dsv4.ops.triton import indexer as tri
from dsv4.ops.triton import indexer_scores as isc
from dsv4.ops.triton import row_topk
from dsv4.ops.triton.indexer_scores import GemmTiles, _block_rows

TILES = GemmTiles(block_t=16, block_e=16, num_warps=4, num_stages=2)
PER_PAGE, PITCH = 4, 8          # 4 entries a page; pages of other layers in between


def chunks(spans, pad=0, window=None, seed=0, width=None):
    """A PagedRows of prefill chunks, C4 style: spans = [(request, first position, tokens)],
    token at position p reads entries [lo, (p + 1) // 4) of its request (lo = 0, or the last
    `window` entries: a different lo per token); then `pad` padding tokens (request 0, empty
    range, as a CUDA-graph bucket's); `width`: the table's (default the widest range; wider, as
    a CUDA-graph bucket's, leaves candidate blocks past every token's limit). -> (cand, pool rows)."""
    g = torch.Generator().manual_seed(seed)
    req, hi = [], []
    for r, start, n in spans:
        req += [r] * n
        hi += [(p + 1) // 4 for p in range(start, start + n)]
    width = width or max(hi)
    lo = [0 if window is None else max(0, h - window) for h in hi]
    req, lo, hi = (torch.tensor(v + [0] * pad) for v in (req, lo, hi))
    R, P = max(r for r, _, _ in spans) + 1, -(-width // PER_PAGE)
    pages = torch.randperm(R * P + 3, generator=g)[:R * P].view(R, P)
    cand = PagedRows(pages, req, lo, hi, PER_PAGE, PITCH, width if window is None else min(width, window))
    return cand, (R * P + 3) * PITCH


def inputs(T, n, Hi, kind, seed=0, Di=None):
    """q [T, Hi, Di], weights [T, Hi], keys [n, Di]: small integers and Di = 16 (every sum
    exact, in any order: Di^-0.5 is a power of two) or normal floats and Di = 24 (padded to 32
    in the kernels); keys bf16, fp32 or packed FP8 (uint8 [n, Di + 4])."""
    g = torch.Generator().manual_seed(seed)
    exact, key_kind = kind.split("-")
    Di = Di or (16 if exact == "int" else 24)
    if exact == "int":
        q = torch.randint(-2, 3, (T, Hi, Di), generator=g).float()
        weights = torch.randint(-1, 3, (T, Hi), generator=g).float()
        keys = torch.randint(-2, 3, (n, Di), generator=g).float()
    else:
        q, weights = torch.randn(T, Hi, Di, generator=g), torch.randn(T, Hi, generator=g)
        keys = torch.randn(n, Di, generator=g)
    if key_kind == "fp8":
        return q.bfloat16(), weights, pack_index_keys(keys)
    dtype = torch.bfloat16 if key_kind == "bf16" else torch.float32
    return q.to(dtype), weights, keys.to(dtype)


def plain(keys):
    """Keys as the reference reads them (packed FP8: dequantised)."""
    return unpack_index_keys(keys) if keys.dtype == torch.uint8 else keys


CASES = {   # name: (spans, pad, window, width); BLOCK_T = BLOCK_E = 16
    "one chunk at 0": ([(0, 0, 40)], 0, None, None),               # causal tails (tokens 0-3: nothing)
    "one chunk deep": ([(1, 100, 37)], 0, None, None),             # request 1, every token's range non-empty
    "two requests": ([(0, 60, 20), (1, 8, 20)], 0, None, None),    # block 1 mixes them: token by token
    "padded bucket": ([(1, 100, 20)], 12, None, 70),               # padding tokens share the block; blocks
                                                                   # of candidates past every token's limit
    "windows": ([(0, 100, 33)], 0, 9, None),                       # a lo per token: token by token
}


@pytest.mark.parametrize(("kind", "dense"), [("int-fp32", False), ("int-bf16", False), ("rand-fp32", False),
                                              ("rand-bf16", False), ("rand-fp8", False), ("int-bf16", True),
                                              ("rand-fp8", True)])
@pytest.mark.parametrize("case", list(CASES))
def test_tiled_scores(case, kind, dense, device):
    """The tiled kernel's scores against the per-token kernel's and the reference's: bit for bit
    where every sum is exact, within fp32 summation order otherwise, and bit for bit on the tokens
    of blocks that do not share their rows (the per-token code)."""
    spans, pad, window, width = CASES[case]
    cand, n = chunks(spans, pad, window, seed=len(case), width=width)
    T = cand.num_tokens
    q, weights, keys = (v.to(device) for v in inputs(T, n, 4, kind, seed=T))
    cand = PagedRows(*(v.to(device) for v in (cand.pages, cand.req, cand.lo, cand.hi)), cand.per_page, cand.pitch,
                     cand.width)
    arg = cand.dense() if dense else cand
    got = isc.indexer_scores(q, weights, keys, arg, weight_scale=0.5, tiles=TILES).cpu()
    old = isc.indexer_scores(q, weights, keys, arg, block_e=TILES.block_e, weight_scale=0.5, tiles=None).cpu()
    want = reference_scores(q.cpu(), weights.cpu() * 0.5, plain(keys).cpu(), cand.dense().cpu())
    assert got.shape == (T, cand.width)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    if width:
        assert torch.isinf(got[:, 32:]).all() and torch.isfinite(got[0, :25]).all()   # hi 25..30
    if kind.startswith("int"):
        assert torch.equal(got, old) and torch.equal(got, want)
    else:
        assert_scores_close(got, want)
        assert_scores_close(got, old)
    shared = block_sharing(cand, dense)
    alone = shared.repeat_interleave(TILES.block_t, 0)[:T].repeat_interleave(TILES.block_e, 1)[:, :cand.width] == 0
    assert torch.equal(got[alone], old[alone])
    expect_alone = case in ("two requests", "windows")
    assert bool(alone.any()) == expect_alone


@triton.jit
def _sharing_kernel(cand_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr, T, E, pitch, stride_ct, stride_ce,
                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PAGED: tl.constexpr, PER_PAGE: tl.constexpr):
    # out[tb, eb] = whether the tokens of block tb share their rows over candidate block eb.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    _, shared = _block_rows(cand_ptr, req_ptr, lo_ptr, hi_ptr, offs_t, offs_e, offs_t < T, offs_e < E, pitch,
                            stride_ct, stride_ce, PAGED, PER_PAGE)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), shared.to(tl.int32))


def block_sharing(cand: PagedRows, dense: bool) -> torch.Tensor:
    """[token blocks, candidate blocks] int32 (TILES' blocks): 1 where the tiled kernel's check
    finds the block's tokens share their rows."""
    T = cand.num_tokens
    grid = (triton.cdiv(T, TILES.block_t), triton.cdiv(cand.width, TILES.block_e))
    out = torch.empty(grid, dtype=torch.int32, device=cand.req.device)
    table = cand.dense() if dense else cand.pages
    _sharing_kernel[grid](table, cand.req, cand.lo, cand.hi, out, T, cand.width, cand.pitch,
                          table.stride(0), table.stride(1), BLOCK_T=TILES.block_t, BLOCK_E=TILES.block_e,
                          PAGED=not dense, PER_PAGE=cand.per_page)
    return out.cpu()


@pytest.mark.parametrize("dense", [False, True])
def test_block_sharing(dense, device):
    """Which blocks the kernel scores as one tile: one request's chunk (with padding tokens)
    yes; a block of two requests or of windows with different lo no."""
    def sharing(spans, pad=0, window=None):
        cand, _ = chunks(spans, pad, window)
        cand = PagedRows(*(v.to(device) for v in (cand.pages, cand.req, cand.lo, cand.hi)), cand.per_page,
                         cand.pitch, cand.width)
        return block_sharing(cand, dense)[:, 0].tolist()

    assert sharing([(0, 0, 40)]) == [1, 1, 1]
    assert sharing([(0, 60, 20), (1, 8, 20)]) == [1, 0, 1]
    assert sharing([(1, 100, 20)], pad=12) == [1, 1]
    assert sharing([(0, 100, 33)], window=9) == [0, 0, 1]     # lo moves every 4 tokens; a lone token


@pytest.mark.parametrize(("kind", "score_tile", "rows_min"), [("int-fp32", 1, 1 << 20), ("int-bf16", 1 << 24, 1 << 20),
                                                              ("int-fp32", 1, 1), ("rand-bf16", 1, 1 << 20),
                                                              ("rand-fp8", 1 << 24, 1 << 20)])
def test_selection(kind, score_tile, rows_min, device, monkeypatch):
    """indexer_topk_offsets on the tiled kernel (from the first token on), one tile or tiles of
    k entries (tile offsets E0 > 0), selected by radix select or a program per row (rows_min 1:
    row_topk): the reference's selection; where every sum is exact (many ties), its offsets and
    rows exactly (score desc, ties to the lower offset)."""
    monkeypatch.setattr(isc, "GEMM_MIN_TOKENS", 1)
    monkeypatch.setattr(isc, "GEMM_TILES", TILES)
    monkeypatch.setattr(isc, "GEMM_TILES_FP8", TILES)
    monkeypatch.setattr(tri, "SCORE_TILE", score_tile)
    monkeypatch.setattr(tri, "ROWS_MIN", rows_min)
    monkeypatch.setattr(row_topk, "MIN_CHUNK", 128)      # short tiles: narrow programs (fast to interpret)
    cand, n = chunks([(0, 300, 24), (1, 40, 9)], pad=3, seed=score_tile % 7)
    q, weights, keys = inputs(cand.num_tokens, n, 4, kind, seed=3)
    k = 10
    rows, offsets = tri.indexer_topk_offsets(q.to(device), weights.to(device), keys.to(device),
                                             PagedRows(*(v.to(device) for v in (cand.pages, cand.req, cand.lo,
                                                                                cand.hi)),
                                                       cand.per_page, cand.pitch, cand.width), k, 0.5)
    if kind.startswith("int"):
        with backend.forced("reference"):
            want_rows, want_offsets = ref.indexer_topk_offsets(q, weights, keys, cand, k, 0.5)
        assert torch.equal(offsets.cpu(), want_offsets) and torch.equal(rows.cpu(), want_rows)
    else:
        assert_same_selection(rows, q, weights * 0.5, plain(keys), cand.dense(), k)


@pytest.mark.parametrize("tiles", [isc.GEMM_TILES, GemmTiles(128, 256, 8, 3)])
@pytest.mark.parametrize("kind", ["rand-bf16", "rand-fp8"])
def test_v4_shapes(tiles, kind, device):
    """V4-Flash's indexer (Hi = 64, Di = 128) at the default launch shape and at the one with the
    most shared memory the benchmark sweeps (the compile check compiles both for the H200): a
    chunk's scores are the reference's, up to fp32 summation order."""
    T, E = tiles.block_t + 5, tiles.block_e + 7
    cand, n = chunks([(0, 4 * E - T, T)])
    q, weights, keys = (v.to(device) for v in inputs(T, n, 64, kind, Di=128))
    cand = PagedRows(*(v.to(device) for v in (cand.pages, cand.req, cand.lo, cand.hi)), cand.per_page, cand.pitch,
                     cand.width)
    got = isc.indexer_scores(q, weights, keys, cand, tiles=tiles).cpu()
    assert_scores_close(got, reference_scores(q.cpu(), weights.cpu(), plain(keys).cpu(), cand.dense().cpu()))
    assert torch.isfinite(got[-1]).all() and not torch.isfinite(got[0]).all()


def test_dispatch_by_tokens(device, monkeypatch):
    """indexer_scores takes the tiled kernel from GEMM_MIN_TOKENS tokens on, the per-token one
    below: the same scores either way (small integers: exact)."""
    launches = []
    kernel = isc._scores_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(isc, "_scores_gemm_kernel", Spy())
    monkeypatch.setattr(isc, "GEMM_TILES", TILES)
    monkeypatch.setattr(isc, "GEMM_TILES_FP8", TILES)
    monkeypatch.setattr(isc, "GEMM_MIN_TOKENS", 20)
    cand, n = chunks([(0, 80, 20)])
    q, weights, keys = (v.to(device) for v in inputs(20, n, 4, "int-fp32"))
    cand = PagedRows(*(v.to(device) for v in (cand.pages, cand.req, cand.lo, cand.hi)), cand.per_page, cand.pitch,
                     cand.width)
    tiled = isc.indexer_scores(q, weights, keys, cand)
    assert launches == [(2 * triton.cdiv(cand.width, TILES.block_e),)]
    per_token = isc.indexer_scores(q[:19], weights[:19], keys, PagedRows(cand.pages, cand.req[:19], cand.lo[:19],
                                                                           cand.hi[:19], PER_PAGE, PITCH, cand.width))
    assert len(launches) == 1
    assert torch.equal(tiled[:19], per_token)
