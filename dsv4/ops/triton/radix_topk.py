"""Top-k of long fp32 rows by radix select, many programs per row (batch-1 decode at 1M
context: one row of 262k indexer scores must still fill the GPU).

Order and selection are those of dsv4/ops/stream_topk.py, bit for bit: score descending, ties
to the lower offset, -inf never chosen; the result is the int64 keys of `score_keys` (sorted
descending, EMPTY_KEY after the last valid one) and their offsets (-1 there).

Each score maps to an order-preserving uint32 u (-0.0 as 0.0; -inf and below are invalid).
A fixed sequence of launches (CUDA-graph safe: nothing on the host depends on the data):

  1. zero the per-row histograms and candidate counter (one memset)
  2. a pass per digit of u, most significant first (DIGITS: 8, 8, 8, 8 bits or 11, 11, 10):
     hist: count the digit of the valid entries whose higher digits equal the threshold
       prefix so far (many programs per row: tl.histogram, then atomics on the non-zero bins);
     derive (a program per row): the bucket holding the k-th entry -> state = (prefix, shift:
       the bucket is the entries with u >> shift == prefix, above: valid entries above the
       bucket, m: entries in it). Once above + m <= CAP the row is resolved and the later
       passes leave it alone.
  3. collect: every valid entry above the threshold bucket and, unless the row is still
     unresolved after 32 bits (more than CAP - above entries tie at the k-th score), every
     entry in it, as int64 keys into cand[row, :CAP] (an atomic counter; arbitrary order).
  4. finish (a program per row): rank the candidates (count the greater keys), write the
     first k in order. When unresolved, the ties all have one score: the first k - above of
     them by offset follow (a scan in offset order).

In Triton's interpreter (CPU tests) a derive program takes many rows at once (ROWS): the same
code on [ROWS, NBINS] blocks, far fewer interpreted programs.
"""
import os

import torch
import triton
import triton.language as tl

from ..stream_topk import EMPTY_KEY

# bits per pass, most significant first (sum 32). Narrow digits make a pass cheaper (tl.histogram
# costs O(bins / 32) per entry) but need more passes (each a launch and a derive).
DIGITS = (8, 8, 8, 8)
NEG_INF_U = tl.constexpr(0x007FFFFF)    # u of -inf; valid entries are above
SCAN_BLOCK = 2048               # offsets per step of the tie scan
RANK_I, RANK_J = 32, 256        # candidates ranked per step of the finish, against RANK_J at a time
STATE = 4                       # per-row state: prefix, shift, above, m (int64)


@triton.jit
def _order_keys(scores):
    """fp32 -> uint32, order-preserving; -0.0 maps like 0.0 (it ties with it)."""
    bits = scores.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, 0, bits)
    return tl.where((bits & 0x80000000) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _stream_key(u, offs):
    """stream_topk's int64 key: the signed order of the score high, 2^32 - 1 - offset low."""
    return (u ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64) * 4294967296 + (4294967295 - offs)


# per-call sizes are not specialised: one compiled variant for every row length and k
@triton.jit(do_not_specialize=("W", "stride_s", "n_blk"))
def _hist_kernel(scores_ptr, hist_ptr, state_ptr, W, stride_s, n_blk, PASS: tl.constexpr, SHIFT: tl.constexpr,
                 WIDTH: tl.constexpr, CAP: tl.constexpr, NBINS: tl.constexpr, HIST_ROW: tl.constexpr,
                 BLOCK: tl.constexpr):
    # program = row x entries [blk * BLOCK, (blk + 1) * BLOCK); hist [T, HIST_ROW] int32: a
    # pass's NBINS bins after another, then the candidate counter
    pid = tl.program_id(0).to(tl.int64)
    row, blk = pid // n_blk, pid % n_blk
    work = True                 # pass 0 counts every valid entry; later passes, unresolved rows only
    if PASS > 0:
        prefix, shift = tl.load(state_ptr + row * 4), tl.load(state_ptr + row * 4 + 1)
        work = tl.load(state_ptr + row * 4 + 2) + tl.load(state_ptr + row * 4 + 3) > CAP
    if work:
        offs = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        u = _order_keys(tl.load(scores_ptr + row * stride_s + offs, mask=offs < W, other=float("-inf")))
        valid = u > NEG_INF_U
        if PASS > 0:
            valid = valid & ((u >> shift).to(tl.int64) == prefix)
        counts = tl.histogram(tl.where(valid, (u >> SHIFT) & ((1 << WIDTH) - 1), 0).to(tl.int32), NBINS)
        bins = tl.arange(0, NBINS)
        counts -= tl.where(bins == 0, BLOCK - tl.sum(valid.to(tl.int32), axis=0), 0)   # the rest fell in bin 0
        tl.atomic_add(hist_ptr + row * HIST_ROW + PASS * NBINS + bins, counts, mask=counts > 0)


@triton.jit(do_not_specialize=("T", "k"))
def _derive_kernel(hist_ptr, state_ptr, T, k, PASS: tl.constexpr, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
                   CAP: tl.constexpr, NBINS: tl.constexpr, HIST_ROW: tl.constexpr, ROWS: tl.constexpr):
    # state [T, 4] int64 (prefix, shift, above, m): the entries with u >> shift == prefix are
    # the threshold bucket, m of them; `above` valid entries lie above it; above < k <= above
    # + m, or all of a row's valid entries when it has fewer than k.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)     # [ROWS]
    row_ok = rows < T
    if PASS == 0:
        prefix = tl.zeros([ROWS], tl.int64)
        shift = tl.zeros([ROWS], tl.int64)
        above = tl.zeros([ROWS], tl.int64)
        m = tl.full([ROWS], CAP + 1, tl.int64)
    else:
        prefix = tl.load(state_ptr + rows * 4, mask=row_ok, other=0)
        shift = tl.load(state_ptr + rows * 4 + 1, mask=row_ok, other=0)
        above = tl.load(state_ptr + rows * 4 + 2, mask=row_ok, other=0)
        m = tl.load(state_ptr + rows * 4 + 3, mask=row_ok, other=0)
    use = above + m > CAP                                                   # unresolved rows
    bins = tl.arange(0, NBINS)
    h = tl.load(hist_ptr + rows[:, None] * HIST_ROW + PASS * NBINS + bins[None, :],
                mask=row_ok[:, None], other=0).to(tl.int64)                 # [ROWS, NBINS]
    upto = tl.cumsum(h, axis=1)                                             # entries in bins <= b
    total = tl.sum(h, axis=1)
    b = tl.max(tl.where(above[:, None] + total[:, None] - upto + h >= k, bins[None, :], 0), axis=1)  # 0: < k valid
    at_b = bins[None, :] == b[:, None]
    in_b = tl.sum(tl.where(at_b, h, 0), axis=1)
    over_b = total - tl.sum(tl.where(at_b, upto, 0), axis=1)
    tl.store(state_ptr + rows * 4, tl.where(use, prefix * (1 << WIDTH) + b, prefix), mask=row_ok)
    tl.store(state_ptr + rows * 4 + 1, tl.where(use, SHIFT, shift), mask=row_ok)
    tl.store(state_ptr + rows * 4 + 2, tl.where(use, above + over_b, above), mask=row_ok)
    tl.store(state_ptr + rows * 4 + 3, tl.where(use, in_b, m), mask=row_ok)


@triton.jit(do_not_specialize=("W", "stride_s", "n_blk", "first"))
def _collect_kernel(scores_ptr, hist_ptr, state_ptr, cand_ptr, W, stride_s, n_blk, first, CAP: tl.constexpr,
                    HIST_ROW: tl.constexpr, BLOCK: tl.constexpr):
    # cand [T, CAP] int64; the row's counter is hist[row, HIST_ROW - 1]
    pid = tl.program_id(0).to(tl.int64)
    row, blk = pid // n_blk, pid % n_blk
    prefix, shift = tl.load(state_ptr + row * 4), tl.load(state_ptr + row * 4 + 1)
    resolved = tl.load(state_ptr + row * 4 + 2) + tl.load(state_ptr + row * 4 + 3) <= CAP
    offs = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    u = _order_keys(tl.load(scores_ptr + row * stride_s + offs, mask=offs < W, other=float("-inf")))
    top = (u >> shift).to(tl.int64)
    take = (u > NEG_INF_U) & tl.where(resolved, top >= prefix, top > prefix)
    n = tl.sum(take.to(tl.int32), axis=0)
    if n > 0:
        base = tl.atomic_add(hist_ptr + row * HIST_ROW + HIST_ROW - 1, n)
        slot = base + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(cand_ptr + row * CAP + slot, _stream_key(u, offs + first), mask=take)


@triton.jit(do_not_specialize=("W", "stride_s", "k", "first"))
def _finish_kernel(scores_ptr, hist_ptr, state_ptr, cand_ptr, keys_ptr, offsets_ptr, W, stride_s, k, first,
                   CAP: tl.constexpr, KP: tl.constexpr, HIST_ROW: tl.constexpr, RANK_I: tl.constexpr,
                   RANK_J: tl.constexpr, SCAN: tl.constexpr):
    # one program per row; keys/offsets [T, k] contiguous, every slot written once:
    # [0, n) ranked candidates (only [0, above) when unresolved), [n, k) empty, or the ties
    row = tl.program_id(0).to(tl.int64)
    prefix, above = tl.load(state_ptr + row * 4), tl.load(state_ptr + row * 4 + 2)
    resolved = above + tl.load(state_ptr + row * 4 + 3) <= CAP
    n = tl.load(hist_ptr + row * HIST_ROW + HIST_ROW - 1).to(tl.int64)
    limit = tl.where(resolved, k, above)
    cand = cand_ptr + row * CAP
    # rank of a candidate = candidates with a greater key (keys are distinct: their offsets are)
    i0 = tl.zeros([], tl.int64)
    while i0 < n:               # (while, not range: Triton 3.6's interpreter cannot range to a loaded n)
        i = i0 + tl.arange(0, RANK_I)
        key_i = tl.load(cand + i, mask=i < n, other=0)
        rank = tl.zeros([RANK_I], tl.int32)
        j0 = tl.zeros([], tl.int64)
        while j0 < n:
            j = j0 + tl.arange(0, RANK_J)
            key_j = tl.load(cand + j, mask=j < n, other=-9223372036854775807 - 1)   # EMPTY_KEY
            rank += tl.sum((key_j[None, :] > key_i[:, None]).to(tl.int32), axis=1)
            j0 += RANK_J
        put = (i < n) & (rank < limit)
        tl.store(keys_ptr + row * k + rank, key_i, mask=put)
        tl.store(offsets_ptr + row * k + rank, 4294967295 - (key_i & 4294967295), mask=put)
        i0 += RANK_I
    slots = tl.arange(0, KP)
    empty = (slots >= n) & (slots < tl.where(resolved, k, 0))               # a row of fewer than k valid
    tl.store(keys_ptr + row * k + slots, tl.full([KP], -9223372036854775807 - 1, tl.int64), mask=empty)
    tl.store(offsets_ptr + row * k + slots, tl.full([KP], -1, tl.int64), mask=empty)
    # unresolved: the ties (u == prefix: shift 0 after the last pass) fill [above, k), lowest offsets first
    need = tl.where(resolved, 0, k - above)
    found = tl.zeros([], tl.int64)
    start = tl.zeros([], tl.int64)
    while (found < need) & (start < W):
        offs = start + tl.arange(0, SCAN).to(tl.int64)
        u = _order_keys(tl.load(scores_ptr + row * stride_s + offs, mask=offs < W, other=float("-inf")))
        tie = (u > NEG_INF_U) & (u.to(tl.int64) == prefix)
        rank = found + tl.cumsum(tie.to(tl.int64), axis=0) - 1
        put = tie & (rank < need)
        tl.store(keys_ptr + row * k + above + rank, _stream_key(u, offs + first), mask=put)
        tl.store(offsets_ptr + row * k + above + rank, offs + first, mask=put)
        found += tl.sum(tie.to(tl.int64), axis=0)
        start += SCAN


def capacity(k: int) -> int:
    """Candidate slots per row: a power of two >= 2k, the same for every k <= 512 (k =
    min(topk, entries) grows with the context: one compiled variant for all of them). The
    finish ranks the n <= CAP it gets in O(n^2); n is k plus the threshold bucket."""
    return 2 * k_lanes(k)


def k_lanes(k: int) -> int:
    """Lanes of the finish's empty-slot fill: a power of two >= k, at least 512 (see capacity)."""
    return max(512, triton.next_power_of_2(k))


def block_size(T: int, W: int) -> int:
    """Entries per program: smaller blocks while the grid is under two waves of an H200's 132 SMs."""
    return 2048 if T * triton.cdiv(W, 4096) < 264 else 4096


def rows_per_program(T: int) -> int:
    """Rows of a derive program: one on the GPU (parallel rows), up to 64 in the interpreter."""
    return min(64, triton.next_power_of_2(T)) if os.environ.get("TRITON_INTERPRET") == "1" else 1


def radix_topk(scores: torch.Tensor, k: int, first_offset: int = 0, block: int | None = None,
               digits: tuple[int, ...] = DIGITS) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, W] fp32 (unit column stride) of offsets first_offset + [0, W) -> (keys,
    offsets) [T, k] int64: `score_keys(scores, first_offset).topk(k)` (dsv4/ops/stream_topk.py)
    with EMPTY_KEY where a row has fewer than k valid (> -inf) scores, and the keys' offsets
    (-1 there). k may exceed W. digits: bits per pass, most significant first (sum 32)."""
    T, W = scores.shape
    if scores.dtype != torch.float32 or (W > 1 and scores.stride(1) != 1):
        raise ValueError("radix_topk: scores must be fp32 with unit column stride")
    if first_offset + W > 1 << 32:
        raise ValueError("radix_topk: offsets must stay below 2^32")
    if sum(digits) != 32 or min(digits) < 1 or max(digits) > 12:
        raise ValueError(f"radix_topk: digits must be 1 to 12 bits and sum to 32, got {digits}")
    device = scores.device
    if T == 0 or k == 0 or W == 0:
        return (torch.full((T, k), EMPTY_KEY, dtype=torch.long, device=device),
                torch.full((T, k), -1, dtype=torch.long, device=device))
    cap, block, rows = capacity(k), block or block_size(T, W), rows_per_program(T)
    nbins = 1 << max(digits)
    hist_row = len(digits) * nbins + 1                                      # + the candidate counter
    hist = torch.zeros((T, hist_row), dtype=torch.int32, device=device)
    state = torch.empty((T, STATE), dtype=torch.long, device=device)       # written by pass 0's derive
    cand = torch.empty((T, cap), dtype=torch.long, device=device)
    keys = torch.empty((T, k), dtype=torch.long, device=device)
    offsets = torch.empty((T, k), dtype=torch.long, device=device)
    n_blk, stride = triton.cdiv(W, block), scores.stride(0)
    shift = 32
    for p, width in enumerate(digits):
        shift -= width
        sizes = dict(PASS=p, SHIFT=shift, WIDTH=width, CAP=cap, NBINS=nbins, HIST_ROW=hist_row)
        _hist_kernel[(T * n_blk,)](scores, hist, state, W, stride, n_blk, **sizes, BLOCK=block, num_warps=8)
        _derive_kernel[(triton.cdiv(T, rows),)](hist, state, T, k, **sizes, ROWS=rows, num_warps=8)
    _collect_kernel[(T * n_blk,)](scores, hist, state, cand, W, stride, n_blk, first_offset, CAP=cap,
                                  HIST_ROW=hist_row, BLOCK=block, num_warps=8)
    _finish_kernel[(T,)](scores, hist, state, cand, keys, offsets, W, stride, k, first_offset, CAP=cap,
                         KP=k_lanes(k), HIST_ROW=hist_row, RANK_I=RANK_I, RANK_J=RANK_J,
                         SCAN=SCAN_BLOCK, num_warps=8)
    return keys, offsets
