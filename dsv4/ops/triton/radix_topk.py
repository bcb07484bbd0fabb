"""Top-k of long fp32 rows by radix select, many programs per row (batch-1 decode at 1M
context: one row of 262k indexer scores must still fill the GPU).

Order and selection are those of dsv4/ops/stream_topk.py, bit for bit: score descending, ties
to the lower offset, -inf never chosen; the result is the int64 keys of `score_keys` (sorted
descending, EMPTY_KEY after the last valid one) and their offsets (-1 there).

Each score maps to an order-preserving uint32 u (-0.0 as 0.0; -inf and below are invalid).
A fixed sequence of launches (CUDA-graph safe: nothing on the host depends on the data):

  1. zero the per-row histograms and candidate counter  (one memset)
  2. three histogram passes over digits of u: bits [21, 32), [10, 21), [0, 10). Pass p counts
     the digit of the valid entries whose higher digits equal the threshold prefix so far
     (into hist[row, p]; per-program tl.histogram, then atomics on the non-zero bins). Every
     program re-derives the prefix from the earlier passes' histograms (`_threshold`); once
     the threshold bucket is small (entries above it + in it <= CAP) the later passes do nothing.
  3. collect: every valid entry above the threshold bucket and, unless that bucket overflows
     (more than CAP - above ties at the full 32 bits), every entry in it, as int64 keys, into
     cand[row, :CAP] (an atomic counter per row; the order there is arbitrary).
  4. finish (one program per row): sort cand (<= CAP keys) and keep the first k. On overflow
     the ties all have one score: the first k - above of them by offset follow the sorted
     entries above (a scan in offset order, only then).
"""
import torch
import triton
import triton.language as tl

from ..stream_topk import EMPTY_KEY

NBINS = 2048                    # digit values per pass (11 bits; the last pass uses 10)
NEG_INF_U = tl.constexpr(0x007FFFFF)    # u of -inf; valid entries are above
SCAN_BLOCK = 2048               # offsets per step of the overflow scan


@triton.jit
def _order_keys(scores):
    """fp32 -> uint32, order-preserving; -0.0 maps like 0.0 (it ties with it)."""
    bits = scores.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, 0, bits)
    return tl.where((bits & 0x80000000) != 0, ~bits, bits | 0x80000000)


@triton.jit
def _threshold(hist_ptr, k, NPASS: tl.constexpr, CAP: tl.constexpr, NBINS: tl.constexpr):
    """From hist[0:NPASS] of one row -> (prefix, level, above, m, resolved): the threshold
    bucket is the entries whose top bits (u >> shift of pass level - 1: 21, 10, 0) equal prefix; `above` valid
    entries lie above it, m in it, above < k <= above + m unless the row has fewer than k
    valid entries (then all of them are above + m). resolved: above + m <= CAP."""
    bins = tl.arange(0, NBINS)
    prefix = tl.full([], 0, tl.int64)
    above = tl.full([], 0, tl.int32)
    m = tl.full([], 0, tl.int32)
    level = tl.full([], 0, tl.int32)
    resolved = tl.full([], 0, tl.int32)                # 0 / 1
    for p in tl.static_range(NPASS):
        h = tl.load(hist_ptr + p * NBINS + bins)
        total = tl.sum(h, axis=0)
        suffix = total - tl.cumsum(h, axis=0) + h                   # entries in bins >= b
        b = tl.max(tl.where(above + suffix >= k, bins, 0), axis=0)  # 0 (take all) when < k valid
        in_b = tl.sum(tl.where(bins == b, h, 0), axis=0)
        over_b = tl.sum(tl.where(bins == b, suffix, 0), axis=0) - in_b
        width: tl.constexpr = 11 if p < 2 else 10
        use = resolved == 0
        prefix = tl.where(use, prefix * (1 << width) + b, prefix)
        above = tl.where(use, above + over_b, above)
        m = tl.where(use, in_b, m)
        level = tl.where(use, p + 1, level)
        resolved = tl.maximum(resolved, (above + m <= CAP).to(tl.int32))
    return prefix, level, above, m, resolved


@triton.jit
def _top_bits(u, level):
    """u's bits above the shift of pass level - 1: the prefix a level-`level` threshold compares."""
    return tl.where(level == 1, u >> 21, tl.where(level == 2, u >> 10, u)).to(tl.int64)


@triton.jit
def _row_keys(scores_ptr, row, stride_s, W, start, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    ok = offs < W
    u = _order_keys(tl.load(scores_ptr + row * stride_s + offs, mask=ok, other=float("-inf")))
    return offs, ok & (u > NEG_INF_U), u


# per-call sizes are not specialised: one compiled variant for every row length and k
@triton.jit(do_not_specialize=("W", "stride_s", "k", "n_blk"))
def _hist_kernel(scores_ptr, hist_ptr, W, stride_s, k, n_blk, PASS: tl.constexpr, CAP: tl.constexpr,
                 NBINS: tl.constexpr, BLOCK: tl.constexpr):
    # program = row x block [blk * BLOCK, (blk + 1) * BLOCK) of the row; hist [T, 3 * NBINS + 1]
    pid = tl.program_id(0).to(tl.int64)
    row, blk = pid // n_blk, pid % n_blk
    hist_row = hist_ptr + row * (3 * NBINS + 1)
    prefix, level, above, m, resolved = _threshold(hist_row, k, PASS, CAP, NBINS)
    if resolved == 0:
        offs, valid, u = _row_keys(scores_ptr, row, stride_s, W, blk * BLOCK, BLOCK)
        if PASS > 0:
            valid = valid & (_top_bits(u, level) == prefix)
        shift: tl.constexpr = 21 if PASS == 0 else (10 if PASS == 1 else 0)
        digit = tl.where(valid, (u >> shift) & (NBINS - 1), 0).to(tl.int32)
        counts = tl.histogram(digit, NBINS)
        bins = tl.arange(0, NBINS)
        # the entries left out were counted in bin 0
        counts -= tl.where(bins == 0, BLOCK - tl.sum(valid.to(tl.int32), axis=0), 0)
        tl.atomic_add(hist_row + PASS * NBINS + bins, counts, mask=counts > 0)


@triton.jit
def _stream_key(u, offs):
    """stream_topk's int64 key: the signed order of the score high, 2^32 - 1 - offset low."""
    return (u ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64) * 4294967296 + (4294967295 - offs)


@triton.jit(do_not_specialize=("W", "stride_s", "k", "n_blk", "first"))
def _collect_kernel(scores_ptr, hist_ptr, cand_ptr, W, stride_s, k, n_blk, first, CAP: tl.constexpr,
                    NBINS: tl.constexpr, BLOCK: tl.constexpr):
    # cand [T, CAP] int64; the counter is hist[row, 3 * NBINS]
    pid = tl.program_id(0).to(tl.int64)
    row, blk = pid // n_blk, pid % n_blk
    hist_row = hist_ptr + row * (3 * NBINS + 1)
    prefix, level, above, m, resolved = _threshold(hist_row, k, 3, CAP, NBINS)
    offs, valid, u = _row_keys(scores_ptr, row, stride_s, W, blk * BLOCK, BLOCK)
    top = _top_bits(u, level)
    take = valid & tl.where(resolved != 0, top >= prefix, top > prefix)
    n = tl.sum(take.to(tl.int32), axis=0)
    if n > 0:
        base = tl.atomic_add(hist_row + 3 * NBINS, n)
        slot = base + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(cand_ptr + row * CAP + slot, _stream_key(u, offs + first), mask=take)


@triton.jit(do_not_specialize=("W", "stride_s", "k", "first"))
def _finish_kernel(scores_ptr, hist_ptr, cand_ptr, keys_ptr, offsets_ptr, W, stride_s, k, first,
                   CAP: tl.constexpr, NBINS: tl.constexpr, SCAN: tl.constexpr):
    # keys/offsets [T, k] contiguous; one program per row
    row = tl.program_id(0).to(tl.int64)
    hist_row = hist_ptr + row * (3 * NBINS + 1)
    prefix, level, above, m, resolved = _threshold(hist_row, k, 3, CAP, NBINS)
    n = tl.load(hist_row + 3 * NBINS)
    slots = tl.arange(0, CAP)
    keys = tl.load(cand_ptr + row * CAP + slots, mask=slots < n, other=-9223372036854775807 - 1)  # EMPTY_KEY
    keys = tl.sort(keys, descending=True)                  # the n candidates first
    out = slots < tl.where(resolved != 0, k, above)       # on overflow the ties own [above, k)
    tl.store(keys_ptr + row * k + slots, keys, mask=out)
    tl.store(offsets_ptr + row * k + slots, tl.where(slots < n, 4294967295 - (keys & 4294967295), -1), mask=out)
    if resolved == 0:
        # overflow: the ties (u == prefix, 32 bits) fill slots [above, k), lowest offsets first
        need = k - above
        found = tl.full([], 0, tl.int32)
        start = tl.full([], 0, tl.int64)
        while (found < need) & (start < W):
            offs, valid, u = _row_keys(scores_ptr, row, stride_s, W, start, SCAN)
            tie = valid & (u.to(tl.int64) == prefix)
            rank = found + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            put = tie & (rank < need)
            tl.store(keys_ptr + row * k + above + rank, _stream_key(u, offs + first), mask=put)
            tl.store(offsets_ptr + row * k + above + rank, offs + first, mask=put)
            found += tl.sum(tie.to(tl.int32), axis=0)
            start += SCAN


def capacity(k: int) -> int:
    """Candidate slots per row: a power of two >= 2k (the finish kernel sorts them)."""
    return max(64, 2 * triton.next_power_of_2(k))


def block_size(T: int, W: int) -> int:
    """Entries per program: smaller blocks while the grid is under two waves of an H200's 132 SMs."""
    return 2048 if T * triton.cdiv(W, 4096) < 264 else 4096


def radix_topk(scores: torch.Tensor, k: int, first_offset: int = 0,
               block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, W] fp32 (unit column stride) of offsets first_offset + [0, W) -> (keys,
    offsets) [T, k] int64: `score_keys(scores, first_offset).topk(k)` (dsv4/ops/stream_topk.py)
    with EMPTY_KEY where a row has fewer than k valid (> -inf) scores, and the keys' offsets
    (-1 there). k may exceed W."""
    T, W = scores.shape
    if scores.dtype != torch.float32 or (W > 1 and scores.stride(1) != 1):
        raise ValueError("radix_topk: scores must be fp32 with unit column stride")
    if first_offset + W > 1 << 32:
        raise ValueError("radix_topk: offsets must stay below 2^32")
    device = scores.device
    if T == 0 or k == 0 or W == 0:
        return (torch.full((T, k), EMPTY_KEY, dtype=torch.long, device=device),
                torch.full((T, k), -1, dtype=torch.long, device=device))
    keys = torch.empty((T, k), dtype=torch.long, device=device)        # every slot written by _finish_kernel
    offsets = torch.empty((T, k), dtype=torch.long, device=device)
    cap, block = capacity(k), block or block_size(T, W)
    hist = torch.zeros((T, 3 * NBINS + 1), dtype=torch.int32, device=device)
    cand = torch.empty((T, cap), dtype=torch.long, device=device)
    n_blk = triton.cdiv(W, block)
    stride = scores.stride(0)
    for p in range(3):
        _hist_kernel[(T * n_blk,)](scores, hist, W, stride, k, n_blk, PASS=p, CAP=cap, NBINS=NBINS, BLOCK=block,
                                   num_warps=8)
    _collect_kernel[(T * n_blk,)](scores, hist, cand, W, stride, k, n_blk, first_offset, CAP=cap, NBINS=NBINS,
                                  BLOCK=block, num_warps=8)
    _finish_kernel[(T,)](scores, hist, cand, keys, offsets, W, stride, k, first_offset, CAP=cap, NBINS=NBINS,
                         SCAN=SCAN_BLOCK, num_warps=8)
    return keys, offsets
