"""Top-k of many rows of fp32 scores, one program per row (prefill chunks: 2,048 rows of a
tile of C4 entries), merged into a running top-k in the same kernel.

Selection is that of dsv4/ops/stream_topk.py, bit for bit: score descending, ties to the lower
offset, -inf never chosen. A program holds its row's chunk of CHUNK scores in registers as the
int32 s whose signed order is the scores' (stream_topk's key high word; -inf and below become
INT32_MIN: never counted), together with the row's running set (k int64 keys of lower offsets),
and reads them from memory once. It then finds the threshold by counting, with no histogram:

  lo, hi with count(s >= lo) >= k > count(s >= hi) (counts over the chunk and the running set);
  a count at a pivot lo < mid < hi replaces lo or hi; stop when count(s >= lo) == k (those are
  the top k) or hi == lo + 1 (lo is the k-th score: the entries above it, and the first ties at
  lo by offset). The pivot bisects, or (INTERP) interpolates the counts linearly, falling back
  to a bisection after an interpolation that did not halve the range (at most twice the
  bisection's 33 counts).

The chosen entries are written as keys in ascending offset order (the running set first: its
offsets are below the chunk's), so that order is the tie order of the next chunk, and
EMPTY_KEY after them. `RowTopk.offsets` sorts the final set once (the reference's order).
"""
import torch
import triton
import triton.language as tl

from ..stream_topk import EMPTY_KEY, key_offsets
from .radix_topk import _order_keys

CHUNK = 32768               # scores per program (registers: CHUNK / (32 * num_warps) int32 a thread)
NUM_WARPS = 16
INTERP = True               # interpolated pivots (bisection when False)
MIN_CHUNK = 2048            # the smallest compiled chunk (shorter tiles round up: few variants)
INT32_MIN = tl.constexpr(-2147483648)
NEG_INF_S = tl.constexpr(-2139095041)   # s of -inf (0xFF800000 -> 0x807FFFFF); valid entries are above


@triton.jit
def _count_at_least(s, ps, mid):
    """Entries of the chunk and of the running set with s >= mid (int64 scalar)."""
    m = mid.to(tl.int32)
    return tl.sum((s >= m).to(tl.int32), axis=0).to(tl.int64) + tl.sum((ps >= m).to(tl.int32), axis=0).to(tl.int64)


# per-call sizes are not specialised: one compiled variant per chunk width
@triton.jit(do_not_specialize=("W", "stride_s", "k", "first"))
def _row_topk_kernel(scores_ptr, prev_ptr, out_ptr, W, stride_s, k, first, WP: tl.constexpr, KP: tl.constexpr,
                     HAS_PREV: tl.constexpr, INTERP: tl.constexpr):
    # scores [T, W] (unit column stride) of offsets first + [0, W); prev/out [T, k] int64 keys
    # in ascending offset order, EMPTY_KEY after the last (prev's offsets are all below first)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, WP)
    s = (_order_keys(tl.load(scores_ptr + row * stride_s + offs, mask=offs < W, other=float("-inf")))
         ^ 0x80000000).to(tl.int32, bitcast=True)
    s = tl.where(s > NEG_INF_S, s, INT32_MIN)                                  # [WP]
    slots = tl.arange(0, KP)
    if HAS_PREV:
        pk = tl.load(prev_ptr + row * k + slots, mask=slots < k, other=-9223372036854775807 - 1)
    else:
        pk = tl.full([KP], -9223372036854775807 - 1, tl.int64)                  # EMPTY_KEY
    ps = (pk >> 32).to(tl.int32)                                               # [KP]; EMPTY_KEY: INT32_MIN
    n_lo = (tl.sum((s > INT32_MIN).to(tl.int32), axis=0) + tl.sum((ps > INT32_MIN).to(tl.int32), axis=0)).to(tl.int64)
    big = 2147483647
    lo = tl.minimum(tl.min(tl.where(s > INT32_MIN, s, big), axis=0),
                    tl.min(tl.where(ps > INT32_MIN, ps, big), axis=0)).to(tl.int64)   # count(>= lo) = n_lo
    hi = tl.maximum(tl.max(s, axis=0), tl.max(ps, axis=0)).to(tl.int64) + 1          # count(>= hi) = 0
    n_hi = tl.zeros([], tl.int64)
    bisect = tl.zeros([], tl.int1)
    while (n_lo > k) & (hi - lo > 1):
        half = lo + (hi - lo) // 2
        if INTERP:      # where the counts, linear between lo and hi, reach k
            guess = lo + (hi - lo) * (n_lo - k) // (n_lo - n_hi)
            mid = tl.where(bisect, half, tl.minimum(tl.maximum(guess, lo + 1), hi - 1))
        else:
            mid = half
        c = _count_at_least(s, ps, mid)
        before = hi - lo
        up = c >= k
        lo, n_lo = tl.where(up, mid, lo), tl.where(up, c, n_lo)
        hi, n_hi = tl.where(up, hi, mid), tl.where(up, n_hi, c)
        bisect = 2 * (hi - lo) > before
    # chosen: s >= lo when n_lo <= k (every valid entry when fewer than k), else s > lo (n_hi < k
    # of them) and the first k - n_hi entries with s == lo in offset order (the running set first)
    lo32 = lo.to(tl.int32)
    take_s = s > lo32
    take_p = ps > lo32
    if n_lo <= k:
        take_s = take_s | (s == lo32)
        take_p = take_p | (ps == lo32)
    else:
        need = k - n_hi
        tie_p = ps == lo32
        tie_s = s == lo32
        rank_p = tl.cumsum(tie_p.to(tl.int32), axis=0) - 1
        rank_s = tl.sum(tie_p.to(tl.int32), axis=0) + tl.cumsum(tie_s.to(tl.int32), axis=0) - 1
        take_p = take_p | (tie_p & (rank_p < need))
        take_s = take_s | (tie_s & (rank_s < need))
    n_p = tl.sum(take_p.to(tl.int32), axis=0)
    slot_p = tl.cumsum(take_p.to(tl.int32), axis=0) - 1
    slot_s = n_p + tl.cumsum(take_s.to(tl.int32), axis=0) - 1
    n = n_p + tl.sum(take_s.to(tl.int32), axis=0)
    out = out_ptr + row * k
    tl.store(out + slot_p, pk, mask=take_p)
    tl.store(out + slot_s, s.to(tl.int64) * 4294967296 + (4294967295 - (offs.to(tl.int64) + first)), mask=take_s)
    tl.store(out + slots, tl.full([KP], -9223372036854775807 - 1, tl.int64), mask=(slots >= n) & (slots < k))


def chunk_width(W: int, chunk: int) -> int:
    """Compiled width of a program's scores: a power of two >= the tile's columns (at least
    MIN_CHUNK, at most chunk: wider tiles take several launches)."""
    return min(chunk, max(MIN_CHUNK, triton.next_power_of_2(W)))


def row_topk(scores: torch.Tensor, k: int, first_offset: int = 0, prev: torch.Tensor | None = None,
             chunk: int = CHUNK, num_warps: int = NUM_WARPS, interp: bool = INTERP) -> torch.Tensor:
    """scores [T, W] fp32 (unit column stride) of offsets first_offset + [0, W); prev [T, k]
    int64 keys of offsets below first_offset (a running set of this function) or None -> [T, k]
    int64: the top k keys of `score_keys(scores, first_offset)` and prev (dsv4/ops/stream_topk.py),
    in ascending offset order, EMPTY_KEY after the last. chunk: columns per launch (a power of two)."""
    T, W = scores.shape
    if scores.dtype != torch.float32 or (W > 1 and scores.stride(1) != 1):
        raise ValueError("row_topk: scores must be fp32 with unit column stride")
    if first_offset + W > 1 << 32:
        raise ValueError("row_topk: offsets must stay below 2^32")
    if chunk & (chunk - 1) or chunk < MIN_CHUNK:
        raise ValueError(f"row_topk: chunk must be a power of two >= {MIN_CHUNK}, got {chunk}")
    if prev is not None and (prev.shape != (T, k) or prev.dtype != torch.long):
        raise ValueError(f"row_topk: prev must be int64 [{T}, {k}], got {prev.dtype} {tuple(prev.shape)}")
    if prev is None and (T == 0 or k == 0 or W == 0):
        return torch.full((T, k), EMPTY_KEY, dtype=torch.long, device=scores.device)
    if T == 0 or k == 0 or W == 0:
        return prev
    wp = chunk_width(W, chunk)
    for c0 in range(0, W, wp):
        part = scores[:, c0:c0 + wp]
        out = torch.empty((T, k), dtype=torch.long, device=scores.device)
        _row_topk_kernel[(T,)](part, out if prev is None else prev, out, part.shape[1], scores.stride(0), k,
                               first_offset + c0, WP=wp, KP=triton.next_power_of_2(k), HAS_PREV=prev is not None,
                               INTERP=interp, num_warps=num_warps)
        prev = out
    return prev


def sorted_keys(keys: torch.Tensor) -> torch.Tensor:
    """A running set [T, k] -> the same keys in the reference's order (key descending: score
    desc, ties to the lower offset; EMPTY_KEY last)."""
    return keys.sort(dim=1, descending=True).values


class RowTopk:
    """The best k (score, offset) pairs of T rows over tiles added in ascending offset order
    (RunningTopk's contract for prefill-sized T: the merge is part of row_topk's kernel)."""

    def __init__(self, k: int):
        self.k = k
        self.keys: torch.Tensor | None = None

    def add(self, scores: torch.Tensor, first_offset: int) -> None:
        """Merge scores [T, W] of offsets first_offset + [0, W), above every offset added so far."""
        self.keys = row_topk(scores, self.k, first_offset, self.keys)

    def offsets(self) -> torch.Tensor:
        """[T, k] long: chosen offsets in (score desc, offset asc) order, -1 after the last."""
        return key_offsets(sorted_keys(self.keys))
