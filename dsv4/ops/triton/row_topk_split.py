"""row_topk's split variant (dsv4/ops/triton/row_topk.py): the same keys in the same order, bit
for bit, from kernels that read the tile once with many small programs per row instead of one
large program a row (whose serial counts over a register-resident chunk leave the H200 at ~10%
of its bandwidth). Exact for any scores: no row ever needs row_topk's kernel. Per launch of
`Split.chunk` columns:

  threshold  (a program per row) the running set's least key when it holds k entries, else
             EMPTY_KEY: a tile entry with a lower key is never chosen (k keys are above it).
  filter     (a program per row and block of BLOCK scores) keeps the block's entries with keys
             at or above the row's threshold, in offset order, in a slot of SLOT keys (the power
             of two >= k times `slot_mult`, or BLOCK when smaller). When more remain it narrows
             (row_topk's counts, in registers) and keeps the block's best k at least (ties at the
             cut: the first in offset order): every entry of the row's top k in the block is kept.
             With `edges_first` the oldest and newest blocks go first (a launch of their own)
             and keep exactly their best k: a block's k-th key bounds the row's k-th key from
             below, so the other blocks filter at the highest of those bounds and the running
             set's (scores rising or falling along the row, and ties, then leave those blocks
             few candidates).
  select     (a program per row) the running set and the slots' candidates, in offset order:
             row_topk's stage 2 (counts, ties by a cumulative sum) chooses k. The small select
             gathers at most LANES candidates (the slots compacted in registers); a row with
             more is flagged and a wider one (`mid_lanes`, if set) or the big select (every
             slot's lanes) chooses it instead, each a program per row that returns at once for
             a row it does not take.

Every branch is taken on the device (no host sync: CUDA graphs); the launches depend only on
the shapes (and, with `first_rows`, on whether a running set exists). Scratch: [T, blocks,
SLOT] int64 keys (a tile of [2048, 32768], k = 512, blocks of 2048: 128 MiB), of which a row
writes only its candidates.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .row_select import INT32_MIN, _chosen, _key, _narrow, _signed_scores

EMPTY = tl.constexpr(-9223372036854775807 - 1)      # stream_topk.EMPTY_KEY
INT32_MAX = tl.constexpr(2147483647)
INT64_MAX = tl.constexpr(9223372036854775807)


@dataclass(frozen=True)
class Split:
    """A split variant's sizes: blocks of `block` scores (a power of two) per filter program,
    `blocks` of them a launch (a power of two; chunk = block * blocks columns), warps of the
    filter, small select and big select programs, the small select's candidates at most
    (`lanes`, a power of two) and a second one's for the rows with more (`mid_lanes`, 0: none,
    else a larger power of two), whether the oldest and newest blocks go first (their bounds
    raise the other blocks' threshold), a block's slot in powers of two >= k (`slot_mult`, a
    power of two: 2 lets a first tile's blocks keep their ~k entries above the edges' bounds
    without narrowing; the big select holds blocks * slot keys a row), whether a first tile
    (no running set: row_topk's prev None, known on the host) takes a program per row instead
    (row_topk's kernel: every block of a first tile has candidates)."""
    block: int = 2048
    blocks: int = 16
    filter_warps: int = 2
    select_warps: int = 8
    lanes: int = 2048
    big_warps: int = 8
    edges_first: bool = True
    slot_mult: int = 1
    mid_lanes: int = 0
    first_rows: bool = False

    @property
    def chunk(self) -> int:
        return self.block * self.blocks

    def label(self) -> str:
        b = f"{self.block // 1024}k" if self.block >= 1024 else str(self.block)
        lanes = f"{self.lanes},{self.mid_lanes}" if self.mid_lanes else f"{self.lanes}"
        return f"split {b}x{self.blocks}/l{lanes}/w{self.filter_warps},{self.select_warps},{self.big_warps}" + \
               ("/edges" if self.edges_first else "") + (f"/s{self.slot_mult}" if self.slot_mult > 1 else "") + \
               ("/fr" if self.first_rows else "")

    def validate(self) -> None:
        for name in ("block", "blocks", "filter_warps", "select_warps", "lanes", "big_warps", "slot_mult"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"row_topk: split.{name} must be a power of two, got {v}")
        if self.mid_lanes and (self.mid_lanes & (self.mid_lanes - 1) or self.mid_lanes <= self.lanes):
            raise ValueError(f"row_topk: split.mid_lanes must be 0 or a power of two above lanes, got {self}")
        if self.block < 16 or self.lanes < 16:
            raise ValueError(f"row_topk: split.block and split.lanes must be >= 16, got {self}")


def slot_size(block: int, k: int, mult: int = 1) -> int:
    """Keys a block keeps at most: mult times the power of two >= k (a block's best k at
    least), or the whole block when smaller."""
    return min(block, triton.next_power_of_2(k) * mult)


@triton.jit(do_not_specialize=("k",))
def _threshold_kernel(prev_ptr, thr_ptr, k, KP: tl.constexpr):
    # prev [T, k] int64 keys (EMPTY_KEY after the last) -> thr [T] int64: the least key of a full
    # set, EMPTY_KEY when it holds fewer than k.
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, KP)
    pk = tl.load(prev_ptr + row * k + slots, mask=slots < k, other=EMPTY)
    full = tl.sum((pk > EMPTY).to(tl.int32), axis=0) == k
    least = tl.min(tl.where(pk > EMPTY, pk, INT64_MAX), axis=0)
    tl.store(thr_ptr + row, tl.where(full, least, EMPTY))


@triton.jit(do_not_specialize=("W", "stride_s", "first", "k", "stop", "nblk", "b0", "bstep"))
def _filter_kernel(scores_ptr, thr_ptr, bound_ptr, cand_ptr, count_ptr, W, stride_s, first, k, stop, nblk, b0,
                   bstep, BLOCK: tl.constexpr, SLOT: tl.constexpr, INTERP: tl.constexpr, BOUND_IN: tl.constexpr,
                   BOUND_OUT: tl.constexpr):
    # scores [T, W] of offsets first + [0, W); program (row, j) reads block b = b0 + j * bstep,
    # columns [b * BLOCK, +BLOCK), and writes count[row, b] keys (ascending offsets) to
    # cand[row, b, :SLOT] (cand [T, nblk, SLOT], count [T, nblk]): those at or above the row's
    # threshold (thr[row], and with BOUND_IN the highest of bound[row, :2]), the block's best
    # k of them at least (narrowed while more than stop >= k remain). BOUND_OUT: bound[row, j] =
    # the k-th key of the block's (stop == k: exactly k kept), EMPTY_KEY when it keeps fewer.
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    b = b0 + j * bstep
    base = b * BLOCK                            # offsets in the block from 0: few registers live
    first = first.to(tl.int64) + base
    offs = tl.arange(0, BLOCK)
    thr = tl.load(thr_ptr + row)
    if BOUND_IN:
        thr = tl.maximum(thr, tl.maximum(tl.load(bound_ptr + row * 2), tl.load(bound_ptr + row * 2 + 1)))
    # key >= thr in int32: a score above thr's, or thr's score at an offset up to thr's
    ts = (thr >> 32).to(tl.int32)
    last = tl.minimum(tl.maximum(4294967295 - (thr & 4294967295) - first, -1), INT32_MAX).to(tl.int32)
    s = _signed_scores(scores_ptr + row * stride_s + base, offs, W - base)
    s = tl.where((s > INT32_MIN) & ((s > ts) | ((s == ts) & (offs <= last))), s, INT32_MIN)  # INT32_MIN: none
    n = tl.sum((s > INT32_MIN).to(tl.int32), axis=0)
    # kept: s above cut_s, or at cut_s up to offset cut_off (scalars: few registers live)
    cut_s = tl.full([], INT32_MIN, tl.int32)
    cut_off = tl.full([], -1, tl.int32)
    if n > stop:        # narrow to k <= count(s >= lo) <= stop, or hi == lo + 1 (a run of ties at lo)
        lo = tl.min(tl.where(s > INT32_MIN, s, INT32_MAX), axis=0).to(tl.int64)
        hi = tl.max(s, axis=0).to(tl.int64) + 1
        lo, hi, n_lo, n_hi = _narrow(s, s, lo, hi, n.to(tl.int64), tl.zeros([], tl.int64), k, stop,
                                     k + (stop - k) // 2, False, INTERP)
        cut_s = lo.to(tl.int32)
        cut_off = INT32_MAX
        n = n_lo.to(tl.int32)
        if n_lo > stop:     # the block's best k: above lo, then the first k - n_hi ties at lo
            tie = s == cut_s
            rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
            cut_off = tl.max(tl.where(tie & (rank < k - n_hi), offs, -1), axis=0)
            n = k
    take = (s > cut_s) | ((s == cut_s) & (offs <= cut_off))
    if BOUND_OUT:       # the least kept key: the least score, at its newest offset (before the
        # store: fewer registers live)
        least = tl.min(tl.where(take, s, INT32_MAX), axis=0)
        newest = tl.max(tl.where(take & (s == least), offs, -1), axis=0)
        tl.store(bound_ptr + row * 2 + j, tl.where(n >= k, _key(least, newest, first), EMPTY))
    blk = row * nblk + b
    if n > 0:           # (deep tiles: most blocks have no candidate)
        tl.store(cand_ptr + blk * SLOT + tl.cumsum(take.to(tl.int32), axis=0) - 1, _key(s, offs, first), mask=take)
    tl.store(count_ptr + blk, n)


@triton.jit
def _select_row(row, prev_ptr, out_ptr, cand, idx, cmask, k, KP: tl.constexpr, INTERP: tl.constexpr):
    # prev/out [T, k] int64 keys in ascending offset order, EMPTY_KEY after the last; the row's
    # candidates (offsets above prev's) at cand + idx where cmask, in ascending offset order
    # (gaps anywhere). out[row] = the top k of prev and them (row_topk's stage 2). The counts
    # run on their scores (int32); the chosen keys are read again for the store.
    slots = tl.arange(0, KP)
    pk = tl.load(prev_ptr + row * k + slots, mask=slots < k, other=EMPTY)
    ps = (pk >> 32).to(tl.int32)                                              # EMPTY_KEY: INT32_MIN
    cs = (tl.load(cand + idx, mask=cmask, other=EMPTY) >> 32).to(tl.int32)
    # count(>= lo) = n_lo, count(>= hi) = 0: every valid entry
    n_lo = (tl.sum((ps > INT32_MIN).to(tl.int32), axis=0) + tl.sum((cs > INT32_MIN).to(tl.int32), axis=0)).to(tl.int64)
    lo = tl.minimum(tl.min(tl.where(ps > INT32_MIN, ps, INT32_MAX), axis=0),
                    tl.min(tl.where(cs > INT32_MIN, cs, INT32_MAX), axis=0)).to(tl.int64)
    hi = tl.maximum(tl.max(ps, axis=0), tl.max(cs, axis=0)).to(tl.int64) + 1
    lo, hi, n_lo, n_hi = _narrow(cs, ps, lo, hi, n_lo, tl.zeros([], tl.int64), k, k, k, True, INTERP)
    take_p = _chosen(ps, lo, n_lo, n_hi, k, 0)
    take_c = _chosen(cs, lo, n_lo, n_hi, k, tl.sum((ps == lo.to(tl.int32)).to(tl.int32), axis=0))
    n_p = tl.sum(take_p.to(tl.int32), axis=0)
    n = n_p + tl.sum(take_c.to(tl.int32), axis=0)
    out = out_ptr + row * k
    tl.store(out + tl.cumsum(take_p.to(tl.int32), axis=0) - 1, pk, mask=take_p)
    tl.store(out + n_p + tl.cumsum(take_c.to(tl.int32), axis=0) - 1, tl.load(cand + idx, mask=take_c), mask=take_c)
    tl.store(out + slots, tl.full([KP], EMPTY, tl.int64), mask=(slots >= n) & (slots < k))


@triton.jit(do_not_specialize=("k", "nblk"))
def _select_small_kernel(prev_ptr, cand_ptr, count_ptr, out_ptr, flag_ptr, k, nblk, KP: tl.constexpr,
                         NBLK: tl.constexpr, SLOT: tl.constexpr, LANES: tl.constexpr, INTERP: tl.constexpr,
                         FLAGGED: tl.constexpr):
    # the filter's nblk <= NBLK slots a row, compacted into LANES lanes; a row with more
    # candidates: flag[row] = 1, out[row] untouched (else flag[row] = 0). FLAGGED: only the rows
    # a smaller launch flagged.
    row = tl.program_id(0).to(tl.int64)
    if FLAGGED:
        if tl.load(flag_ptr + row) != 0:
            _select_compact(row, prev_ptr, cand_ptr, count_ptr, out_ptr, flag_ptr, k, nblk, KP, NBLK, SLOT, LANES,
                            INTERP)
    else:
        _select_compact(row, prev_ptr, cand_ptr, count_ptr, out_ptr, flag_ptr, k, nblk, KP, NBLK, SLOT, LANES,
                        INTERP)


@triton.jit
def _select_compact(row, prev_ptr, cand_ptr, count_ptr, out_ptr, flag_ptr, k, nblk, KP: tl.constexpr,
                    NBLK: tl.constexpr, SLOT: tl.constexpr, LANES: tl.constexpr, INTERP: tl.constexpr):
    # lane i: the block whose counts' running sum passes i, at i less the sum before it
    ci = tl.arange(0, LANES)
    blk = tl.zeros([LANES], tl.int32)
    start = tl.zeros([LANES], tl.int32)         # the lane's block's first lane
    total = tl.zeros([], tl.int32)
    for b in tl.static_range(NBLK):
        total += tl.load(count_ptr + row * nblk + b, mask=b < nblk, other=0)
        past = ci >= total
        blk += past.to(tl.int32)
        start = tl.where(past, total, start)
    small = total <= LANES
    tl.store(flag_ptr + row, (~small).to(tl.int32))
    if small:
        _select_row(row, prev_ptr, out_ptr, cand_ptr + row * nblk * SLOT, blk * SLOT + ci - start, ci < total, k,
                    KP, INTERP)


@triton.jit(do_not_specialize=("k", "nblk"))
def _select_big_kernel(prev_ptr, cand_ptr, count_ptr, out_ptr, flag_ptr, k, nblk, KP: tl.constexpr,
                       NBLK: tl.constexpr, SLOT: tl.constexpr, INTERP: tl.constexpr):
    # the flagged rows of _select_small_kernel: every slot's lanes (gaps past each count).
    row = tl.program_id(0).to(tl.int64)
    if tl.load(flag_ptr + row) != 0:
        ci = tl.arange(0, NBLK * SLOT)
        blk = ci // SLOT
        cnt = tl.load(count_ptr + row * nblk + blk, mask=blk < nblk, other=0)
        _select_row(row, prev_ptr, out_ptr, cand_ptr + row * nblk * SLOT, ci, (ci % SLOT) < cnt, k, KP, INTERP)


def split_launch(part: torch.Tensor, prev: torch.Tensor, k: int, first: int, split: Split,
                 interp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of at most split.chunk columns: part [T, w] fp32 (unit column stride) of offsets
    first + [0, w), prev [T, k] a running set -> (out [T, k] the merged set, flags [T] int32: 1
    where the big select chose)."""
    T, w = part.shape
    dev = part.device
    nblk = triton.cdiv(w, split.block)
    kp, slot = triton.next_power_of_2(k), slot_size(split.block, k, split.slot_mult)
    thr = torch.empty(T, dtype=torch.long, device=dev)
    _threshold_kernel[(T,)](prev, thr, k, KP=kp, num_warps=4)
    cand = torch.empty((T, nblk, slot), dtype=torch.long, device=dev)
    count = torch.empty((T, nblk), dtype=torch.int32, device=dev)
    bound = torch.empty((T, 2), dtype=torch.long, device=dev)
    meta = dict(BLOCK=split.block, SLOT=slot, INTERP=interp, num_warps=split.filter_warps)
    args = (part, thr, bound, cand, count, w, part.stride(0), first, k)
    if split.edges_first:       # the oldest and newest blocks, then the others at their bounds
        edges = min(nblk, 2)
        _filter_kernel[(T, edges)](*args, k, nblk, 0, nblk - 1, BOUND_IN=False, BOUND_OUT=True, **meta)
        if nblk > 2:
            _filter_kernel[(T, nblk - 2)](*args, slot, nblk, 1, 1, BOUND_IN=True, BOUND_OUT=False, **meta)
    else:
        _filter_kernel[(T, nblk)](*args, slot, nblk, 0, 1, BOUND_IN=False, BOUND_OUT=False, **meta)
    out = torch.empty((T, k), dtype=torch.long, device=dev)
    flags = torch.empty(T, dtype=torch.int32, device=dev)
    sel = (prev, cand, count, out, flags, k, nblk)
    for lanes in (split.lanes, split.mid_lanes)[:1 + (split.mid_lanes > 0)]:
        _select_small_kernel[(T,)](*sel, KP=kp, NBLK=split.blocks, SLOT=slot, LANES=lanes, INTERP=interp,
                                   FLAGGED=lanes != split.lanes, num_warps=split.select_warps)
    _select_big_kernel[(T,)](*sel, KP=kp, NBLK=split.blocks, SLOT=slot, INTERP=interp, num_warps=split.big_warps)
    return out, flags
