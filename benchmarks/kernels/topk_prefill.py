"""Indexer top-k of prefill tiles: 2,048 rows (a chunk's tokens) of 32,768 C4 entries (one tile
of dsv4/ops/triton/indexer.py at depth), merged into the running top-k of the tiles before it,
k = 512, for scores of every shape.

    python -m benchmarks.kernels.topk_prefill            # H200; under a minute (compiles included)
    python -m benchmarks.kernels.topk_prefill --smoke    # CPU, Triton's interpreter, tiny rows, k = 64

Score shapes (indexer-like scores of benchmarks/kernels/topk.py, and the running set that of
the plain ones at the offsets before the tile):
  random     the plain scores (into the full set: every entry above the set's k-th one is a
             candidate, 511 a row)
  rising     plus a ramp of 0 to 8 along the row (the best entries the newest)
  falling    minus that ramp (the best the oldest)
  constant   every score 100.0 (all tie, every one above the set)
  causal     row t valid for its first t * W / (2T) entries (a chunk's early rows: mostly -inf)
  clustered  plus 6.0 on three runs of 256 entries a row at random places
  deep       (into a full set only) the plain scores into the set of the elementwise maximum of
             six such tiles (about a seventh of k candidates a row: a tile deep in a long
             context, as the step at 900k has them)
Checks first (exit 1 on a difference): every variant on every shape, as a first tile and
merged into the running set, bit for bit against the definition (torch.topk over stream_topk's
int64 keys: score desc, ties to the lower offset). Then times each, per call (the replay of a
CUDA graph of 10 calls), into the full set ("full") and as a first tile ("first"):
  row c/w/s/i/p   row_topk (dsv4/ops/triton/row_topk.py, a program per row, main's kernel): c
                  columns a launch, w warps, s scores a step of stage 1's second read, i
                  interpolated pivots, p candidates
  split BxN/lL/wF,S,G[/edges]  row_topk's split variant (dsv4/ops/triton/row_topk_split.py):
                  filter programs of B scores, N of them a launch, a small select of L lanes
                  (L,M: then one of M lanes for the rows with more),
                  F, S and G warps of the filter, small and big select programs, the oldest and
                  newest blocks first (their k-th keys bound the other blocks), /sM: slots of M
                  times k (the big select holds N of them a row), /fr: a first tile by the
                  program per row (its "first" columns: the row kernel's)
and says per split variant on how many rows the big select chose (full / first, per shape).
`radix + merge` is what the indexer ran before row_topk (random scores). The verdict lines
compare each split variant with the program per row: a chunk's top-k at 900k (7 tiles in each
of 2 CSA layers: a first tile, 6 deep ones and the final sort), the speedup on random and deep
scores (target 2x) and the worst ratio over every shape and column (target <= 1: never slower).
The lead sets row_topk.SPLIT (the indexer's variant) from it.
"""
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported

import torch  # noqa: E402

from benchmarks.kernels.topk import make_scores  # noqa: E402
from dsv4.bench.timing import graph_ms  # noqa: E402
from dsv4.ops.stream_topk import EMPTY_KEY, MIN_CHOSEN_KEY, RunningTopk, key_offsets, score_keys  # noqa: E402
from dsv4.ops.triton.radix_topk import radix_topk  # noqa: E402
from dsv4.ops.triton import row_topk as rt  # noqa: E402
from dsv4.ops.triton.row_topk import row_topk, row_topk_big_selects, sorted_keys  # noqa: E402
from dsv4.ops.triton.row_topk_split import Split  # noqa: E402
from benchmarks.kernels import parse_smoke_args  # noqa: E402

K = 64 if SMOKE else 512
T, W = 2048, 32768
SMOKE_T, SMOKE_W = 4, 2048
HBM_TBS = 4.8
STEP_TILES, CSA_LAYERS = 7, 2     # a 2,048-token chunk at 900k: 7 tiles of 32,768 C4 entries in each of 2 layers
DEEP_TILES = 6      # the deep set: of the elementwise maximum of this many tiles
NOISE = 1.03        # a ratio to the row kernel up to this: the same time within the timings' noise
SHAPES = ("random", "rising", "falling", "constant", "causal", "clustered")
MAIN = (rt.CHUNK, rt.NUM_WARPS, rt.SUB, rt.INTERP, rt.capacity(K))     # a program per row (main's)
SWEEP = [MAIN, Split(), Split(lanes=1024), Split(lanes=512, mid_lanes=2048), Split(edges_first=False),
         Split(filter_warps=4), Split(block=4096, blocks=8, filter_warps=4),
         Split(block=4096, blocks=8, filter_warps=4, slot_mult=2), Split(select_warps=4), Split(first_rows=True)]
SMOKE_SWEEP = [(1024, 4, 256, True, 128), Split(block=256, blocks=4, filter_warps=2, select_warps=2, lanes=64,
                                                big_warps=2, mid_lanes=128)]


def label(variant) -> str:
    if isinstance(variant, Split):
        return variant.label()
    chunk, warps, sub, interp, cap = variant
    return f"row {chunk // 1024}k/{warps}/{sub}/{'i' if interp else 'b'}/{cap}"


def run_rows(scores, variant, first=0, prev=None, big=False):
    """row_topk of one variant -> keys, or with big (a split variant) (keys, [T] big selects)."""
    if isinstance(variant, Split):
        if big:
            return row_topk_big_selects(scores, K, first, prev, split=variant)
        return row_topk(scores, K, first, prev, split=variant)
    chunk, warps, sub, interp, cap = variant
    return row_topk(scores, K, first, prev, chunk=chunk, num_warps=warps, interp=interp, cap=cap, sub=sub)


def shaped(shape: str, plain: torch.Tensor, gen) -> torch.Tensor:
    """The tile of one score shape (see the docstring) from the plain scores [T, W]."""
    rows, width = plain.shape
    ramp = torch.linspace(0, 8, width, device=plain.device)
    if shape == "random":
        return plain
    if shape == "rising":
        return plain + ramp
    if shape == "falling":
        return plain - ramp
    if shape == "constant":
        return torch.full_like(plain, 100.0)
    cols = torch.arange(width, device=plain.device)
    if shape == "causal":
        lengths = torch.arange(rows, device=plain.device) * width // (2 * rows)
        return plain.masked_fill(cols[None, :] >= lengths[:, None], float("-inf"))
    assert shape == "clustered"
    run = min(256, width // 8)
    starts = torch.randint(0, width - run, (rows, 3, 1), generator=gen, device=plain.device)
    inside = ((cols >= starts) & (cols < starts + run)).any(1)
    return plain + 6.0 * inside


def reference(scores: torch.Tensor) -> torch.Tensor:
    """The definition's top K keys of a row's scores, sorted (EMPTY_KEY past the valid ones)."""
    keys = score_keys(scores).topk(K, dim=1).values
    return torch.where(keys >= MIN_CHOSEN_KEY, keys, EMPTY_KEY)


def check(plain, prev, tiles, deep, deep_prev, sweep) -> list[str]:
    """Every variant on every shape, as a first tile and merged into prev (the set of plain at
    offsets [0, W): the tile at [W, 2W)), and plain merged into deep_prev (the set of deep),
    against the reference."""
    errors = []
    width = plain.shape[1]
    cases = [(shape, tile, plain, prev) for shape, tile in tiles.items()] + [("deep", plain, deep, deep_prev)]
    for shape, tile, before, before_set in cases:
        want_first = reference(tile)
        want_merged = reference(torch.cat([before, tile], dim=1))
        for v in sweep:
            for name, keys, want in (("first tile", run_rows(tile, v), want_first),
                                     ("merged", run_rows(tile, v, width, before_set), want_merged)):
                keys = sorted_keys(keys)
                if not (torch.equal(keys, want) and torch.equal(key_offsets(keys), key_offsets(want))):
                    errors.append(f"{shape} {label(v)} {name}: differs from the reference")
    return errors


def step_ms(t: dict, sort_ms: float) -> float:
    """A chunk's top-k at 900k of one variant's times: per CSA layer a first tile, the others
    deep, and the final sort."""
    return CSA_LAYERS * (t[("random", "first")] + (STEP_TILES - 1) * t[("deep", "full")] + sort_ms)


def verdict(times: dict, row: str, sort_ms: float) -> list[str]:
    """Per split variant: its speedup over the program per row (label row) on random and deep
    scores into a full set, the worst ratio (split / row) over every shape and column, and a
    step at 900k (step_ms)."""
    base = times[row]
    lines = [f"  {row:34s} step at 900k {step_ms(base, sort_ms):6.3f} ms"]
    for name, t in times.items():
        if name == row:
            continue
        speedup = base[("random", "full")] / t[("random", "full")]
        deep = base[("deep", "full")] / t[("deep", "full")]
        worst = max(t[c] / base[c] for c in t)
        at = max(t, key=lambda c: t[c] / base[c])
        ok = "no" if speedup < 2 or worst > NOISE else "OK" if worst <= 1 else "OK within timing noise"
        lines.append(f"  {name:34s} step at 900k {step_ms(t, sort_ms):6.3f} ms  random {speedup:5.2f}x  "
                     f"deep {deep:5.2f}x  worst {worst:5.2f} of row ({at[0]}, {at[1]})  {ok}")
    return lines


def main() -> int:
    args, device = parse_smoke_args(__doc__, "CPU, Triton's interpreter, tiny rows")
    rows, width, sweep = (SMOKE_T, SMOKE_W, SMOKE_SWEEP) if args.smoke else (T, W, SWEEP)
    reps = 1 if args.smoke else 10
    gen = torch.Generator(device=device).manual_seed(0)
    name = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"prefill indexer top-k {K} of [{rows}, {width}] fp32 tiles merged into a running set, {name}")
    t0 = time.perf_counter()
    plain = make_scores(rows, 2 * width, device, gen)[:, :width].contiguous()    # every entry valid (no tail)
    prev = row_topk(plain, K)                           # the set of the tiles before: offsets [0, W)
    tiles = {shape: shaped(shape, plain, gen) for shape in SHAPES}
    deep = torch.stack([make_scores(rows, 2 * width, device, gen)[:, :width] for _ in range(DEEP_TILES)]).amax(0)
    deep_prev = row_topk(deep, K)
    errors = check(plain, prev, tiles, deep, deep_prev, sweep)
    for e in errors:
        print(f"  MISMATCH {e}")
    print(f"checked {len(sweep)} variants x {len(SHAPES)} shapes in {time.perf_counter() - t0:.1f} s "
          f"(compiles included)")
    floor = rows * width * 4 / (HBM_TBS * 1e12) * 1e3
    print(f"\nms per tile (HBM floor {floor:.4f} ms); full: into the full set, first: a first tile")
    running = RunningTopk(rows, K, device)
    running.merge(radix_topk(plain, K)[0])
    state = running.keys.clone()

    def radix_merge():
        running.keys.copy_(state)
        running.merge(radix_topk(plain, K, width)[0])

    print(f"  {'radix + merge (random, full)':34s} {graph_ms(radix_merge, device, reps):8.4f} ms")
    print(f"  {'':34s} " + " ".join(f"{s:>17s}" for s in SHAPES) + f" {'deep':>8s}")
    print(f"  {'':34s} " + " ".join(f"{'full':>8s} {'first':>8s}" for _ in SHAPES) + f" {'full':>8s}")
    times = {}
    for v in sweep:
        t = {}
        for shape, tile in tiles.items():
            t[(shape, "full")] = graph_ms(lambda v=v, x=tile: run_rows(x, v, width, prev), device, reps)
            t[(shape, "first")] = graph_ms(lambda v=v, x=tile: run_rows(x, v), device, reps)
        t[("deep", "full")] = graph_ms(lambda v=v: run_rows(plain, v, width, deep_prev), device, reps)
        times[label(v)] = t
        print(f"  {label(v):34s} " + " ".join(f"{t[(s, 'full')]:8.4f} {t[(s, 'first')]:8.4f}" for s in SHAPES) +
              f" {t[('deep', 'full')]:8.4f}")
        if isinstance(v, Split):
            big = [f"{int((run_rows(x, v, width, prev, big=True)[1] > 0).sum())}/"
                   f"{int((run_rows(x, v, big=True)[1] > 0).sum())}" for x in tiles.values()]
            deep_big = int((run_rows(plain, v, width, deep_prev, big=True)[1] > 0).sum())
            print(f"  {'  big select rows (full/first)':34s} " + " ".join(f"{b:>17s}" for b in big) +
                  f" {deep_big:>8d}")
    print("\nsplit vs the program per row (target: random >= 2x, worst <= 1):")
    sort_ms = graph_ms(lambda: key_offsets(sorted_keys(prev)), device, reps)
    print(f"  {'final sort (a layer)':34s} {sort_ms:8.4f} ms")
    for line in verdict(times, label(sweep[0]), sort_ms):
        print(line)
    print(f"total {time.perf_counter() - t0:.1f} s")
    print("FAIL: row top-k differs from the reference" if errors else "OK: row top-k equals the reference")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
