"""Radix-select top-k (dsv4/ops/triton/radix_topk.py) against the definition: torch.topk over
stream_topk's int64 keys (score desc, ties to the lower offset, -inf never chosen), keys and
offsets bit for bit. Rows with exact ties (also more ties than the candidate slots: the
offset-order scan), -inf and -0.0 entries, rows shorter than k, rows of different lengths,
several programs per row, digits of 8 and of 11 bits."""
import pytest
import torch

from dsv4.ops.stream_topk import EMPTY_KEY, MIN_CHOSEN_KEY, key_offsets, score_keys
from dsv4.ops.triton import radix_topk as rt

NEG_INF = float("-inf")
LAYOUTS = [(8, 8, 8, 8), (11, 11, 10)]        # bits per pass


def reference(scores: torch.Tensor, k: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, offsets) [T, k]: the top k of score_keys, EMPTY_KEY / -1 past the valid ones."""
    keys = score_keys(scores, first)
    pad = torch.full((scores.shape[0], max(0, k - scores.shape[1])), EMPTY_KEY, dtype=torch.long)
    keys = torch.cat([keys, pad], dim=1).topk(k, dim=1).values
    keys = torch.where(keys >= MIN_CHOSEN_KEY, keys, EMPTY_KEY)
    return keys, key_offsets(keys)


def check(scores: torch.Tensor, k: int, device, first: int = 0, block: int | None = None,
          digits: tuple[int, ...] = rt.DIGITS) -> None:
    keys, offsets = rt.radix_topk(scores.to(device), k, first, block=block, digits=digits)
    want_keys, want_offsets = reference(scores, k, first)
    assert keys.shape == offsets.shape == (scores.shape[0], k)
    assert torch.equal(keys.cpu(), want_keys)
    assert torch.equal(offsets.cpu(), want_offsets)


def ragged_rows(T: int, W: int, seed: int) -> torch.Tensor:
    """Random scores; row t valid up to a length of its own (row 0 full, some rows empty)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, W, generator=g)
    lengths = torch.tensor([W - (W * t) // max(T - 1, 1) for t in range(T)])
    return scores.masked_fill(torch.arange(W)[None, :] >= lengths[:, None], NEG_INF)


@pytest.mark.parametrize("digits", LAYOUTS)
@pytest.mark.parametrize("T,W,k", [(1, 5000, 37), (5, 3000, 16), (3, 700, 64), (2, 40, 64), (4, 1, 3)])
def test_random_rows_of_different_lengths(T, W, k, digits, device):
    """Several rows, each valid up to its own length (some shorter than k, one empty), over
    several 1024-entry programs per row; k above W too."""
    check(ragged_rows(T, W, seed=T * W + k), k, device, block=1024, digits=digits)


def test_offsets_of_a_later_tile(device):
    """first_offset shifts every offset (the low word of the key) and the tie order with it."""
    scores = torch.randint(0, 4, (3, 900), generator=torch.Generator().manual_seed(3)).float()
    check(scores, 20, device, first=123456)


@pytest.mark.parametrize("digits", LAYOUTS)
@pytest.mark.parametrize("values", [3, 50])
def test_exact_ties(values, digits, device):
    """Small-integer scores: the k-th score ties with many; lower offsets win. values=3: the
    threshold bucket holds more ties than the candidate slots (the offset-order scan)."""
    g = torch.Generator().manual_seed(values)
    scores = torch.randint(-values, values, (4, 2500), generator=g).float() * 0.25
    scores[1] = 7.0                                            # one score everywhere
    scores[2, 1000:] = NEG_INF                                 # ties and a -inf tail
    check(scores, 40, device, block=1024, digits=digits)


def test_tie_scan_over_several_steps(device, monkeypatch):
    """More ties at the k-th score than candidate slots: the offset-order scan of the ties, in
    steps smaller than the row and than the ties it needs."""
    monkeypatch.setattr(rt, "SCAN_BLOCK", 256)
    W = rt.capacity(100) + 700
    scores = torch.zeros(2, W)
    scores[0, ::7] = 1.0                                       # W / 7 above, the rest ties at 0
    scores[1, :50] = NEG_INF
    scores[1, 1000:1010] = 2.0
    check(scores, 400, device)


def test_infinities_zeros_and_signs(device):
    """+inf is chosen first, -inf never; -0.0 ties with 0.0 (by offset); negatives order
    below positives; rows of only -inf give no choice."""
    scores = torch.tensor([[0.0, -0.0, NEG_INF, float("inf"), -1.0, 1e-30, -1e-30, 0.0, -0.0, 2.0],
                           [NEG_INF] * 10,
                           [-3.0, -2.0, NEG_INF, -1.0, -0.0, NEG_INF, -5.0, -4.0, -6.0, NEG_INF]])
    for k in (1, 4, 10, 12):
        check(scores, k, device)


@pytest.mark.parametrize("digits", LAYOUTS)
def test_thresholds_at_each_digit(digits, device):
    """Scores that differ only in the low bits: the threshold bucket resolves at a late pass
    (the first digit's bucket holds every entry)."""
    base = torch.tensor(1.5).view(torch.int32)
    bits = base + torch.randperm(4000, generator=torch.Generator().manual_seed(1))[:3000].to(torch.int32)
    scores = bits.view(torch.float32).reshape(2, 1500)
    check(scores, 50, device, block=1024, digits=digits)
    check(scores.round(decimals=3), 50, device, block=1024, digits=digits)   # coarser: ties again


def test_empty_shapes(device):
    for T, W, k in [(0, 10, 4), (3, 0, 4), (3, 10, 0)]:
        check(torch.randn(T, W), k, device)


def test_bad_input(device):
    with pytest.raises(ValueError, match="fp32"):
        rt.radix_topk(torch.randn(2, 8, dtype=torch.float64).to(device), 2)
    with pytest.raises(ValueError, match="unit column stride"):
        rt.radix_topk(torch.randn(8, 2).to(device).t(), 2)
    with pytest.raises(ValueError, match="digits"):
        rt.radix_topk(torch.randn(2, 8).to(device), 2, digits=(16, 16))
