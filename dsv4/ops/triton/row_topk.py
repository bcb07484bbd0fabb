"""Top-k of many rows of fp32 scores, one program per row (prefill chunks: 2,048 rows of a
tile of C4 entries), merged into a running top-k in the same kernel.

Selection is that of dsv4/ops/stream_topk.py, bit for bit: score descending, ties to the lower
offset, -inf never chosen. A program holds its row's chunk of CHUNK scores in registers as the
int32 s whose signed order is the scores' (stream_topk's key high word; -inf and below become
INT32_MIN: never counted), together with the row's running set (k int64 keys of lower offsets),
read from HBM once (SUB > 0: a second read, from L1 / L2, writes the candidates). It then finds
the threshold by counting, with no histogram:

  lo, hi with count(s >= lo) >= k > count(s >= hi) (counts over the chunk and the running set;
  lo starts at the running set's k-th score once it holds k);
  a count at a pivot lo < mid < hi replaces lo or hi (_narrow). The pivot bisects, or (INTERP)
  interpolates the counts linearly, falling back to a bisection after an interpolation that did
  not halve the range (so at most twice the bisection's 33 counts).
  stage 1, over the chunk (the costly counts): narrow until count(s >= lo) <= CAP, aiming between
    k and CAP; those entries go to a scratch row in offset order (the running set first: its
    offsets are below the chunk's). If more than CAP tie at one score (hi == lo + 1), the chosen
    k go instead: those above lo and the first ties at lo in offset order (a cumulative sum).
  stage 2, over the <= CAP candidates (cheap counts): narrow until count(s >= lo) == k or hi ==
    lo + 1; keep the same way.

The chosen entries are written as keys in ascending offset order (the running set first: its
offsets are below the chunk's), so that order is the tie order of the next chunk, and
EMPTY_KEY after them. `RowTopk.offsets` sorts the final set once (the reference's order).

The split variant (`split=`, RowTopk's when SPLIT is set; dsv4/ops/triton/row_topk_split.py)
reads a tile with many small programs a row (filter) and chooses with a small one a row (select:
stage 2 above); the same keys in the same order, for any scores. The shared Triton helpers:
dsv4/ops/triton/row_select.py.
"""
import torch
import triton
import triton.language as tl

from ..stream_topk import EMPTY_KEY, key_offsets
from .row_select import INT32_MIN, _chosen, _key, _narrow, _signed_scores
from .row_topk_split import Split, split_launch

# scores per program (registers: CHUNK / (32 * num_warps) int32 a thread). 8k over 4 warps: the
# fastest of benchmarks/kernels/topk_prefill.py's sweep on an H200 at [2048, 32k] and [2048, 64k]
# (0.524 and 1.029 ms a tile; 16k over 8 warps 0.569 and 1.111), 206 registers without spills
CHUNK = 8192
NUM_WARPS = 4
INTERP = True               # interpolated pivots (bisection when False)
SUB = 4096                  # scores a step when stage 1 writes its candidates from a second read (0: from registers)
# the narrowest program: a full chunk, so serving compiles one variant (a narrower tile's program
# masks the rest: no reads, and a row of at most k valid scores needs no counts)
MIN_CHUNK = CHUNK
# the least k a program per row is compiled for (its KP, and CAP = capacity(MIN_KP)): a step of
# many short prompts (ROWS_MIN tokens or more, each prompt's C4 entries, so k = min(topk, width),
# fewer than that) takes this variant, which the warm-up's 256-token prefill from position 0 (64
# entries) compiles, instead of compiling one for each power of two below it while serving
MIN_KP = 64
# RowTopk's (the indexer's) variant: the split one (dsv4/ops/triton/row_topk_split.py: a filter
# of many programs a row, then a select a row) when a Split, else a program per row;
# benchmarks/kernels/topk_prefill.py times both. On the H200 (docs/benchmarks.md, twelfth
# session) this Split takes a 900k chunk's top-k in 4.66 ms against 7.03 (random tiles 1.89x,
# deep 1.70x) and no shape's tile slower than the program per row (its first tiles are one).
SPLIT: Split | None = Split(first_rows=True)


# per-call sizes are not specialised: one compiled variant per chunk width
@triton.jit(do_not_specialize=("W", "stride_s", "k", "first"))
def _row_topk_kernel(scores_ptr, prev_ptr, cand_ptr, out_ptr, W, stride_s, k, first, WP: tl.constexpr,
                     KP: tl.constexpr, CAP: tl.constexpr, SUB: tl.constexpr, INTERP: tl.constexpr):
    # scores [T, W] (unit column stride) of offsets first + [0, W); prev/out [T, k] int64 keys
    # in ascending offset order, EMPTY_KEY after the last (prev's offsets are all below first);
    # cand [T, CAP] int64 scratch. Stage 1 narrows over the chunk and prev down to <= CAP
    # candidates, written to cand in offset order; stage 2 narrows over those to the k.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, WP)
    s = _signed_scores(scores_ptr + row * stride_s, offs, W)                  # [WP]
    slots = tl.arange(0, KP)
    pk = tl.load(prev_ptr + row * k + slots, mask=slots < k, other=-9223372036854775807 - 1)
    ps = (pk >> 32).to(tl.int32)                                               # [KP]; EMPTY_KEY: INT32_MIN
    n_prev = tl.sum((ps > INT32_MIN).to(tl.int32), axis=0)
    n_lo = (tl.sum((s > INT32_MIN).to(tl.int32), axis=0) + n_prev).to(tl.int64)
    big = 2147483647
    prev_min = tl.min(tl.where(ps > INT32_MIN, ps, big), axis=0)
    lo = tl.minimum(tl.min(tl.where(s > INT32_MIN, s, big), axis=0), prev_min).to(tl.int64)  # count(>= lo) = n_lo
    hi = tl.maximum(tl.max(s, axis=0), tl.max(ps, axis=0)).to(tl.int64) + 1          # count(>= hi) = 0
    n_hi = tl.zeros([], tl.int64)
    if n_prev == k:     # a full running set: its k-th score bounds the k-th from below (later tiles of
        # a row: few of the chunk's scores are above it, often no further count is needed)
        lo = prev_min.to(tl.int64)
        n_lo = tl.sum((s >= prev_min).to(tl.int32), axis=0).to(tl.int64) + k
    lo, hi, n_lo, n_hi = _narrow(s, ps, lo, hi, n_lo, n_hi, k, CAP, k + (CAP - k) // 2, True, INTERP)
    # candidates: every entry >= lo (n_lo <= CAP), or when more than CAP tie at lo, the chosen k
    # (above lo, then the first ties in offset order: prev's first)
    lo32 = lo.to(tl.int32)
    if n_lo <= CAP:
        take_p = ps >= lo32
    else:
        take_p = _chosen(ps, lo, n_lo, n_hi, k, 0)
    cand = cand_ptr + row * CAP
    tl.store(cand + tl.cumsum(take_p.to(tl.int32), axis=0) - 1, pk, mask=take_p)
    n_c = tl.sum(take_p.to(tl.int32), axis=0)
    ties = tl.sum((ps == lo32).to(tl.int32), axis=0)                           # ties at lo so far
    if SUB == 0:        # from the registers
        if n_lo <= CAP:
            take_s = s >= lo32
        else:
            take_s = _chosen(s, lo, n_lo, n_hi, k, ties)
        tl.store(cand + n_c + tl.cumsum(take_s.to(tl.int32), axis=0) - 1, _key(s, offs, first), mask=take_s)
        n_c += tl.sum(take_s.to(tl.int32), axis=0)
    else:               # the row again (L1 / L2), SUB at a time: fewer registers live at once
        for c0 in range(0, WP, SUB):
            o = c0 + tl.arange(0, SUB)
            x = _signed_scores(scores_ptr + row * stride_s, o, W)
            if n_lo <= CAP:
                take = x >= lo32
            else:
                take = _chosen(x, lo, n_lo, n_hi, k, ties)
                ties += tl.sum((x == lo32).to(tl.int32), axis=0)
            tl.store(cand + n_c + tl.cumsum(take.to(tl.int32), axis=0) - 1, _key(x, o, first), mask=take)
            n_c += tl.sum(take.to(tl.int32), axis=0)
    if n_lo > CAP:
        n_lo = k.to(tl.int64)                                                  # the k chosen
    tl.debug_barrier()          # the program's candidate stores before its loads
    ci = tl.arange(0, CAP)
    ck = tl.load(cand + ci, mask=ci < n_c, other=-9223372036854775807 - 1)
    cs = (ck >> 32).to(tl.int32)
    lo, hi, n_lo, n_hi = _narrow(cs, cs, lo, hi, n_lo, n_hi, k, k, k, False, INTERP)
    take = _chosen(cs, lo, n_lo, n_hi, k, 0)
    out = out_ptr + row * k
    tl.store(out + tl.cumsum(take.to(tl.int32), axis=0) - 1, ck, mask=take)
    n = tl.sum(take.to(tl.int32), axis=0)
    tl.store(out + slots, tl.full([KP], -9223372036854775807 - 1, tl.int64), mask=(slots >= n) & (slots < k))


def capacity(k: int) -> int:
    """Stage 2's candidates: twice the power of two >= k (stage 1 stops under it)."""
    return 2 * triton.next_power_of_2(k)


def chunk_width(W: int, chunk: int) -> int:
    """Compiled width of a program's scores: chunk (wider tiles take several launches), or a
    power of two >= the tile's columns down to MIN_CHUNK."""
    return min(chunk, max(MIN_CHUNK, triton.next_power_of_2(W)))


def row_topk(scores: torch.Tensor, k: int, first_offset: int = 0, prev: torch.Tensor | None = None,
             chunk: int = CHUNK, num_warps: int = NUM_WARPS, interp: bool = INTERP, cap: int | None = None,
             sub: int = SUB, split: Split | None = None) -> torch.Tensor:
    """scores [T, W] fp32 (unit column stride) of offsets first_offset + [0, W); prev [T, k]
    int64 keys of offsets below first_offset (a running set of this function) or None -> [T, k]
    int64: the top k keys of `score_keys(scores, first_offset)` and prev (dsv4/ops/stream_topk.py),
    in ascending offset order, EMPTY_KEY after the last. chunk: columns per launch (a power of
    two); cap: candidates of stage 2 (a power of two >= k, default capacity(k)); sub: see SUB;
    split: the split variant's sizes (dsv4/ops/triton/row_topk_split.py; chunk, num_warps, cap
    and sub do not apply to it), None a program per row (RowTopk passes SPLIT)."""
    return _row_topk(scores, k, first_offset, prev, chunk, num_warps, interp, cap, sub, split)[0]


def row_topk_big_selects(scores: torch.Tensor, k: int, first_offset: int = 0, prev: torch.Tensor | None = None,
                         interp: bool = INTERP, split: Split = Split()) -> tuple[torch.Tensor, torch.Tensor]:
    """row_topk's split variant, and [T] int32: per row the launches whose big select chose
    (more than split.lanes candidates)."""
    keys, flags = _row_topk(scores, k, first_offset, prev, CHUNK, NUM_WARPS, interp, None, SUB, split)
    if not flags:
        return keys, torch.zeros(keys.shape[0], dtype=torch.int32, device=keys.device)
    return keys, torch.stack(flags).sum(0, dtype=torch.int32)


def _row_topk(scores, k, first_offset, prev, chunk, num_warps, interp, cap, sub, split):
    """row_topk -> (keys, [the split variant's flags [T] int32 of each launch])."""
    T, W = scores.shape
    if scores.dtype != torch.float32 or (W > 1 and scores.stride(1) != 1):
        raise ValueError("row_topk: scores must be fp32 with unit column stride")
    if first_offset + W > 1 << 32:
        raise ValueError("row_topk: offsets must stay below 2^32")
    if chunk & (chunk - 1) or chunk < 128:
        raise ValueError(f"row_topk: chunk must be a power of two >= 128, got {chunk}")
    if sub & (sub - 1):
        raise ValueError(f"row_topk: sub must be 0 or a power of two, got {sub}")
    if prev is not None and (prev.shape != (T, k) or prev.dtype != torch.long):
        raise ValueError(f"row_topk: prev must be int64 [{T}, {k}], got {prev.dtype} {tuple(prev.shape)}")
    if split is not None:
        split.validate()
    kp = triton.next_power_of_2(k)
    cap = cap or capacity(max(k, MIN_KP))
    if cap < kp or cap & (cap - 1):
        raise ValueError(f"row_topk: cap must be a power of two >= {kp}, got {cap}")
    if split is not None and split.first_rows and prev is None:    # a first tile: a program per row
        split = None
    if prev is None:        # the empty set
        prev = torch.full((T, k), EMPTY_KEY, dtype=torch.long, device=scores.device)
    if T == 0 or k == 0 or W == 0:
        return prev, []
    if split is None:
        return _rows(scores, prev, k, first_offset, chunk, num_warps, interp, cap, sub), []
    flags = []
    for c0 in range(0, W, split.chunk):
        prev, f = split_launch(scores[:, c0:c0 + split.chunk], prev, k, first_offset + c0, split, interp)
        flags.append(f)
    return prev, flags


def _rows(scores, prev, k, first, chunk, num_warps, interp, cap, sub) -> torch.Tensor:
    """row_topk by a program per row, launch after launch of chunk_width(W, chunk) columns."""
    T, W = scores.shape
    wp, kp = chunk_width(W, chunk), min(max(triton.next_power_of_2(k), MIN_KP), cap)
    cand = torch.empty((T, cap), dtype=torch.long, device=scores.device)
    for c0 in range(0, W, wp):
        part = scores[:, c0:c0 + wp]
        out = torch.empty((T, k), dtype=torch.long, device=scores.device)
        _row_topk_kernel[(T,)](part, prev, cand, out, part.shape[1], scores.stride(0), k, first + c0,
                               WP=wp, KP=kp, CAP=cap, SUB=min(sub, wp), INTERP=interp, num_warps=num_warps)
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
        self.keys = row_topk(scores, self.k, first_offset, self.keys, split=SPLIT)

    def offsets(self) -> torch.Tensor:
        """[T, k] long: chosen offsets in (score desc, offset asc) order, -1 after the last."""
        return key_offsets(sorted_keys(self.keys))
