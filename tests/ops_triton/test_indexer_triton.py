"""Lightning indexer: the Triton scores and selection against the torch reference
(dsv4/ops/indexer.py). Scores are compared numerically (fp32, different summation order);
selections as sets, and only on rows whose k-th and (k+1)-th reference scores do not nearly tie.
Paged candidates (PagedRows) against their dense form: bit for bit."""
import pathlib
import sys

import pytest
import torch

from dsv4.ops import backend
from dsv4.ops import indexer as ref
from dsv4.ops.paged import PagedRows
from dsv4.ops.triton import indexer as tri
from dsv4.ops.triton import row_topk
from dsv4.ops.triton.row_topk_split import Split

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "ops"))
from paged_inputs import random_paged  # noqa: E402

TIE_GAP = 1e-4          # relative gap between the k-th and (k+1)-th score for a row to count


def reference_scores(q, weights, keys, cand):
    """[T, E] fp32: the reference's scores (the math of dsv4.ops.indexer._scores)."""
    gathered = keys[cand.clamp(min=0)].float()                             # [T, E, Di]
    scores = torch.relu(torch.einsum("thd,ted->the", q.float(), gathered)) * q.shape[-1] ** -0.5
    scores = (scores * weights.float()[..., None]).sum(dim=1)
    return scores.masked_fill(cand < 0, float("-inf"))


def make_inputs(T, E, Hi, Di, dtype, device, seed=0, key_dtype=None):
    """Random q/weights/key pool; cand row t holds distinct pool rows, then a -1 tail whose
    length differs per row (row 0 full, some rows empty)."""
    g = torch.Generator().manual_seed(seed)
    n = E + 5
    q = torch.randn(T, Hi, Di, generator=g).to(dtype)
    weights = torch.randn(T, Hi, generator=g) * Hi ** -0.5
    keys = torch.randn(n, Di, generator=g).to(key_dtype or dtype)
    cand = torch.full((T, E), -1, dtype=torch.long)
    for t in range(T):
        n_valid = E - (7 * t) % (E + 1)
        cand[t, :n_valid] = torch.randperm(n, generator=g)[:n_valid]
    return q.to(device), weights.to(device), keys.to(device), cand.to(device)


def assert_scores_close(got, want):
    finite = torch.isfinite(want)
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)   # -inf must match


def assert_same_selection(got, q, weights, keys, cand, topk):
    """Same count of -1 on every row; same set of rows where the choice is tie-free."""
    want = ref.indexer_topk(q.cpu(), weights.cpu(), keys.cpu(), cand.cpu(), topk)
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal((got < 0).sum(1), (want < 0).sum(1))
    k = want.shape[1]
    scores = reference_scores(q.cpu(), weights.cpu(), keys.cpu(), cand.cpu()).sort(1, descending=True).values
    checked = 0
    for t in range(want.shape[0]):
        if k < cand.shape[1] and torch.isfinite(scores[t, k]):
            gap = (scores[t, k - 1] - scores[t, k]).item()
            if gap <= TIE_GAP * abs(scores[t, k - 1].item()) or gap == 0:
                continue
        assert sorted(got[t].tolist()) == sorted(want[t].tolist()), f"row {t}"
        checked += 1
    assert checked >= (want.shape[0] + 1) // 2, "too few tie-free rows to be a test"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hi", [4, 8])
@pytest.mark.parametrize("E", [0, 1, 37])
@pytest.mark.parametrize("T", [0, 1, 6])
def test_scores_match_reference(T, E, Hi, dtype, device):
    q, weights, keys, cand = make_inputs(T, E, Hi, 32, dtype, device, seed=T * 100 + E + Hi)
    got = tri.indexer_scores(q, weights, keys, cand)
    assert got.shape == (T, E) and got.dtype == torch.float32
    assert_scores_close(got.cpu(), reference_scores(q.cpu(), weights.cpu(), keys.cpu(), cand.cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk", [5, 37, 512])       # fewer than valid, all of E, more than E
@pytest.mark.parametrize("E", [0, 1, 37])
@pytest.mark.parametrize("T", [0, 1, 6])
def test_selection_matches_reference(T, E, topk, dtype, device):
    q, weights, keys, cand = make_inputs(T, E, 8, 32, dtype, device, seed=T * 100 + E + topk)
    got = tri.indexer_topk(q, weights, keys, cand, topk)
    assert got.device.type == torch.device(device).type
    assert_same_selection(got, q, weights, keys, cand, topk)


def test_strided_pool_int32_cand_mixed_dtypes(device):
    """Keys as a column slice of a wider pool, int32 candidates, bf16 q with fp32 keys,
    a head count and dim that are not powers of two, and E over several blocks."""
    T, E, Hi, Di = 3, tri.BLOCK_E + 11, 5, 24
    q, weights, keys, cand = make_inputs(T, E, Hi, Di, torch.bfloat16, device, seed=7,
                                         key_dtype=torch.float32)
    pool = torch.randn(keys.shape[0], Di + 8, device=device)
    pool[:, 4:4 + Di] = keys
    keys = pool[:, 4:4 + Di]
    cand = cand.to(torch.int32)
    assert_scores_close(tri.indexer_scores(q, weights, keys, cand).cpu(),
                        reference_scores(q.cpu(), weights.cpu(), keys.cpu(), cand.cpu()))
    assert_same_selection(tri.indexer_topk(q, weights, keys, cand, 16), q, weights, keys, cand, 16)


def test_dispatch(device, monkeypatch):
    """indexer_topk runs the Triton kernel exactly when the tensors are on CUDA and the
    backend is "auto"."""
    calls = []
    monkeypatch.setattr(tri, "indexer_topk", lambda *args: calls.append(args) or args[3][:, :2])
    q, weights, keys, cand = make_inputs(2, 4, 4, 16, torch.float32, device)
    ref.indexer_topk(q, weights, keys, cand, 2)
    assert len(calls) == (1 if device == "cuda" else 0)
    with backend.forced("reference"):
        ref.indexer_topk(q, weights, keys, cand, 2)
    assert len(calls) == (1 if device == "cuda" else 0)


def test_weight_scale_and_strided_bf16_weights(device):
    """weights as a bf16 column slice of a wider projection output, scaled in the kernel: the
    same scores and selection as the reference given weights.float() * weight_scale."""
    T, E, Hi, Di = 4, 29, 6, 16
    q, weights, keys, cand = make_inputs(T, E, Hi, Di, torch.bfloat16, device, seed=11)
    wide = torch.randn(T, Hi + 9, device=device).to(torch.bfloat16)
    wide[:, 3:3 + Hi] = weights.to(torch.bfloat16)
    weights = wide[:, 3:3 + Hi]
    scaled = weights.float() * 0.37
    assert_scores_close(tri.indexer_scores(q, weights, keys, cand, weight_scale=0.37).cpu(),
                        reference_scores(q.cpu(), scaled.cpu(), keys.cpu(), cand.cpu()))
    got = tri.indexer_topk(q, weights, keys, cand, 7, 0.37)
    want = ref.indexer_topk(q.cpu(), weights.cpu(), keys.cpu(), cand.cpu(), 7, 0.37)
    assert torch.equal(want, ref.indexer_topk(q.cpu(), scaled.cpu(), keys.cpu(), cand.cpu(), 7))
    assert_same_selection(got, q, scaled, keys, cand, 7)


def paged_inputs(T, width, dtype, device, seed=0, index_dtype=torch.long, Hi=8, Di=32):
    """q, weights, keys, cand: a PagedRows over a pool of 4-entry pages, pitch 12 (pages
    interleaved with other layers'), tokens of several requests, windows, short and empty ranges."""
    cand, n = random_paged(T, width, per_page=4, pitch=12, seed=seed, device=device)
    cand = PagedRows(*(v.to(index_dtype) for v in (cand.pages, cand.req, cand.lo, cand.hi)),
                     per_page=cand.per_page, pitch=cand.pitch, width=cand.width)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hi, Di, generator=g).to(device, dtype)
    weights = (torch.randn(T, Hi, generator=g) * Hi ** -0.5).to(device)
    return q, weights, torch.randn(n, Di, generator=g).to(device, dtype), cand


# every (block_e, topk) (topk: fewer than the width, the width, more) in one dtype, alternating so
# that each block_e and each topk takes both: block_e and the dtype shape the scores kernel (both
# pairs of them kept), the selection reads fp32 scores and no block_e
@pytest.mark.parametrize("block_e,topk,dtype", [(b, k, (torch.float32, torch.bfloat16)[(i + j) % 2])
                                                for i, b in enumerate((16, tri.BLOCK_E))
                                                for j, k in enumerate((5, 37, 512))])
def test_paged_is_dense(dtype, topk, block_e, device):
    """Scores and selection from a PagedRows are those of its dense form, bit for bit; the
    selection also agrees with the reference's."""
    q, weights, keys, cand = paged_inputs(11, 37, dtype, device, seed=topk + block_e)
    dense = cand.dense()
    got = tri.indexer_scores(q, weights, keys, cand, block_e=block_e, weight_scale=0.5)
    assert torch.equal(got, tri.indexer_scores(q, weights, keys, dense, block_e=block_e, weight_scale=0.5))
    got = tri.indexer_topk(q, weights, keys, cand, topk, 0.5)
    want = tri.indexer_topk(q, weights, keys, dense, topk, 0.5)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert_same_selection(got, q, weights.float() * 0.5, keys, dense, topk)


@pytest.mark.parametrize("width", [0, 1, 20])
def test_paged_widths_and_int32(width, device, monkeypatch):
    """Zero and small widths, int32 tables (rows come back long, as the dense form's), chosen
    positions over several blocks of the rows kernel."""
    monkeypatch.setattr(tri, "ROWS_BLOCK", 2)
    q, weights, keys, cand = paged_inputs(7, width, torch.float32, device, seed=width, index_dtype=torch.int32)
    dense = cand.dense()
    assert torch.equal(tri.indexer_scores(q, weights, keys, cand), tri.indexer_scores(q, weights, keys, dense))
    got = tri.indexer_topk(q, weights, keys, cand, 7)                 # 7: a partial last block
    assert got.shape == (7, min(7, width)) and got.dtype == torch.long
    assert torch.equal(got, tri.indexer_topk(q, weights, keys, dense, 7))


def test_paged_dispatch(device, monkeypatch):
    """ops.indexer.indexer_topk sends a PagedRows to the Triton path where it is chosen."""
    q, weights, keys, cand = paged_inputs(6, 24, torch.float32, device)
    monkeypatch.setattr(ref, "use_triton", lambda t: True)
    calls = []
    kernel = tri.indexer_topk
    monkeypatch.setattr(tri, "indexer_topk", lambda *a: calls.append(1) or kernel(*a))
    got = ref.indexer_topk(q, weights, keys, cand, 6)
    assert len(calls) == 1
    monkeypatch.undo()                                   # the reference again, for the comparison
    assert_same_selection(got, q, weights, keys, cand.dense(), 6)


# SCORE_TILE 1 and 1 << 24 at 23 rows: tiles of 128 entries (k rounded to BLOCK_E; any SCORE_TILE
# below 23 * 128 gives the same, 40 included: test_tiles_and_ties_with_the_split_row_topk's) over
# the 300-wide rows, three tiles merged; or one tile
@pytest.mark.parametrize("rows_min", [1, 1 << 20])
@pytest.mark.parametrize("score_tile", [1, 1 << 24])
@pytest.mark.parametrize("topk", [3, 10])
def test_tiles_and_ties_are_the_reference(score_tile, topk, rows_min, device, monkeypatch):
    """Small-integer inputs (exact sums in any order, many exact ties): the streamed top-k of
    both tilings (SCORE_TILE 1: tiles of k entries rounded to a block) is the reference's
    selection, offsets and rows alike (score desc, ties to the lower offset), with a program
    per row (rows_min 1: row_topk) or many (radix_topk)."""
    monkeypatch.setattr(tri, "SCORE_TILE", score_tile)
    monkeypatch.setattr(tri, "ROWS_MIN", rows_min)
    monkeypatch.setattr(row_topk, "MIN_CHUNK", 128)      # short tiles: narrow programs (fast to interpret)
    cand, n = random_paged(23, 300, per_page=4, pitch=8, seed=topk, device=device)
    g = torch.Generator().manual_seed(score_tile % 97)
    q = torch.randint(-1, 2, (23, 2, 16), generator=g).float()
    weights = torch.randint(0, 2, (23, 2), generator=g).float()
    keys = torch.randint(-1, 2, (n, 16), generator=g).float()
    rows, offsets = tri.indexer_topk_offsets(q.to(device), weights.to(device), keys.to(device), cand, topk)
    cpu = PagedRows(*(v.cpu() for v in (cand.pages, cand.req, cand.lo, cand.hi)), cand.per_page, cand.pitch,
                    cand.width)
    with backend.forced("reference"):
        want_rows, want_offsets = ref.indexer_topk_offsets(q, weights, keys, cpu, topk)
    assert torch.equal(offsets.cpu(), want_offsets) and torch.equal(rows.cpu(), want_rows)
    assert tri.tile_width(23, topk, 16) % 16 == 0 and tri.tile_width(23, topk) >= topk


def test_tiles_and_ties_with_the_split_row_topk(device, monkeypatch):
    """test_tiles_and_ties_are_the_reference with row_topk's split variant as the indexer's
    (dsv4/ops/triton/row_topk_split.py; blocks of 64, tiles of 48 entries merged into a running
    set, ties beyond the small select's lanes: the big select)."""
    monkeypatch.setattr(row_topk, "SPLIT", Split(block=64, blocks=4, filter_warps=1, select_warps=1, lanes=16,
                                                 big_warps=1))
    test_tiles_and_ties_are_the_reference(40, 10, 1, device, monkeypatch)


def test_tile_topk_beside_the_scores(device, monkeypatch):
    """OVERLAP_TOPK: on a GPU each tile's top-k runs on a side stream while the next tile is
    scored, the same offsets as in order (on the CPU there is no side stream: in order)."""
    monkeypatch.setattr(tri, "SCORE_TILE", 40)
    monkeypatch.setattr(tri, "ROWS_MIN", 1)
    monkeypatch.setattr(row_topk, "MIN_CHUNK", 128)
    cand, n = random_paged(8, 300, per_page=4, pitch=8, seed=5, device=device)     # 8 rows: 3 tiles still
    g = torch.Generator().manual_seed(5)
    q, weights, keys = (torch.randn(*shape, generator=g).to(device) for shape in ((8, 2, 16), (8, 2), (n, 16)))
    got = {}
    for overlap in (True, False):
        monkeypatch.setattr(tri, "OVERLAP_TOPK", overlap)
        assert (tri._side_stream(q.device) is not None) == (overlap and q.is_cuda)
        got[overlap] = tri.indexer_topk_offsets(q, weights, keys, cand, 10)
    assert tri.tile_width(8, 10) < cand.width                   # several tiles
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))


class _InOrder:
    """A stand-in for a CUDA stream (everything runs in order on the device's own stream): it
    records the waits and events of `_rows_topk_beside`."""
    def __init__(self, log, device):
        self.device, self.log = torch.device(device), log

    def wait_event(self, event):
        self.log.append(("wait", event))

    def wait_stream(self, stream):
        pass

    def record_event(self):
        event = sum(kind == "event" for kind, _ in self.log)    # the n-th event: after tile n's top-k
        self.log.append(("event", event))
        return event


def test_tile_topk_beside_alternates_two_buffers(device, monkeypatch):
    """_rows_topk_beside's own logic (streams stood in for, so on the CPU too): the tiles' scores in two
    alternating buffers (the last tile narrower, a contiguous view), each reuse after the side
    stream's event for the tile two before; the offsets of the tiles in order."""
    import contextlib
    log = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _InOrder(log, device))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(7, 100, generator=g)
    scores[scores > 1.5] = 1.0                                  # ties across tiles
    scores = scores.to(device)
    tiles = [(0, 32), (32, 64), (64, 96), (96, 100)]
    used = []

    def score(e0, e1, out=None):
        used.append(out.data_ptr() if out is not None else None)
        if out is None:
            return scores[:, e0:e1].clone()
        assert out.is_contiguous() and out.shape == (7, e1 - e0)
        return out.copy_(scores[:, e0:e1])

    got = tri._rows_topk_beside(tiles, score, 5, _InOrder(log, device), 7, 32)
    want = tri._rows_topk(tiles, score, 5)
    assert torch.equal(got, want)
    assert used[0] == used[2] and used[1] == used[3] and used[0] != used[1]
    assert log == [("event", 0), ("event", 1), ("wait", 0), ("event", 2), ("wait", 1), ("event", 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_fp8_keys(dtype, device):
    """FP8 keys (uint8 [N, Di + 4], dsv4/ops/kv_fp8.py) dequantised in the kernel: the scores
    of the dequantised keys; the selection of the reference given the packed pool."""
    from dsv4.ops.kv_fp8 import pack_index_keys, unpack_index_keys
    q, weights, keys, cand = paged_inputs(9, 40, dtype, device, seed=4, Di=32)
    packed = pack_index_keys(keys.float())
    plain = unpack_index_keys(packed)
    assert_scores_close(tri.indexer_scores(q, weights, packed, cand).cpu(),
                        reference_scores(q.cpu(), weights.cpu(), plain.cpu(), cand.dense().cpu()))
    got = tri.indexer_topk(q, weights, packed, cand, 7)
    assert_same_selection(got, q, weights, plain, cand.dense(), 7)


def test_packed_fp8_keys_v4_rows(device):
    """V4's indexer rows (Di = 128: 132-byte rows, 33 words, so rows are only 4-byte aligned),
    keys of very different magnitudes (each row's own scale), bf16 q (the tensor-core dot of the
    unpacked keys, scaled after it): the scores of the dequantised keys and the reference's
    selection given the packed pool."""
    from dsv4.ops.kv_fp8 import pack_index_keys, unpack_index_keys
    q, weights, keys, cand = paged_inputs(5, 300, torch.bfloat16, device, seed=6, Di=128)
    g = torch.Generator().manual_seed(7)
    keys = keys.float() * torch.exp2(torch.randint(-6, 7, (keys.shape[0], 1), generator=g)).to(device)
    packed = pack_index_keys(keys)
    assert packed.shape[1] == 132
    plain = unpack_index_keys(packed)
    assert_scores_close(tri.indexer_scores(q, weights, packed, cand).cpu(),
                        reference_scores(q.cpu(), weights.cpu(), plain.cpu(), cand.dense().cpu()))
    got = tri.indexer_topk(q, weights, packed, cand, 40)
    assert_same_selection(got, q, weights, plain, cand.dense(), 40)
    with pytest.raises(ValueError, match="aligned"):
        tri.indexer_scores(q, weights, torch.zeros(packed.numel() + 1, dtype=torch.uint8, device=device)[1:]
                           .view(packed.shape), cand)
