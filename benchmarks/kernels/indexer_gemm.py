"""The indexer's scores of a prefill chunk deep in context: the tiled kernel (one key tile a
block of tokens, a tensor-core dot per head) against the per-token kernel
(dsv4/ops/triton/indexer_scores.py), V4-Flash shapes (Hi = 64, Di = 128, top-k 512).

    python -m benchmarks.kernels.indexer_gemm            # H200; about a minute (--budget-s)
    python -m benchmarks.kernels.indexer_gemm --smoke    # CPU, Triton's interpreter, tiny shapes
    python -m benchmarks.kernels.indexer_gemm --variants # H200: only the head-loop variants (below)

The case: one request's chunk of T = 2048 tokens at positions START .. START + 2047 (START =
4E - T = 899,072: the chunk at ~900k), candidates its C4 entries as a PagedRows (64-entry
pages in a shuffled order, pitch 2 pages: another layer's pages in between), token at position
p sees entries e < (p + 1) // 4, width E = 225,280; q bf16, weights bf16, keys bf16 or packed
FP8 (dsv4/ops/kv_fp8.py). The step scores tile_width(T, 512) = 32,768 entries a launch, as
dsv4/ops/triton/indexer.py does.

Checks first (exit 1 on a failure), for each key kind, over the whole width: the tiled
scores (GEMM_TILES) against the per-token ones (max abs error, relative to the largest score;
-inf at the same places), and the top-512 offsets of the step (indexer._topk_offsets) on both
paths: the same sets on every row whose 512th and 513th per-token scores are more than 1e-5
apart (relative). Then times one full tile (CUDA events, median): the per-token kernel and
each (BLOCK_T, BLOCK_E, num_warps, num_stages) of SWEEP on bf16 keys, while the sweep stays
within --budget-s (compiles count), then the best few on FP8 keys; prints a table with TFLOP/s
(2 T W Hi Di per tile of W entries) and % of 989 TFLOP/s (H200 bf16 dense), the best config,
and the whole step's scores (E / W tiles) at the best config against the per-token kernel.
Last, for GEMM_MIN_TOKENS, one tile at smaller T at the best config: the chunk's last T tokens,
and T decode tokens of T requests (blocks that never share their rows: the fallback's cost).

With --variants, only this: one bf16 tile by each head-loop variant of VARIANTS
(dsv4/ops/triton/indexer_scores_heads.py) beside indexer_scores' tiled kernel (GEMM_TILES): ms, % of peak, and the max abs error against the
current kernel's scores (relative to the largest; -inf at the same places), exit 1 where one is
off by more than 1e-5 relative.
"""
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported

import torch  # noqa: E402

from dsv4.bench.timing import median_ms  # noqa: E402
from dsv4.ops.kv_fp8 import pack_index_keys  # noqa: E402
from dsv4.ops.paged import PagedRows  # noqa: E402
from dsv4.ops.triton import indexer as tri  # noqa: E402
from dsv4.ops.triton import indexer_scores as isc  # noqa: E402
from dsv4.ops.triton.indexer_scores import GemmTiles  # noqa: E402
from dsv4.ops.triton.indexer_scores_heads import HeadLoopTiles, indexer_scores_heads  # noqa: E402
from benchmarks.kernels import parse_smoke_args  # noqa: E402

PEAK_FLOPS = 989e12
PAGE, LAYERS = 64, 2
TIE_GAP = 1e-5
# (BLOCK_T, BLOCK_E, num_warps, num_stages[, maxnreg]), the likeliest first (no register spills
# when compiled for sm_90): the sweep stops at the budget
SWEEP = [(64, 128, 8, 2), (64, 256, 8, 2), (32, 256, 8, 2), (64, 128, 8, 2, 128), (64, 128, 8, 3),
         (32, 128, 4, 2), (32, 256, 8, 2, 128), (64, 128, 4, 2), (64, 256, 8, 3), (128, 128, 8, 2),
         (32, 128, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (32, 256, 4, 2)]
# head-loop variants (label: tiles; offline sm_90 compile figures in the commit that added them).
# Measured before (H100, docs/benchmarks.md fourteenth session) and left out: keys-major dots
# (3.2-5.9 ms a tile), q by TMA at 168 registers with 3 or 4 stages (2.05, 2.07), the Gluon kernel
# (branch idxws: the previous head's epilogue under the next head's dot, 1.87-1.94 ms)
VARIANTS = {     # the default, then those never timed, then those timed before (docs/benchmarks.md)
    "q tma 64x128 w4 s3 (HEAD_TILES)": HeadLoopTiles(64, 128, 4, 3, q_tma=True),
    "q tma 64x256 w8 s3": HeadLoopTiles(64, 256, 8, 3, q_tma=True),
    "q tma 64x256 w8 s2": HeadLoopTiles(64, 256, 8, 2, q_tma=True),
    "q tma 64x256 w8 s4": HeadLoopTiles(64, 256, 8, 4, q_tma=True),
    "q tma 128x128 w8 s3": HeadLoopTiles(128, 128, 8, 3, q_tma=True),
    "pointers 64x128 w4 s2 r168 (GEMM_TILES' loop)": HeadLoopTiles(64, 128, 4, 2, 168),
    "pointers 64x128 w4 s3": HeadLoopTiles(64, 128, 4, 3),
    "q tma 64x128 w4 s2 r168": HeadLoopTiles(64, 128, 4, 2, 168, q_tma=True),
    "q tma 64x128 w4 s2": HeadLoopTiles(64, 128, 4, 2, q_tma=True),
    "q tma 64x128 w4 s4": HeadLoopTiles(64, 128, 4, 4, q_tma=True),
    "q tma 64x128 w4 s3 r232": HeadLoopTiles(64, 128, 4, 3, 232, q_tma=True),
}
TINY_VARIANTS = {"pointers 16x16": HeadLoopTiles(16, 16, 4, 2), "q tma 16x32": HeadLoopTiles(16, 32, 4, 2, q_tma=True)}
FULL = dict(T=2048, E=225280, Hi=64, Di=128, topk=512, sweep=SWEEP, fp8_best=3, reps=10,
            thresholds=[32, 64, 128, 256, 512, 1024, 2048])
TINY = dict(T=40, E=300, Hi=4, Di=32, topk=16, sweep=[(16, 16, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2, 128)],
            fp8_best=1, reps=1, thresholds=[16, 40])


def make_case(T, E, Hi, Di, fp8, device, gen):
    """q, weights, keys, cand of the chunk (module docstring)."""
    q = torch.randn(T, Hi, Di, generator=gen, device=device).to(torch.bfloat16)
    weights = (torch.randn(T, Hi, generator=gen, device=device) * Hi ** -0.5).to(torch.bfloat16)
    P = -(-E // PAGE)
    keys = torch.randn(P * PAGE * LAYERS, Di, generator=gen, device=device)
    keys = pack_index_keys(keys) if fp8 else keys.to(torch.bfloat16)
    pos = 4 * E - T + torch.arange(T, device=device)
    zeros = torch.zeros(T, dtype=torch.long, device=device)
    pages = torch.randperm(P, generator=gen, device=device)[None, :]
    return q, weights, keys, PagedRows(pages, zeros, zeros, (pos + 1) // 4, PAGE, LAYERS * PAGE, E)


def step_scores(args, tiles, width):
    """[T, E] fp32: the step's scores tile by tile (tiles None: the per-token kernel)."""
    q, weights, keys, cand = args
    return torch.cat([isc.indexer_scores(q, weights, keys, cand, weight_scale=weight_scale_of(q), e0=e0,
                                         e1=min(e0 + width, cand.width), tiles=tiles)
                      for e0 in range(0, cand.width, width)], dim=1)


def weight_scale_of(q):
    """The model's weight_scale: heads^-0.5 (dsv4/model/compressor.py)."""
    return q.shape[1] ** -0.5           # the model's weight_scale (heads^-0.5)


def step_offsets(args, topk, min_tokens):
    """The step's top-k offsets (indexer._topk_offsets) with GEMM_MIN_TOKENS = min_tokens."""
    saved, isc.GEMM_MIN_TOKENS = isc.GEMM_MIN_TOKENS, min_tokens
    try:
        return tri._topk_offsets(*args, topk, weight_scale_of(args[0]))
    finally:
        isc.GEMM_MIN_TOKENS = saved


def check(args, topk, width) -> list[str]:
    """The tiled path against the per-token one (module docstring) -> failure messages."""
    errors = []
    old, new = step_scores(args, None, width), step_scores(args, isc.GEMM_TILES, width)
    finite = torch.isfinite(old)
    if not torch.equal(finite, torch.isfinite(new)):
        errors.append("-inf positions differ")
    scale = old[finite].abs().max().item()
    err = (new - old)[finite].abs().max().item()
    print(f"  scores: max abs error {err:.3g} (largest score {scale:.3g}, relative {err / scale:.2g})")
    if err > 1e-5 * scale:
        errors.append(f"scores off by {err:.3g} (> 1e-5 x {scale:.3g})")
    T = old.shape[0]
    want, got = step_offsets(args, topk, T + 1), step_offsets(args, topk, 1)
    top = old.topk(topk + 1, dim=1).values
    tie_free = (top[:, topk - 1] - top[:, topk]) > TIE_GAP * top[:, topk - 1].abs()
    same = (want.sort(1).values == got.sort(1).values).all(1)
    exact = torch.equal(want, got)
    print(f"  top-{topk} offsets: {'identical' if exact else 'differ'}; rows with other sets: "
          f"{(~same).sum().item()} of {T} ({(~same & tie_free).sum().item()} of them tie-free); "
          f"tie-free rows {tie_free.sum().item()}")
    if (~same & tie_free).any():
        errors.append(f"{(~same & tie_free).sum().item()} tie-free rows select other top-{topk} sets")
    return errors


def time_ms(fn, device, reps):
    if device == "cuda":
        return median_ms(fn, reps)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def sweep(args, configs, width, device, reps, budget_s, base_ms):
    """Times one tile at each config while within budget_s -> [(ms, config)], printed."""
    q, weights, keys, cand = args
    T, Hi, Di = q.shape
    flops = 2 * T * width * Hi * Di
    out, start = [], time.perf_counter()
    for cfg in configs:
        if time.perf_counter() - start > budget_s:
            print(f"  (budget of {budget_s:.0f} s spent: {len(configs) - len(out)} configs not timed)")
            break
        tiles = GemmTiles(*cfg)
        try:
            ms = time_ms(lambda: isc.indexer_scores(q, weights, keys, cand, weight_scale=Hi ** -0.5, e0=0, e1=width,
                                                    tiles=tiles), device, reps)
        except Exception as e:  # noqa: BLE001 (a launch the device refuses: shared memory, registers)
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        out.append((ms, cfg))
        tfs = flops / ms / 1e9
        print(f"  {cfg[0]:7d} {cfg[1]:7d} {cfg[2]:5d} {cfg[3]:6d} {str(tiles.maxnreg or '-'):>7} {ms:9.3f} {tfs:8.1f} "
              f"{100 * tfs * 1e12 / PEAK_FLOPS:6.1f} {base_ms / ms:7.2f}", flush=True)
    return out


def run_kind(fp8, shape, device, gen, budget_s, configs):
    """Check and time one key kind -> (failures, timed configs)."""
    T, E, Hi, Di, topk, reps = (shape[k] for k in ("T", "E", "Hi", "Di", "topk", "reps"))
    args = make_case(T, E, Hi, Di, fp8, device, gen)
    width = tri.tile_width(T, topk)
    print(f"\n{'FP8' if fp8 else 'bf16'} keys: T={T} E={E} Hi={Hi} Di={Di}, tiles of {width} entries "
          f"({-(-E // width)} a step), GEMM_TILES={tuple(vars(isc.GEMM_TILES).values())}")
    errors = check(args, topk, width)
    q, weights, keys, cand = args
    base_ms = time_ms(lambda: isc.indexer_scores(q, weights, keys, cand, weight_scale=Hi ** -0.5, e0=0, e1=width,
                                                 tiles=None), device, reps)
    flops = 2 * T * width * Hi * Di
    print(f"  per-token kernel, one tile: {base_ms:.3f} ms, {flops / base_ms / 1e9:.1f} TFLOP/s")
    print(f"  {'BLOCK_T':>7} {'BLOCK_E':>7} {'warps':>5} {'stages':>6} {'maxnreg':>7} {'ms/tile':>9} {'TFLOP/s':>8} "
          f"{'%peak':>6} {'speedup':>7}")
    timed = sweep(args, configs, width, device, reps, budget_s, base_ms)
    if timed:
        ms, best = min(timed)
        tiles = -(-E // width)
        step_old = time_ms(lambda: step_scores(args, None, width), device, max(1, reps // 5))
        step_new = time_ms(lambda: step_scores(args, GemmTiles(*best), width), device, max(1, reps // 5))
        print(f"  best {best}: {ms:.3f} ms a tile; the step's scores ({tiles} tiles): per-token {step_old:.2f} ms, "
              f"tiled {step_new:.2f} ms ({step_old / step_new:.1f}x)")
    return errors, timed


def threshold(shape, tiles, device, gen):
    """GEMM_MIN_TOKENS: one tile of the first `width` entries at T tokens, as one request's chunk
    (blocks share their rows) and as T decode tokens of T requests (every block scored token by
    token), per-token kernel vs tiled (`tiles`), bf16 keys; prints the table and the smallest T
    from which the tiled kernel is faster on both."""
    print(f"\nGEMM_MIN_TOKENS (now {isc.GEMM_MIN_TOKENS}): one tile, per-token ms / tiled ms, tiled at {tiles}")
    print(f"  {'T':>5} {'width':>7} {'chunk':>17} {'decode batch':>17}")
    q, weights, keys, chunk = make_case(shape["T"], shape["E"], shape["Hi"], shape["Di"], False, device, gen)
    wins = []
    for T in shape["thresholds"]:
        width = min(tri.tile_width(T, shape["topk"]), chunk.width)
        t = torch.arange(T, device=device)
        cases = [PagedRows(chunk.pages, chunk.req[:T], chunk.lo[:T], chunk.hi[-T:], chunk.per_page, chunk.pitch,
                           chunk.width),
                 PagedRows(chunk.pages.expand(T, -1), t, torch.zeros_like(t), chunk.hi[-1].expand(T), chunk.per_page,
                           chunk.pitch, chunk.width)]
        row = []
        for cand in cases:
            row.append([time_ms(lambda c=cand, k=k: isc.indexer_scores(q[:T], weights[:T], keys, c, e0=0, e1=width,
                                                                       tiles=k), device, shape["reps"])
                        for k in (None, tiles)])
        wins.append(all(new < old for old, new in row))
        print(f"  {T:5d} {width:7d} " + " ".join(f"{old:8.3f}/{new:8.3f}" for old, new in row), flush=True)
    faster = [T for T, win in zip(shape["thresholds"], wins) if win and all(wins[shape["thresholds"].index(T):])]
    print(f"  tiled faster on both from T = {faster[0] if faster else 'never (in this range)'}")


def run_variants(shape, device, gen, variants) -> list[str]:
    """One bf16 tile by each head-loop variant beside GEMM_TILES (module docstring) -> failures."""
    T, E, Hi, Di, topk, reps = (shape[k] for k in ("T", "E", "Hi", "Di", "topk", "reps"))
    q, weights, keys, cand = make_case(T, E, Hi, Di, False, device, gen)
    width = min(tri.tile_width(T, topk), cand.width)
    flops = 2 * T * width * Hi * Di
    spans = [(0, width), (cand.width - width, cand.width)]     # timed: the first; checked: both (the last: causal tail)

    def scores(tiles, e0, e1):
        if isinstance(tiles, HeadLoopTiles):
            return indexer_scores_heads(q, weights, keys, cand, tiles, weight_scale=Hi ** -0.5, e0=e0, e1=e1)
        return isc.indexer_scores(q, weights, keys, cand, weight_scale=Hi ** -0.5, e0=e0, e1=e1, tiles=tiles)

    bases = [scores(isc.GEMM_TILES, e0, e1) for e0, e1 in spans]
    print(f"\nhead-loop variants, bf16 keys: T={T} Hi={Hi} Di={Di}, a tile of {width} entries (the step's first "
          f"timed; max err over the first and the last, relative to the largest score)")
    print(f"  {'variant':<52} {'ms/tile':>8} {'TFLOP/s':>8} {'%peak':>6} {'max err':>9}")
    errors = []
    rows = [(f"current GemmTiles{tuple(vars(isc.GEMM_TILES).values())}", isc.GEMM_TILES), *variants.items()]
    for label, tiles in rows:
        try:
            errs, same_inf = [], True
            for (e0, e1), base in zip(spans, bases):
                got, finite = scores(tiles, e0, e1), torch.isfinite(base)
                same_inf &= torch.equal(torch.isfinite(got), finite)
                errs.append((got - base)[finite].abs().max().item() / base[finite].abs().max().item())
            ms = time_ms(lambda: scores(tiles, *spans[0]), device, reps)
        except Exception as e:  # noqa: BLE001 (a compile or launch the device refuses)
            print(f"  {label:<52} {type(e).__name__}: {str(e)[:300]}")
            errors.append(f"{label}: {type(e).__name__}")
            continue
        tfs = flops / ms / 1e9
        print(f"  {label:<52} {ms:8.3f} {tfs:8.1f} {100 * tfs * 1e12 / PEAK_FLOPS:6.1f} {max(errs):9.2g}"
              f"{'' if same_inf else ' (-inf elsewhere)'}", flush=True)
        if not same_inf or max(errs) > 1e-5:
            errors.append(f"{label}: off by {max(errs):.3g} relative (same -inf: {same_inf})")
    return errors


def main() -> int:
    def flags(p):
        p.add_argument("--budget-s", type=float, default=35.0, help="seconds for the bf16 sweep (compiles included)")
        p.add_argument("--variants", action="store_true", help="only the head-loop variants beside GEMM_TILES")
    args, device = parse_smoke_args(__doc__, "CPU, Triton's interpreter, tiny shapes", flags)
    shape = TINY if args.smoke else FULL
    if args.variants:
        errors = run_variants(shape, device, torch.Generator(device=device).manual_seed(0),
                              TINY_VARIANTS if args.smoke else VARIANTS)
        for e in errors:
            print(f"  MISMATCH {e}")
        print("FAIL: a variant disagrees with GEMM_TILES' scores" if errors else "OK: every variant agrees")
        return 1 if errors else 0
    if args.smoke:          # several tiles a step, as at 900k
        tri.SCORE_TILE = shape["T"] * 32
        isc.GEMM_TILES = isc.GEMM_TILES_FP8 = GemmTiles(*shape["sweep"][0])
    gen = torch.Generator(device=device).manual_seed(0)
    name = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"indexer scores of a prefill chunk, tiled vs per token; {name}")
    errors, timed = run_kind(False, shape, device, gen, args.budget_s, shape["sweep"])
    best = [cfg for _, cfg in sorted(timed)[:shape["fp8_best"]]]
    more, timed8 = run_kind(True, shape, device, gen, args.budget_s, best)
    errors += more
    if timed:
        threshold(shape, GemmTiles(*min(timed)[1]), device, gen)
        print(f"\nbest config (bf16 keys): GemmTiles{min(timed)[1]}"
              + (f"; FP8 keys: GemmTiles{min(timed8)[1]}" if timed8 else ""))
    for e in errors:
        print(f"  MISMATCH {e}")
    print("FAIL: the tiled scores disagree with the per-token ones" if errors else
          "OK: the tiled scores agree with the per-token ones")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
