"""The M-tile schedule of the grouped expert GEMMs (dsv4/ops/triton/moe_grouped.py): which sorted
rows each tile slot multiplies by which expert's weights.

`schedule_reference` (torch, ~10 ops) is the definition; `_schedule_kernel` computes the same
two tensors in one launch of one program (the host cost of an eager step's MoE layer is its
launches: docs/architecture.md, Engine). The kernel is a stable counting sort: pass 1 counts the
pairs of each expert, pass 2 places pair p at row start[e] + (pairs before p with expert e),
using a one-hot [BLOCK_P, EP] tile per block of pairs (its column cumsum ranks a block's pairs
of one expert in pair order); the slot table reads each slot's expert from the tiles' cumsum.
Its work is P * EP, so large schedules (many pairs over many experts) stay on torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ONE_HOT = 8192                  # elements of a one-hot tile [BLOCK_P, EP] (registers of one program)
# P * EP up to which the one-program kernel runs: on an H200 it beats the torch ops' device time up
# to 262,144 (demo, 8192-token steps: 0.24 against 0.38 ms) and ties them at 786,432 (V4-Flash,
# 512 tokens: 0.30 / 0.32 ms); at 3.1M it takes 1.0 against 0.35 ms (`python -m benchmarks.kernels.moe_schedule`)
KERNEL_MAX_WORK = 1 << 19


def slots(P: int, E: int, block_m: int) -> int:
    """S: M-tile slots bounding the tiles of P pairs (each expert with rows adds at most one
    partial tile)."""
    return triton.cdiv(P, block_m) + min(E, P)


def schedule_reference(flat_ids: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flat_ids [P] (expert of each pair) -> (order [P] int32: the pair of each row, sorted by
    expert (stable); sched [3, S] int32: expert, first row, end row of each M-tile slot).
    Slots past the last tile get the last expert and a first row >= its end row."""
    P = flat_ids.numel()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(E, dtype=torch.long, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))   # bincount would sync to size its output
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)                                    # exclusive end slot of each expert
    slot = torch.arange(slots(P, E, block_m), device=flat_ids.device)
    e = torch.searchsorted(tile_end, slot, right=True).clamp_(max=E - 1)
    first = ends[e] - counts[e] + (slot - tile_end[e] + tiles[e]) * block_m
    return order.to(torch.int32), torch.stack([e, first, ends[e]]).to(torch.int32)


@triton.jit
def _one_hot(ids_ptr, p, P, experts):
    """[BLOCK_P, EP] int32: 1 where pair p (< P) has expert `experts` (pairs past P: all 0)."""
    e = tl.load(ids_ptr + p, mask=p < P, other=-1)
    return (e[:, None] == experts[None, :]).to(tl.int32)


@triton.jit
def _pick(hot, values):
    """values [EP] at the one column of each row of hot [R, EP] -> [R]."""
    return tl.sum(hot * values[None, :], axis=1)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("P", "S"))
def _schedule_kernel(ids_ptr, order_ptr, sched_ptr, P, S, E: tl.constexpr, EP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    # one program. ids [P] int64 < E -> order [P] int32, sched [3, S] int32 (schedule_reference)
    experts = tl.arange(0, EP)
    counts = tl.zeros([EP], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        counts += tl.sum(_one_hot(ids_ptr, p0 + tl.arange(0, BLOCK_P), P, experts), axis=0)
    ends = tl.cumsum(counts, axis=0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)                           # exclusive end slot of each expert
    next_row = ends - counts                                      # [EP] each expert's next free row
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        hot = _one_hot(ids_ptr, p, P, experts)
        rank = tl.sum(hot * tl.cumsum(hot, axis=0), axis=1) - 1     # among the block's pairs of its expert
        row = _pick(hot, next_row) + rank
        tl.store(order_ptr + row, p.to(tl.int32), mask=p < P)
        next_row += tl.sum(hot, axis=0)
    for s0 in range(0, S, BLOCK_P):
        s = s0 + tl.arange(0, BLOCK_P)
        done = (tile_end[None, :] <= s[:, None]) & (experts < E)[None, :]
        e = tl.minimum(tl.sum(done.to(tl.int32), axis=1), E - 1)  # searchsorted(tile_end, s, right)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        end = _pick(hot, ends)
        first = end - _pick(hot, counts) + (s - _pick(hot, tile_end) + _pick(hot, tiles)) * BLOCK_M
        ok = s < S
        tl.store(sched_ptr + s, e, mask=ok)
        tl.store(sched_ptr + S + s, first, mask=ok)
        tl.store(sched_ptr + 2 * S + s, end, mask=ok)


def kernel_fits(P: int, E: int) -> bool:
    """Whether the one-program kernel takes P pairs over E experts (its work is P * EP)."""
    return P * max(16, triton.next_power_of_2(E)) <= KERNEL_MAX_WORK


def schedule(flat_ids: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`schedule_reference`, in one launch where `kernel_fits` (else the torch ops)."""
    P = flat_ids.numel()
    if P == 0 or not kernel_fits(P, E):
        return schedule_reference(flat_ids, E, block_m)
    ep = max(16, triton.next_power_of_2(E))
    S = slots(P, E, block_m)
    order = torch.empty(P, dtype=torch.int32, device=flat_ids.device)
    sched = torch.empty((3, S), dtype=torch.int32, device=flat_ids.device)
    _schedule_kernel[(1,)](flat_ids, order, sched, P, S, E=E, EP=ep, BLOCK_M=block_m,
                           BLOCK_P=max(16, ONE_HOT // ep), num_warps=4)
    return order, sched
