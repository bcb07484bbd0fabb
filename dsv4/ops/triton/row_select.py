"""Triton helpers of the row top-k kernels (dsv4/ops/triton/row_topk.py, row_topk_split.py):
a row's scores as int32 s whose signed order is the scores' (stream_topk's key high word),
stream_topk's int64 keys, and the threshold search by counts (_narrow) with the tie rule
(_chosen): score descending, ties to the lower offset, -inf never chosen.
"""
import triton
import triton.language as tl

from .radix_topk import _order_keys

INT32_MIN = tl.constexpr(-2147483648)
NEG_INF_S = tl.constexpr(-2139095041)   # s of -inf (0xFF800000 -> 0x807FFFFF); valid entries are above


@triton.jit
def _signed_scores(row_ptr, offs, W):
    """Scores [offs] of a row (-inf past W) -> int32 s: stream_topk's key high word (signed
    order = the scores' order, -0.0 as 0.0); -inf and below -> INT32_MIN."""
    s = (_order_keys(tl.load(row_ptr + offs, mask=offs < W, other=float("-inf"))) ^ 0x80000000).to(tl.int32, bitcast=True)
    return tl.where(s > NEG_INF_S, s, INT32_MIN)


@triton.jit
def _key(s, offs, first):
    """stream_topk's int64 key of s at offsets first + offs."""
    return s.to(tl.int64) * 4294967296 + (4294967295 - (offs.to(tl.int64) + first))


@triton.jit
def _count_at_least(a, b, mid, HAS_B: tl.constexpr):
    """Entries of a (and b) with s >= mid (int64 scalar)."""
    m = mid.to(tl.int32)
    n = tl.sum((a >= m).to(tl.int32), axis=0).to(tl.int64)
    if HAS_B:
        n += tl.sum((b >= m).to(tl.int32), axis=0).to(tl.int64)
    return n


@triton.jit
def _narrow(a, b, lo, hi, n_lo, n_hi, k, stop, aim, HAS_B: tl.constexpr, INTERP: tl.constexpr):
    """Narrow lo < hi (count(>= lo) = n_lo >= k > n_hi = count(>= hi), over a and b) until
    n_lo <= stop or hi == lo + 1; an interpolated pivot aims at a count of `aim`."""
    bisect = tl.zeros([], tl.int1)
    while (n_lo > stop) & (hi - lo > 1):
        half = lo + (hi - lo) // 2
        if INTERP:      # where the counts, linear between lo and hi, reach aim (n_lo > aim >= k > n_hi);
            # fp32 (no int64 division): any pivot strictly inside is correct
            frac = (n_lo - aim).to(tl.float32) / (n_lo - n_hi).to(tl.float32)
            guess = lo + ((hi - lo).to(tl.float32) * frac).to(tl.int64)
            mid = tl.where(bisect, half, tl.minimum(tl.maximum(guess, lo + 1), hi - 1))
        else:
            mid = half
        c = _count_at_least(a, b, mid, HAS_B)
        before = hi - lo
        up = c >= k
        lo, n_lo = tl.where(up, mid, lo), tl.where(up, c, n_lo)
        hi, n_hi = tl.where(up, hi, mid), tl.where(up, n_hi, c)
        bisect = 2 * (hi - lo) > before
    return lo, hi, n_lo, n_hi


@triton.jit
def _chosen(a, lo, n_lo, n_hi, k, ties_before):
    """Entries of a to keep after _narrow: every one >= lo when n_lo <= k, else (hi == lo + 1)
    those above lo and the first k - n_hi ties at lo in block order, after ties_before ties."""
    lo32 = lo.to(tl.int32)
    take = a > lo32
    tie = a == lo32
    if n_lo <= k:
        take = take | tie
    else:
        rank = ties_before + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = take | (tie & (rank < k - n_hi))
    return take
