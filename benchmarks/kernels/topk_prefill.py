"""Indexer top-k of prefill tiles: 2,048 rows (a chunk's tokens) of 32,768 or 65,536 C4 entries
(one tile of dsv4/ops/triton/indexer.py at depth), merged into the running top-k of the tiles
before it, k = 512.

    python -m benchmarks.kernels.topk_prefill            # H200; about a minute (compiles included)
    python -m benchmarks.kernels.topk_prefill --smoke    # CPU, Triton's interpreter, tiny rows

Checks first (exit 1 on a difference): every variant's sorted keys and offsets bit for bit
against the definition, torch.topk over stream_topk's int64 keys (score desc, ties to the lower
offset), on indexer-like scores with a -inf tail per row and on small-integer scores (ties), as
one tile and as two tiles merged. Then times one tile merged into a full running set, per call
(the replay of a CUDA graph of 10 calls):
  radix + merge   what the indexer ran: radix_topk of the tile (dsv4/ops/triton/radix_topk.py,
                  many programs per row) + RunningTopk.merge (cat + torch.topk)
  topk + merge    RunningTopk.add: one torch.topk over the tile's keys and the set (a torch floor)
                  (both also copy the [2048, 512] set back first: a few microseconds)
  row c/w/s/i/p   row_topk (dsv4/ops/triton/row_topk.py, a program per row, the merge in the
                  kernel): c columns a launch, w warps, s scores a step of stage 1's second
                  read (0: from registers), i interpolated (or bisected) pivots, p candidates
  split BxN/C/wF,S[/fbX][/nocut]  row_topk's split variant (dsv4/ops/triton/row_topk_split.py):
                  filter programs of B scores, N of them a launch (B * N columns), C candidates
                  a block keeps at most, F and S warps of the filter and select programs,
                  fallback launches of X columns (default row_topk's CHUNK), nocut: a first tile's rows to
                  the fallback whole
and once per layer (not per tile) the row path's final sort of the set (sorted_keys). Each row
variant also times a first tile (into an empty set: the split variant cuts every block) and a
rising tile (the scores plus a ramp along the row, into the same full set: the split variant's
worst case, every block cut, the top k in the last ones, every row to its fallback), and says
on how many rows its fallback chose (split only; first / full / rising). A step at 900k: per
layer a first tile, the other tiles into a full set and the sort. HBM floor: reading the tile
once at 4.8 TB/s. The best variant's step sets row_topk.SPLIT (the indexer's row top-k).
"""
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported

import torch  # noqa: E402

from benchmarks.kernels.topk import make_scores, reference  # noqa: E402
from dsv4.bench.timing import graph_ms  # noqa: E402
from dsv4.ops.stream_topk import RunningTopk, key_offsets  # noqa: E402
from dsv4.ops.triton.radix_topk import radix_topk  # noqa: E402
from dsv4.ops.triton import row_topk as rt  # noqa: E402
from dsv4.ops.triton.row_topk import row_topk, row_topk_fallbacks, sorted_keys  # noqa: E402
from dsv4.ops.triton.row_topk_split import Split  # noqa: E402
from benchmarks.kernels import parse_smoke_args  # noqa: E402

K = 512
T, WIDTHS = 2048, (32768, 65536)
SMOKE_T, SMOKE_WIDTHS = 4, (3000, 20000)
HBM_TBS = 4.8
STEP_ENTRIES, CSA_LAYERS = 8 * 32768, 2     # a 2,048-token chunk at 900k: 8 tiles of 32,768 in each of 2 CSA layers
# (chunk, num_warps, sub, interp, cap) of a program per row, or a Split: row_topk's default first
DEFAULT = rt.SPLIT or (rt.CHUNK, rt.NUM_WARPS, rt.SUB, rt.INTERP, rt.capacity(K))
# (the program per row's other sizes: benchmarks/results/2026-12-01-s9/topk_prefill.txt)
CANDIDATES = [(rt.CHUNK, rt.NUM_WARPS, rt.SUB, rt.INTERP, rt.capacity(K)),
              Split(), Split(block_cap=128), Split(block=2048, blocks=16, block_cap=128),
              Split(block=2048, blocks=16, block_cap=128, filter_warps=2),
              Split(block=1024, blocks=32, block_cap=64, filter_warps=2),
              Split(block=8192, blocks=4, block_cap=512, filter_warps=8), Split(blocks=16), Split(select_warps=4),
              Split(filter_warps=8), Split(cut_first=False), Split(fallback_chunk=32768)]
SWEEP = [DEFAULT] + [v for v in CANDIDATES if v != DEFAULT]
SMOKE_SWEEP = [(8192, 4, 1024, True, 1024), (16384, 4, 0, False, 2048),
               Split(block=2048, blocks=4, block_cap=256, fallback_chunk=8192)]


def label(variant) -> str:
    if isinstance(variant, Split):
        return variant.label()
    chunk, warps, sub, interp, cap = variant
    return f"row {chunk // 1024}k/{warps}/{sub}/{'i' if interp else 'b'}/{cap}"


def run_rows(scores, variant, first=0, prev=None, fallbacks=False):
    """row_topk of one variant -> keys, or (keys, [T] fallback launches a row or None)."""
    if isinstance(variant, Split):
        kw = dict(split=variant)
    else:
        chunk, warps, sub, interp, cap = variant
        kw = dict(chunk=chunk, num_warps=warps, interp=interp, cap=cap, sub=sub)
    return row_topk_fallbacks(scores, K, first, prev, **kw) if fallbacks else row_topk(scores, K, first, prev, **kw)


def check(device, gen, rows, widths, sweep) -> list[str]:
    """Every variant on every width as one tile, and on the widest as two tiles of half of it
    (one compiled variant each: every launch is a full chunk); on indexer-like scores, small
    integers (ties) and rising ones (the split variant's fallback)."""
    errors = []
    for W in widths:
        for kind in ("indexer", "ties", "rising"):
            scores = make_scores(rows, W, device, gen, kind == "ties")
            if kind == "rising":
                scores += torch.linspace(0, 8, W, device=device)
            want_keys, want_offs = reference(scores, K)
            half = W // 2
            for v in sweep:
                got = [("one tile", sorted_keys(run_rows(scores, v)))]
                if W == max(widths):
                    two = run_rows(scores[:, half:], v, half, run_rows(scores[:, :half], v))
                    got.append(("two tiles", sorted_keys(two)))
                for name, keys in got:
                    if not (torch.equal(keys, want_keys) and torch.equal(key_offsets(keys), want_offs)):
                        errors.append(f"W={W} {kind} {label(v)} {name}: differs from the reference")
    return errors


def main() -> int:
    args, device = parse_smoke_args(__doc__, "CPU, Triton's interpreter, tiny rows")
    rows, widths, sweep = (SMOKE_T, SMOKE_WIDTHS, SMOKE_SWEEP) if args.smoke else (T, WIDTHS, SWEEP)
    reps = 1 if args.smoke else 10
    gen = torch.Generator(device=device).manual_seed(0)
    name = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"prefill indexer top-k {K} of [{rows}, W] fp32 tiles merged into a running set, {name}")
    t0 = time.perf_counter()
    errors = check(device, gen, rows, widths, sweep)
    for e in errors:
        print(f"  MISMATCH {e}")
    print(f"checked {len(sweep)} variants in {time.perf_counter() - t0:.1f} s (compiles included)")
    best = {}
    for W in widths:
        scores = make_scores(rows, W, device, gen)
        floor = rows * W * 4 / (HBM_TBS * 1e12) * 1e3
        print(f"\n[{rows}, {W}]: ms per tile (HBM floor {floor:.4f} ms)")
        running = RunningTopk(rows, K, device)
        running.merge(radix_topk(scores, K)[0])
        state = running.keys.clone()
        prev = run_rows(scores, sweep[0])

        def old():
            running.keys.copy_(state)
            running.merge(radix_topk(scores, K, W)[0])

        def floor_torch():
            running.keys.copy_(state)
            running.add(scores, W)

        base = graph_ms(old, device, reps)
        print(f"  {'radix + merge':24s} {base:9.4f} ms  {1:6.2f}x  {floor / base * 100:5.1f}% of HBM")
        ms = graph_ms(floor_torch, device, reps)
        print(f"  {'topk + merge':24s} {ms:9.4f} ms  {base / ms:6.2f}x  {floor / ms * 100:5.1f}% of HBM")
        rising = scores + torch.linspace(0, 8, W, device=device)
        print(f"  {'':24s} {'full set':>12s} {'':7s} {'':12s} {'first tile':>12s} {'rising':>12s}  "
              f"fallback rows (first / full / rising)")
        sort_ms = graph_ms(lambda: key_offsets(sorted_keys(prev)), device, reps)
        tiles = STEP_ENTRIES // W
        for v in sweep:
            ms = graph_ms(lambda v=v: run_rows(scores, v, W, prev), device, reps)
            first_ms = graph_ms(lambda v=v: run_rows(scores, v), device, reps)
            rising_ms = graph_ms(lambda v=v: run_rows(rising, v, W, prev), device, reps)
            fb = [run_rows(x, v, *a, fallbacks=True)[1] for x, a in ((scores, (0, None)), (scores, (W, prev)),
                                                                      (rising, (W, prev)))]
            fb = " / ".join("-" if f is None else str(int((f > 0).sum())) for f in fb)
            step = CSA_LAYERS * (first_ms + (tiles - 1) * ms + sort_ms)
            print(f"  {label(v):24s} {ms:9.4f} ms  {base / ms:6.2f}x  {floor / ms * 100:5.1f}% of HBM  "
                  f"{first_ms:9.4f} ms {rising_ms:9.4f} ms  {fb}")
            if W not in best or step < best[W][2]:
                best[W] = (label(v), ms, step)
        print(f"  {'final sort (a layer)':24s} {sort_ms:9.4f} ms")
        print(f"  a step at 900k ({tiles} tiles x {CSA_LAYERS} layers): radix + merge "
              f"{tiles * CSA_LAYERS * base:.2f} ms")
    print()
    for W, (n, ms, step) in best.items():
        print(f"best at [{rows}, {W}]: {n} {ms:.4f} ms a tile into a full set; a step at 900k "
              f"({STEP_ENTRIES // W} tiles x {CSA_LAYERS} layers, first tiles and sorts included) {step:.2f} ms")
    print(f"total {time.perf_counter() - t0:.1f} s")
    print("FAIL: row top-k differs from the reference" if errors else "OK: row top-k equals the reference")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
