"""row_topk's split variant (dsv4/ops/triton/row_topk.py): the same keys in the same order, bit
for bit, from kernels that read the tile once with many small programs per row instead of one
large program a row (whose serial counts over a register-resident chunk leave the H200 at ~10%
of its bandwidth). Per launch of `Split.chunk` columns:

  threshold  (a program per row) the running set's k-th score when it holds k entries, else
             INT32_MIN: a tile entry at or under it is never chosen (k entries of lower offsets
             are at least as high).
  filter     (a program per row and block of BLOCK scores) keeps the block's entries above the
             threshold, in offset order, in a slot of BLOCK_CAP keys. When more than BLOCK_CAP
             remain it narrows (row_topk's counts, in registers) to the cut c, a score with
             KEEP <= count(s >= c) <= BLOCK_CAP (c = hi past a run of ties), and keeps those.
  select     (a program per row) the running set and the slots' candidates, in offset order:
             row_topk's stage 2 (counts, ties by a cumulative sum) chooses k. Exact unless a
             block was cut and the choice is short of k or reaches below a cut (an entry under
             a cut could then belong): such rows are flagged and not written.
  fallback   row_topk's kernel over the chunk for the flagged rows only (a few programs loop
             over the rows: an unflagged one costs a load): the same selection, whatever the
             data.

A full running set (every tile after a row's first k entries) bounds each block to a few
candidates (k * BLOCK / entries so far on average): no block is cut. A first tile cuts every
block; its top k spread over the blocks (k / blocks each on average, KEEP = 3/4 of BLOCK_CAP
kept at least: on benchmarks/kernels/topk_prefill.py's scores, [2048, 32768], k = 512 and
blocks of 4096, no row's top k has more than 159 in one block) passes the check; rows whose
top k crowd into one block take the fallback.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .row_select import INT32_MIN, _chosen, _key, _narrow, _signed_scores

EMPTY = tl.constexpr(-9223372036854775807 - 1)      # stream_topk.EMPTY_KEY
INT32_MAX = tl.constexpr(2147483647)


@dataclass(frozen=True)
class Split:
    """A split variant's sizes: blocks of `block` scores (a power of two) per filter program,
    `blocks` of them per select (a power of two; chunk = block * blocks columns a launch),
    `block_cap` candidates a block keeps at most (a power of two; at least keep(block_cap)
    when cut), warps per program of each kernel, the fallback's columns a launch (0: row_topk's
    chunk and num_warps; else a power of two >= 128, a warp a 2,048 columns), whether rows
    without a full running set (a first tile) cut their blocks (else the fallback takes them
    whole), and the fallback's programs (each loops over rows; 264: two per SM of an H200)."""
    block: int = 4096
    blocks: int = 8
    block_cap: int = 256
    filter_warps: int = 4
    select_warps: int = 8
    fallback_chunk: int = 0
    cut_first: bool = True
    fallback_programs: int = 264

    @property
    def chunk(self) -> int:
        return self.block * self.blocks

    def label(self) -> str:
        return f"split {self.block // 1024 or self.block}{'k' if self.block >= 1024 else ''}x{self.blocks}/" \
               f"{self.block_cap}/w{self.filter_warps},{self.select_warps}" + \
               (f"/fb{self.fallback_chunk}" if self.fallback_chunk else "") + ("" if self.cut_first else "/nocut")

    def validate(self) -> None:
        for name in ("block", "blocks", "block_cap", "filter_warps", "select_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"row_topk: split.{name} must be a power of two, got {v}")
        if self.block < 16 or self.block_cap < 2:
            raise ValueError(f"row_topk: split.block must be >= 16 and block_cap >= 2, got {self}")
        if self.fallback_programs < 1:
            raise ValueError(f"row_topk: split.fallback_programs must be >= 1, got {self}")
        if self.fallback_chunk and (self.fallback_chunk & (self.fallback_chunk - 1) or self.fallback_chunk < 128):
            raise ValueError(f"row_topk: split.fallback_chunk must be 0 or a power of two >= 128, got {self}")


def keep(block_cap: int) -> int:
    """Candidates a cut block keeps at least: 3/4 of its slot (the narrowing aims at 7/8)."""
    return block_cap - block_cap // 4


@triton.jit(do_not_specialize=("k",))
def _threshold_kernel(prev_ptr, thr_ptr, k, KP: tl.constexpr):
    # prev [T, k] int64 keys (EMPTY_KEY after the last) -> thr [T] int32: the least score s of a
    # full set, INT32_MIN when it holds fewer than k.
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, KP)
    ps = (tl.load(prev_ptr + row * k + slots, mask=slots < k, other=EMPTY) >> 32).to(tl.int32)
    full = tl.sum((ps > INT32_MIN).to(tl.int32), axis=0) == k
    least = tl.min(tl.where(ps > INT32_MIN, ps, INT32_MAX), axis=0)
    tl.store(thr_ptr + row, tl.where(full, least, INT32_MIN))


@triton.jit(do_not_specialize=("W", "stride_s", "first"))
def _filter_kernel(scores_ptr, thr_ptr, cand_ptr, count_ptr, cut_ptr, W, stride_s, first, BLOCK: tl.constexpr,
                   CAP_B: tl.constexpr, KEEP: tl.constexpr, INTERP: tl.constexpr, CUT_FIRST: tl.constexpr):
    # scores [T, W] of offsets first + [0, W); program (row, b) of (T, nblk) reads columns
    # [b * BLOCK, +BLOCK) and writes count[row, b] keys (ascending offsets) to cand[row, b, :CAP_B]
    # (cand [T, nblk, CAP_B], count and cut [T, nblk]), and cut[row, b]:
    # the block's entries above thr[row] and under the cut are not in its slot (INT32_MIN: none).
    # A row without a full set when not CUT_FIRST: no read, cut INT32_MAX (the fallback's row).
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    thr = tl.load(thr_ptr + row)
    if CUT_FIRST:
        skip = thr != thr                                                       # never
    else:
        skip = thr == INT32_MIN
    s = _signed_scores(scores_ptr + row * stride_s, offs, tl.where(skip, 0, W))
    s = tl.where(s > thr, s, INT32_MIN)                                       # INT32_MIN: not a candidate
    n = tl.sum((s > INT32_MIN).to(tl.int32), axis=0)
    cut = tl.full([], INT32_MIN, tl.int32)
    if n > CAP_B:       # narrow to KEEP <= count(s >= lo) <= CAP_B, or hi == lo + 1 (a run of ties at lo)
        lo = tl.min(tl.where(s > INT32_MIN, s, INT32_MAX), axis=0).to(tl.int64)
        hi = tl.max(s, axis=0).to(tl.int64) + 1
        lo, hi, n_lo, n_hi = _narrow(s, s, lo, hi, n.to(tl.int64), tl.zeros([], tl.int64), KEEP, CAP_B,
                                     KEEP + (CAP_B - KEEP) // 2, False, INTERP)
        cut = tl.where(n_lo <= CAP_B, lo, hi).to(tl.int32)
        n = tl.where(n_lo <= CAP_B, n_lo, n_hi).to(tl.int32)                 # count(s >= cut)
        s = tl.where(s >= cut, s, INT32_MIN)
    take = s > INT32_MIN
    blk = row * tl.num_programs(1) + b
    slot = blk * CAP_B
    tl.store(cand_ptr + slot + tl.cumsum(take.to(tl.int32), axis=0) - 1, _key(s, offs, first), mask=take)
    tl.store(count_ptr + blk, n)
    tl.store(cut_ptr + blk, tl.where(skip, INT32_MAX, cut))


@triton.jit(do_not_specialize=("k", "nblk"))
def _select_kernel(prev_ptr, cand_ptr, count_ptr, cut_ptr, out_ptr, flag_ptr, k, nblk, KP: tl.constexpr,
                   NBLK: tl.constexpr, CAP_B: tl.constexpr, INTERP: tl.constexpr):
    # prev/out [T, k] int64 keys in ascending offset order, EMPTY_KEY after the last (prev's
    # offsets below the candidates'); the filter's nblk <= NBLK slots a row. out[row] = the top k of
    # prev and the candidates, flag[row] = 0; or flag[row] = 1 and out[row] untouched when a
    # cut block could hold one of them.
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, KP)
    pk = tl.load(prev_ptr + row * k + slots, mask=slots < k, other=EMPTY)
    ps = (pk >> 32).to(tl.int32)                                              # EMPTY_KEY: INT32_MIN
    ci = tl.arange(0, NBLK * CAP_B)
    blk = ci // CAP_B
    cnt = tl.load(count_ptr + row * nblk + blk, mask=blk < nblk, other=0)
    ck = tl.load(cand_ptr + row * nblk * CAP_B + ci, mask=(ci % CAP_B) < cnt, other=EMPTY)
    cs = (ck >> 32).to(tl.int32)
    bi = tl.arange(0, NBLK)
    max_cut = tl.max(tl.load(cut_ptr + row * nblk + bi, mask=bi < nblk, other=INT32_MIN), axis=0)
    # count(>= lo) = n_lo >= k > 0 = count(>= hi) (a full prev: lo is its least score, every
    # candidate above it), or n_lo <= k: every valid entry
    n_lo = (tl.sum((ps > INT32_MIN).to(tl.int32), axis=0) + tl.sum((cs > INT32_MIN).to(tl.int32), axis=0)).to(tl.int64)
    lo = tl.minimum(tl.min(tl.where(ps > INT32_MIN, ps, INT32_MAX), axis=0),
                    tl.min(tl.where(cs > INT32_MIN, cs, INT32_MAX), axis=0)).to(tl.int64)
    hi = tl.maximum(tl.max(ps, axis=0), tl.max(cs, axis=0)).to(tl.int64) + 1
    lo, hi, n_lo, n_hi = _narrow(cs, ps, lo, hi, n_lo, tl.zeros([], tl.int64), k, k, k, True, INTERP)
    take_p = _chosen(ps, lo, n_lo, n_hi, k, 0)
    take_c = _chosen(cs, lo, n_lo, n_hi, k, tl.sum((ps == lo.to(tl.int32)).to(tl.int32), axis=0))
    n_p = tl.sum(take_p.to(tl.int32), axis=0)
    n = n_p + tl.sum(take_c.to(tl.int32), axis=0)
    least = tl.minimum(tl.min(tl.where(take_p, ps, INT32_MAX), axis=0), tl.min(tl.where(take_c, cs, INT32_MAX), axis=0))
    exact = (max_cut == INT32_MIN) | ((n == k) & (least >= max_cut))   # all under a cut: k chosen above them
    tl.store(flag_ptr + row, (~exact).to(tl.int32))
    if exact:
        out = out_ptr + row * k
        tl.store(out + tl.cumsum(take_p.to(tl.int32), axis=0) - 1, pk, mask=take_p)
        tl.store(out + n_p + tl.cumsum(take_c.to(tl.int32), axis=0) - 1, ck, mask=take_c)
        tl.store(out + slots, tl.full([KP], EMPTY, tl.int64), mask=(slots >= n) & (slots < k))


def split_launch(part: torch.Tensor, prev: torch.Tensor, k: int, first: int, split: Split, interp: bool,
                 fallback) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of at most split.chunk columns: part [T, w] fp32 (unit column stride) of offsets
    first + [0, w), prev [T, k] a running set -> (out [T, k] the merged set, flags [T] int32: 1
    where the fallback chose). fallback(part, prev, out, flags, first) runs row_topk's kernel on
    the flagged rows."""
    T, w = part.shape
    dev = part.device
    nblk = triton.cdiv(w, split.block)
    kp = triton.next_power_of_2(k)
    thr = torch.empty(T, dtype=torch.int32, device=dev)
    _threshold_kernel[(T,)](prev, thr, k, KP=kp, num_warps=4)
    # the tile's bytes times 2 * block_cap / block at most
    cand = torch.empty((T, nblk, split.block_cap), dtype=torch.long, device=dev)
    count = torch.empty((T, nblk), dtype=torch.int32, device=dev)
    cut = torch.empty((T, nblk), dtype=torch.int32, device=dev)
    _filter_kernel[(T, nblk)](part, thr, cand, count, cut, w, part.stride(0), first, BLOCK=split.block,
                              CAP_B=split.block_cap, KEEP=keep(split.block_cap),
                              INTERP=interp, CUT_FIRST=split.cut_first, num_warps=split.filter_warps)
    out = torch.empty((T, k), dtype=torch.long, device=dev)
    flags = torch.empty(T, dtype=torch.int32, device=dev)
    _select_kernel[(T,)](prev, cand, count, cut, out, flags, k, nblk, KP=kp, NBLK=split.blocks,
                         CAP_B=split.block_cap, INTERP=interp, num_warps=split.select_warps)
    fallback(part, prev, out, flags, first)
    return out, flags
