"""Row-per-program top-k with a running set (dsv4/ops/triton/row_topk.py) against the
definition: torch.topk over stream_topk's int64 keys of every tile so far (score desc, ties to
the lower offset, -inf never chosen), bit for bit. Rows with exact ties (also ties split between
the running set and a new tile, and more ties than k), -inf tails, rows with fewer than k finite
scores, empty rows, several chunks per tile, several tiles, bisected and interpolated pivots.
The split variant (dsv4/ops/triton/row_topk_split.py) likewise, and on scores of every shape
(random, rising, falling, constant, causal tails, clustered), its small, second and big selects
each forced, the edges' bounds and a first tile by a program per row."""
import pytest
import torch

from dsv4.ops.stream_topk import EMPTY_KEY, MIN_CHOSEN_KEY, key_offsets, score_keys
from dsv4.ops.triton import row_topk as rk
from dsv4.ops.triton.row_topk_split import Split

NEG_INF = float("-inf")
CHUNK = 2048                # a small chunk: wider tiles take several launches


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 2048 (the interpreter runs a chunk's block in numpy: small is fast)."""
    monkeypatch.setattr(rk, "MIN_CHUNK", CHUNK)
PIVOTS = [True, False]      # interpolated, bisected
# (interpolated pivots, scores a step of stage 1's second read; 0: candidates from registers)
VARIANTS = [(True, 512), (False, 0), (True, 0)]
# split variants: launches of 2048 columns (4 blocks of 512 with the edges first, or 8 of 256
# without, or 4 of 512 with slots of twice k's power of two), a small select of a few lanes (more
# candidates: the big select; or first a select of 128 lanes)
SPLITS = [Split(block=512, blocks=4, filter_warps=4, select_warps=4, lanes=128, big_warps=4),
          Split(block=256, blocks=8, filter_warps=2, select_warps=4, lanes=64, big_warps=2, edges_first=False),
          Split(block=512, blocks=4, filter_warps=4, select_warps=4, lanes=128, big_warps=4, slot_mult=2),
          Split(block=256, blocks=8, filter_warps=2, select_warps=2, lanes=32, big_warps=2, mid_lanes=128)]
NO_EDGES = Split(block=512, blocks=4, filter_warps=4, select_warps=4, lanes=128, big_warps=4, edges_first=False)


def reference(scores: torch.Tensor, k: int, first: int = 0) -> torch.Tensor:
    """[T, k] keys in the reference's order: the top k of score_keys, EMPTY_KEY past the valid ones."""
    keys = score_keys(scores, first)
    pad = torch.full((scores.shape[0], max(0, k - scores.shape[1])), EMPTY_KEY, dtype=torch.long)
    keys = torch.cat([keys, pad], dim=1).topk(k, dim=1).values
    return torch.where(keys >= MIN_CHOSEN_KEY, keys, EMPTY_KEY)


def check_tiles(scores: torch.Tensor, k: int, device, widths: list[int], first: int = 0, interp: bool = True,
                sub: int = rk.SUB, split: Split | None = None) -> torch.Tensor | None:
    """Add scores tile by tile (widths), then compare the set (ascending offsets) and the
    sorted offsets with the reference over the whole row -> for a split variant, the launches
    per row whose big select chose ([T] int32, summed over the tiles)."""
    running = rk.RowTopk(k)
    e0, big = 0, None
    for w in widths:
        part = scores[:, e0:e0 + w].to(device)
        if split is None:
            keys = rk.row_topk(part, k, first + e0, running.keys, chunk=CHUNK, interp=interp, sub=sub)
        else:
            keys, fb = rk.row_topk_big_selects(part, k, first + e0, running.keys, interp=interp, split=split)
            big = fb if big is None else big + fb
        running.keys = keys
        e0 += w
    assert e0 == scores.shape[1]
    want = reference(scores, k, first)
    got = running.keys.cpu()
    offs = key_offsets(got)
    chosen = offs >= 0
    assert torch.equal(chosen, torch.arange(k)[None, :] < chosen.sum(1, keepdim=True))   # EMPTY_KEY last
    assert bool((offs[:, 1:] > offs[:, :-1])[chosen[:, 1:]].all())                      # ascending offsets
    assert torch.equal(rk.sorted_keys(got), want)
    assert torch.equal(running.offsets().cpu(), key_offsets(want))
    return None if big is None else big.cpu()


def ragged_rows(T: int, W: int, seed: int) -> torch.Tensor:
    """Random scores; row t valid up to a length of its own (row 0 full, the last empty)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, W, generator=g)
    lengths = torch.tensor([W - (W * t) // max(T - 1, 1) for t in range(T)])
    return scores.masked_fill(torch.arange(W)[None, :] >= lengths[:, None], NEG_INF)


@pytest.mark.parametrize("interp,sub", VARIANTS)
@pytest.mark.parametrize("T,W,k", [(3, 5000, 37), (4, 700, 64), (2, 40, 64), (3, 1, 3)])
def test_one_tile_rows_of_different_lengths(T, W, k, interp, sub, device):
    """One tile, valid up to a length per row (some shorter than k, one empty); 5000 columns
    take three launches of 2048, the later ones merging into the earlier ones' set."""
    check_tiles(ragged_rows(T, W, seed=T * W + k), k, device, [W], interp=interp, sub=sub)


@pytest.mark.parametrize("interp", PIVOTS)
def test_several_tiles_and_a_first_offset(interp, device):
    """Tiles of different widths merged in offset order; first_offset shifts every key."""
    scores = ragged_rows(3, 3000, seed=5)
    check_tiles(scores, 50, device, [900, 100, 2000], first=123456, interp=interp)


@pytest.mark.parametrize("interp,sub", VARIANTS)
@pytest.mark.parametrize("values", [3, 50])
def test_exact_ties(values, interp, sub, device):
    """Small-integer scores: the k-th score ties with many, lower offsets win, also across
    tiles (the running set's ties come first); a row of one score; ties and a -inf tail."""
    g = torch.Generator().manual_seed(values)
    scores = torch.randint(-values, values, (4, 2500), generator=g).float() * 0.25
    scores[1] = 7.0
    scores[2, 1000:] = NEG_INF
    check_tiles(scores, 40, device, [2500], interp=interp, sub=sub)
    check_tiles(scores, 40, device, [30, 1200, 1270], interp=interp, sub=sub)


def test_fewer_finite_than_k_across_tiles(device):
    """Rows with fewer than k finite scores over all tiles: every finite one, EMPTY_KEY after;
    a row of only -inf chooses nothing; -0.0 ties with 0.0 by offset; +inf comes first."""
    scores = torch.full((3, 300), NEG_INF)
    scores[0, ::37] = torch.arange(9).float()
    scores[0, 5] = -0.0
    scores[0, 250] = 0.0
    scores[0, 299] = float("inf")
    scores[2, 100:110] = -1.0
    for k in (1, 4, 12, 40):
        check_tiles(scores, k, device, [100, 200])


def test_scores_that_differ_in_the_low_bits(device):
    """Scores a few ulps apart (the pivots narrow to single values), and rounded ones (ties)."""
    base = torch.tensor(1.5).view(torch.int32)
    bits = base + torch.randperm(4000, generator=torch.Generator().manual_seed(1))[:3000].to(torch.int32)
    scores = bits.view(torch.float32).reshape(2, 1500)
    check_tiles(scores, 50, device, [1500])
    check_tiles(scores.round(decimals=3), 50, device, [700, 800], interp=False)


@pytest.mark.parametrize("split", SPLITS, ids=Split.label)
@pytest.mark.parametrize("T,W,k", [(3, 5000, 37), (4, 700, 64), (2, 40, 64), (3, 2500, 300)])
def test_split_rows_of_different_lengths(T, W, k, split, device):
    """The split variant on test_one_tile's rows: three launches of 2048 columns (or fewer
    blocks: the edges alone), blocks of only -inf, rows shorter than k, one empty; k above a
    block's size (a block keeps all its candidates, bounds none)."""
    check_tiles(ragged_rows(T, W, seed=T * W + k), k, device, [W], split=split)


def shaped_rows(shape: str, T: int, W: int, seed: int) -> torch.Tensor:
    """[T, W] scores of one shape along the row: random; rising or falling with the offset (the
    best at the newest / oldest entries, over noise); constant (every score ties); causal tails
    (row t valid for its first 1 + t * t entries: early rows of a chunk, mostly -inf); clustered
    (a few runs of high scores at random places)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(T, W, generator=g)
    ramp = torch.linspace(0, 8, W)
    if shape == "random":
        return noise
    if shape == "rising":
        return noise + ramp
    if shape == "falling":
        return noise - ramp
    if shape == "constant":
        return torch.full((T, W), 1.25)
    if shape == "causal":
        lengths = 1 + torch.arange(T) ** 2
        return noise.masked_fill(torch.arange(W)[None, :] >= lengths[:, None], NEG_INF)
    assert shape == "clustered"
    starts = torch.randint(0, W - 64, (T, 3), generator=g)
    cols = torch.arange(W)[None, None, :]
    inside = ((cols >= starts[..., None]) & (cols < starts[..., None] + 64)).any(1)
    return noise + 6.0 * inside


SHAPES = ["random", "rising", "falling", "constant", "causal", "clustered"]


@pytest.mark.parametrize("split", SPLITS, ids=Split.label)
@pytest.mark.parametrize("shape", SHAPES)
def test_split_score_shapes(shape, split, device):
    """Every score shape as a first tile and merged into a full running set (three launches,
    the last one narrower), the small and big selects as the candidates fall: the reference.
    Three rows (a program per row and block): the random shapes' rows are alike, the causal
    ones (1, 2 and 5 valid scores) all below k and every split's lanes, as rows 4 and 5 were."""
    check_tiles(shaped_rows(shape, 3, 6000, seed=len(shape)), 40, device, [2048, 1952, 2000], first=99, split=split)


@pytest.mark.parametrize("shape", SHAPES)
def test_split_big_select_forced(shape, device):
    """Lanes of 16: every row with more candidates is chosen by the big select (in its first
    launch at least where it has more than 16 valid scores: each a candidate), the same selection."""
    split = Split(block=256, blocks=8, filter_warps=2, select_warps=2, lanes=16, big_warps=2)
    scores = shaped_rows(shape, 6, 4096, seed=7)
    big = check_tiles(scores, 40, device, [2048, 2048], split=split)
    assert bool((big[(scores[:, :2048] > NEG_INF).sum(1) > 16] >= 1).all())


def test_split_mid_select(device):
    """mid_lanes: rows beyond the small select's 16 lanes and within 64 (causal rows of 17 and
    26 valid scores) are chosen by the second select, not the big one; 80 candidates (the edges
    of a rising row) still go to the big select."""
    mid = Split(block=256, blocks=8, filter_warps=2, select_warps=2, lanes=16, big_warps=2, mid_lanes=64)
    no_mid = Split(block=256, blocks=8, filter_warps=2, select_warps=2, lanes=16, big_warps=2)
    causal = shaped_rows("causal", 6, 2048, seed=3)
    assert check_tiles(causal, 40, device, [2048], split=mid).tolist() == [0] * 6
    assert check_tiles(causal, 40, device, [2048], split=no_mid).tolist() == [0, 0, 0, 0, 1, 1]
    rising = torch.arange(2048).float().repeat(2, 1)
    assert check_tiles(rising, 40, device, [2048], split=mid).tolist() == [1, 1]


def test_split_first_tile_by_rows(device):
    """first_rows: a first tile (no running set) takes a program per row (no big select even
    with lanes of 16), the next tiles the split kernels (the big select for a crowded row)."""
    split = Split(block=256, blocks=8, filter_warps=2, select_warps=2, lanes=16, big_warps=2, first_rows=True)
    scores = shaped_rows("rising", 3, 4096, seed=5)
    keys, big = rk.row_topk_big_selects(scores[:, :2048].to(device), 40, 0, None, split=split)
    assert big.tolist() == [0, 0, 0]
    assert torch.equal(rk.sorted_keys(keys).cpu(), reference(scores[:, :2048], 40))
    keys, big = rk.row_topk_big_selects(scores[:, 2048:].to(device), 40, 2048, keys, split=split)
    assert big.tolist() == [1, 1, 1]
    assert torch.equal(rk.sorted_keys(keys).cpu(), reference(scores, 40))


@pytest.mark.parametrize("shape", ["rising", "falling", "constant"])
def test_split_edges_bound_the_other_blocks(shape, device):
    """Scores rising, falling or tied along the row: the oldest and newest blocks' k-th keys
    leave the other blocks no candidate, so the small select (128 lanes: the two edges' 40 each)
    chooses every row; without the edges first each block keeps its best 40 (the big select)."""
    scores = shaped_rows(shape, 3, 4096, seed=2)
    if shape != "constant":
        scores = torch.arange(4096).float().repeat(3, 1) * (0.5 if shape == "rising" else -0.5)
    assert check_tiles(scores, 40, device, [2048, 2048], split=SPLITS[0]).tolist() == [0, 0, 0]
    assert bool((check_tiles(scores, 40, device, [2048, 2048], split=NO_EDGES) >= 1).all())


@pytest.mark.parametrize("values,split", [(3, SPLITS[1]), (50, SPLITS[0])], ids=["3", "50"])
def test_split_exact_ties(values, split, device):
    """test_exact_ties on the split variant: runs of ties longer than a block keeps (the first
    in offset order kept), ties split between the running set and the tile; -inf tails."""
    g = torch.Generator().manual_seed(values)
    scores = torch.randint(-values, values, (4, 2500), generator=g).float() * 0.25
    scores[1] = 7.0
    scores[2, 1000:] = NEG_INF
    check_tiles(scores, 40, device, [2500], split=split)
    check_tiles(scores, 40, device, [30, 1200, 1270], split=split)


def test_split_bad_sizes(device):
    for bad in (Split(block=300), Split(blocks=3), Split(lanes=100), Split(big_warps=0), Split(block=8),
                Split(slot_mult=3), Split(mid_lanes=1024), Split(mid_lanes=3000)):
        with pytest.raises(ValueError, match="split"):
            rk.row_topk(torch.randn(2, 8).to(device), 2, split=bad)


def test_empty_shapes(device):
    for T, W, k in [(0, 10, 4), (3, 0, 4), (3, 10, 0)]:
        keys = rk.row_topk(torch.randn(T, W).to(device), k)
        assert torch.equal(keys.cpu(), torch.full((T, k), EMPTY_KEY))


def test_bad_input(device):
    with pytest.raises(ValueError, match="fp32"):
        rk.row_topk(torch.randn(2, 8, dtype=torch.float64).to(device), 2)
    with pytest.raises(ValueError, match="unit column stride"):
        rk.row_topk(torch.randn(8, 2).to(device).t(), 2)
    with pytest.raises(ValueError, match="chunk"):
        rk.row_topk(torch.randn(2, 8).to(device), 2, chunk=3000)
    with pytest.raises(ValueError, match="chunk"):
        rk.row_topk(torch.randn(2, 8).to(device), 2, chunk=64)
    with pytest.raises(ValueError, match="sub"):
        rk.row_topk(torch.randn(2, 8).to(device), 2, sub=48)
    with pytest.raises(ValueError, match="cap"):
        rk.row_topk(torch.randn(2, 8).to(device), 20, cap=16)
    with pytest.raises(ValueError, match="prev"):
        rk.row_topk(torch.randn(2, 8).to(device), 2, prev=torch.zeros(2, 3, dtype=torch.long).to(device))


def test_a_small_k_takes_the_min_kp_variant(device, monkeypatch):
    """k below MIN_KP (a step of many short prompts) launches the program compiled for MIN_KP
    (the one the warm-up's shortest row-top-k prefill compiles), with the reference's keys."""
    launched = []
    kernel = rk._row_topk_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launched.append((kw["KP"], kw["CAP"]))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(rk, "_row_topk_kernel", Spy())
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 100, generator=g)
    for k in (1, 3, rk.MIN_KP):
        assert torch.equal(rk.sorted_keys(rk.row_topk(scores.to(device), k)).cpu(), reference(scores, k))
    assert set(launched) == {(rk.MIN_KP, rk.capacity(rk.MIN_KP))}
