"""Sparse shared-KV attention on the GPU: the Triton kernel (dsv4/ops/triton/attention.py)
against the torch reference (dsv4/ops/attention.py) at V4-Flash shapes (H = 64, D = 512,
W = 128 window slots + K = 512 selected C4 slots, bf16, fp32 sinks).

    python -m benchmarks.kernels.attention          # needs CUDA; well under a minute

Checks first (exit 1 on a mismatch): every output within 2e-2 + 2e-2 |ref| of the reference
(the kernel rounds the probabilities to bf16 for the P.V product; the reference stays fp32).
Then times both (CUDA events, median) and prints a table. Roofline columns: bytes the kernel
must move = q read T*H*D*2 + key rows read once per token T*(W+K)*D*2 (an upper bound: no
reuse across tokens or head blocks) + indices T*(W+K)*8 + out written T*H*D*2, against
4.2 TB/s; FLOPs = 4*T*H*(W+K)*D against 800 TFLOP/s (bf16 dense). Every slot is valid.

Cases: decode, T tokens of T different requests (each its own 128 window rows and 512 rows
chosen among its 16384 C4 entries); prefill, one chunk of T tokens late in a long prompt
(position 262144 on; a 68 MB C4 pool, larger than L2): windows of consecutive rows of an SWA ring, C4 rows drawn at random below
each token's causal limit (repeats possible). A second table times tile shapes and the
slot split (tuning aid): the first row of each case is the default.

With `--deep-hca`, only a fourth table: one 2,048-token chunk at position 900,000 of an HCA
layer (window + every C128 entry below each token's limit, ~7k, over 2-entry pages as the cache
keeps them), checked against the reference, then timed for the default, the short-list prefill tile and DEEP_SCAN
against the bf16 peak: the O(E / 128) attention term of a deep prefill chunk.

    python -m benchmarks.kernels.attention --deep-hca     # ~1 minute
    python -m benchmarks.kernels.attention --deep-hca --deep-short   # + chunks of 256-1024 tokens

With `--deep-hca --variants` (or `--variants`), instead: the same chunk, the per-token kernel's
default tile (LONG_TILES) and the dispatch's default against every entry of VARIANTS, the
long-list kernels that `LONG_KERNEL` in dsv4/ops/triton/attention.py can pick (attention_shared.py, attention_wgmma.py),
each checked against the reference (max error printed) and timed; TFLOP/s count the model's
FLOPs, not a variant's own. `--one-item` hands the history over as one-item pages, as the
engine does (docs/architecture.md, "A step's addressing"). `--smoke` runs that table on a
4-token chunk at position 20,000 (H = 64, D = 512: the variants' own tiles) in Triton's
interpreter on the CPU (checks only: its times mean nothing; ~15 s).
`python -m benchmarks.kernels.attention_sm90` prints each variant's sm_90 registers, spills and
shared memory without a GPU.

    python -m benchmarks.kernels.attention --deep-hca --variants     # ~1.5 minutes, 7 compiles included
    python -m benchmarks.kernels.attention --smoke

A third table times paged sources (PagedRows, dsv4/ops/paged.py) against their dense form on
the same rows (bit-identical outputs required, and within tolerance of the reference): each
case's window as a PagedRows over 128-position pages (a CSA layer: the C4 source stays the
dense top-k), and window plus a range of K compressed entries over 2-entry pages (HCA-like).
Token t sits at position 65536 + 37 t (decode, request t) or PREFILL_START + t (prefill, one
request); pages are shuffled and LAYERS layers' pages interleave (pitch = LAYERS x page).
"""
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported

import torch  # noqa: E402

from dsv4.bench.timing import median_ms  # noqa: E402
from dsv4.ops import backend  # noqa: E402
from dsv4.ops.attention import sparse_attention as dispatch  # noqa: E402
from dsv4.ops.paged import PagedRows  # noqa: E402
from dsv4.ops.triton import attention as tri  # noqa: E402
from dsv4.ops.triton import attention_shared as shared  # noqa: E402
from dsv4.ops.triton import attention_wgmma as wgmma  # noqa: E402

H, D, W, K = 64, 512, 128, 512
HBM_BPS, PEAK_FLOPS = 4.2e12, 800e12
CASES = [("decode", 1), ("decode", 8), ("decode", 64), ("prefill", 4096), ("prefill", 16384)]
C4_PER_REQUEST, PREFILL_START = 16384, 262144
TOL = 2e-2
DEVICE = "cuda"
# (h_block, block_k, num_warps, num_stages, num_splits); None = the wrapper's choice
TILES = [(16, 32, 8, 2, None), (16, 32, 4, 2, None), (16, 64, 8, 2, None), (32, 32, 8, 2, None),
         (32, 64, 8, 2, None), (16, 32, 8, 3, None), (64, 32, 8, 2, None), (16, 32, 8, 2, 1)]
PREFILL_SCAN = [(64, 32, 8, 2, None), (64, 64, 8, 2, None), (64, 32, 4, 2, None), (64, 32, 8, 3, None),
                (64, 16, 8, 2, None), (64, 16, 4, 2, None), (32, 32, 4, 2, None), (64, 64, 8, 3, None)]
DEEP_SCAN = [(32, 128, 8, 2, None), (32, 128, 8, 3, None), (32, 128, 4, 2, None), (16, 128, 8, 2, None),
             (16, 128, 4, 2, None), (32, 256, 8, 2, None), (16, 256, 8, 2, None), (32, 64, 4, 2, None)]
DEEP_T, DEEP_POS = 2048, 900_000
# `--deep-hca --deep-short`: shorter chunks at the same depth (a smaller token budget), default
# tiles against the decode tile and the long-list tile, with and without the slot split
DEEP_SHORT_T = (256, 512, 1024)
DEEP_SHORT_SCAN = [(16, 32, 8, 2, None), (32, 128, 4, 2, None), (32, 128, 4, 2, 1), (32, 128, 8, 2, None)]
TUNE_CASES = [("decode", 1), ("decode", 64), ("prefill", 4096)]
LAYERS, SWA_PAGE, HCA_PAGE, HCA_RATIO, DECODE_POS = 4, 128, 2, 128, 65536
# `--deep-hca --variants` / `--variants`: (name, knobs) against the per-token kernel, sm_90 (Triton
# 3.6) registers, bytes spilled a thread and shared memory in the comments (`attention_sm90`: every
# dot a wgmma, keys by cp.async). 7 compiles, a few seconds each: the table takes about 1.5 minutes.
# "shared": tokens x heads a program over the union of their ranges, the output channels split in
# d_parts (dsv4/ops/triton/attention_shared.py): a SharedTiles (block_t, h_block, block_k, d_parts,
# warps, stages, q_regs, lazy)
# "wgmma": one token x 64 heads a program, Gluon (dsv4/ops/triton/attention_wgmma.py; sm_90 only):
# block_k keys a block, stages blocks in shared memory, sums_at_end (the row sums' terms per thread)
VARIANT_FNS = {"shared": shared.shared_attention, "wgmma": wgmma.wgmma_attention}
VARIANTS = [("shared", shared.SharedTiles(*tiles)._asdict()) for tiles in [
    (2, 64, 32, 2, 8, 3, False, True),      # 255 regs, 24 B (outside the loops), 224 KB: M = 128 rows,
                                            # acc [128, 256], lazy rescaling
    (2, 64, 32, 2, 8, 3, False, False),     # 255, 8 B, 224 KB: eager rescaling (SHARED_TILES)
    (2, 64, 32, 2, 8, 3, True, True),       # 255, 144 B, 224 KB: q's own channels in registers
    (2, 64, 16, 2, 8, 6, False, True),      # 246, 0 B, 224 KB: 16 keys a step, 5 blocks in flight
    (1, 64, 64, 1, 8, 2, False, True),      # 255, 424 B, 193 KB: M = 64 (one token), acc [64, 512] over
                                            # 2 warp groups (each computing the whole q k^T)
    (1, 64, 32, 1, 8, 4, False, True),      # 255, 136 B, 193 KB
]] + [("wgmma", dict(block_k=bk, stages=st, sums_at_end=end, copy_at=at)) for bk, st, end, at in [
    # sm_90 registers, bytes spilled, shared memory; ms an HCA layer on an H100 (docs/benchmarks.md,
    # sixteenth session, call 4)
    (64, 2, False, 0),                      # 255 regs, 32 B, 200 KB; 5.35 ms (the default)
    (64, 2, False, 1),                      # 255, 24 B; 6.32
    (64, 2, False, 2),                      # 255, 48 B; 5.49
    (64, 2, True, 0),                       # 5.75
    (64, 2, True, 1),                       # 255, 96 B (in the loop); 6.14
    (32, 3, False, 0),                      # 164 KB; 7.16
    (32, 3, True, 1),                       # 254, 0 B; 6.61
    (32, 4, True, 0)]]                      # 255, 16 B, 196 KB; 6.49


def make_case(kind, T, gen):
    """q [T, H, D], sources [(swa [Nswa, D], swa_idx [T, W]), (c4 [Nc, D], c4_idx [T, K])], sinks [H]."""
    def rows(n):
        return torch.randn(n, D, generator=gen, device=DEVICE).to(torch.bfloat16)

    q = torch.randn(T, H, D, generator=gen, device=DEVICE).to(torch.bfloat16)
    sinks = torch.randn(H, generator=gen, device=DEVICE)
    t = torch.arange(T, device=DEVICE)[:, None]
    if kind == "decode":            # request t: window rows [t*W, (t+1)*W), C4 rows [t*E, (t+1)*E)
        swa, c4 = rows(T * W), rows(T * C4_PER_REQUEST)
        swa_idx = torch.rand(T, W, generator=gen, device=DEVICE).argsort(dim=1) + t * W
        pick = torch.rand(T, C4_PER_REQUEST, generator=gen, device=DEVICE).topk(K, dim=1).indices
        c4_idx = pick + t * C4_PER_REQUEST
    else:                           # one request at positions PREFILL_START + t
        swa, c4 = rows(T + W), rows((PREFILL_START + T) // 4)
        swa_idx = t + torch.arange(W, device=DEVICE)[None, :]
        limit = (PREFILL_START + t + 1) // 4
        c4_idx = (torch.rand(T, K, generator=gen, device=DEVICE) * limit).long()
    return q, [(swa, swa_idx), (c4, c4_idx)], sinks


def paged_rows(req, lo, hi, per_page, width, gen):
    """A PagedRows over shuffled physical pages (pages below every range trimmed to -1), pitch
    LAYERS * per_page -> (PagedRows, pool rows)."""
    R = int(req.max()) + 1
    first, last = int(lo.min()) // per_page, int(hi.max() - 1) // per_page
    count = last - first + 1
    pages = torch.full((R, last + 1), -1, dtype=torch.long, device=DEVICE)
    pages[:, first:] = torch.randperm(R * count, generator=gen, device=DEVICE).view(R, count)
    return PagedRows(pages, req, lo, hi, per_page, LAYERS * per_page, width), R * count * LAYERS * per_page


def make_paged_case(kind, T, gen):
    """make_case's q, sinks and C4 source, plus the window and an HCA-like history as
    (pool, PagedRows)."""
    q, (_, c4_source), sinks = make_case(kind, T, gen)
    t = torch.arange(T, device=DEVICE)
    pos = DECODE_POS + 37 * t if kind == "decode" else PREFILL_START + t
    req = t if kind == "decode" else torch.zeros_like(t)
    window, n_swa = paged_rows(req, pos - W + 1, pos + 1, SWA_PAGE, W, gen)
    closed = (pos + 1) // HCA_RATIO
    history, n_hca = paged_rows(req, (closed - K).clamp(min=0), closed, HCA_PAGE, K, gen)

    def rows(n):
        return torch.randn(n, D, generator=gen, device=DEVICE).to(torch.bfloat16)
    return q, sinks, (rows(n_swa), window), c4_source, (rows(n_hca), history)


def paged_table(gen, scale) -> int:
    """Print paged against dense on the same rows; -> number of failures."""
    print(f"\npaged sources against their dense form (same rows; pitch = {LAYERS} x page, shuffled pages)")
    print(f"{'case':>14} {'layer':>5} {'dense ms':>9} {'paged ms':>9} {'paged/dense':>11} {'bitwise':>7}")
    failures = 0
    for kind, T in CASES:
        q, sinks, window, c4_source, history = make_paged_case(kind, T, gen)
        one_item = (history[0], history[1].one_item_pages())
        for layer, paged in (("CSA", [window, c4_source]), ("HCA", [window, history]), ("HCA/1", [window, one_item])):
            dense = [(kv, idx.dense() if isinstance(idx, PagedRows) else idx) for kv, idx in paged]
            out = tri.sparse_attention(q, paged, sinks, scale)
            same = torch.equal(out, tri.sparse_attention(q, dense, sinks, scale))
            want = reference(q, paged, sinks, scale).float()
            ok = same and bool(((out.float() - want).abs() <= TOL + TOL * want.abs()).all())
            failures += not ok
            reps = 30 if T >= 4096 else 50
            dense_ms = median_ms(lambda: tri.sparse_attention(q, dense, sinks, scale), reps=reps)
            paged_ms = median_ms(lambda: tri.sparse_attention(q, paged, sinks, scale), reps=reps)
            print(f"{kind + ' T=' + str(T):>14} {layer:>5} {dense_ms:9.4f} {paged_ms:9.4f} "
                  f"{paged_ms / dense_ms:11.2f} {'yes' if same else 'NO':>7}{'' if ok else '  MISMATCH'}")
            del dense, out, want
        del q, window, c4_source, history, one_item
        torch.cuda.empty_cache()
    return failures


def deep_case(gen, tokens: int, pos0: int, heads: int = H, dim: int = D):
    """One request's chunk of `tokens` at positions pos0 + t of an HCA layer: q, [(SWA pool,
    window over 128-position pages), (C128 pool, entries e < (p + 1) // 128 over 2-entry pages)],
    sinks, model FLOPs, C128 entries at its end."""
    t = torch.arange(tokens, device=DEVICE)
    pos, req = pos0 + t, torch.zeros_like(t)
    window, n_swa = paged_rows(req, pos - W + 1, pos + 1, SWA_PAGE, W, gen)
    closed = (pos + 1) // HCA_RATIO
    width = int(closed.max())
    history, n_hca = paged_rows(req, torch.zeros_like(closed), closed, HCA_PAGE, width, gen)

    def rows(n):
        return torch.randn(n, dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    q = torch.randn(tokens, heads, dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=gen, device=DEVICE)
    flops = 4 * heads * dim * (W * tokens + float(closed.sum()))
    return q, [(rows(n_swa), window), (rows(n_hca), history)], sinks, flops, width


def deep_hca_table(gen, scale, tokens: int = DEEP_T, scan: list = DEEP_SCAN) -> int:
    """Time an HCA layer's attention for a chunk of `tokens` deep in a prompt over tile shapes
    (the default, the short-list prefill tile, then `scan`); -> failures."""
    q, sources, sinks, flops, width = deep_case(gen, tokens, DEEP_POS)
    want = reference(q, sources, sinks, scale).float()
    print(f"\nHCA layer, chunk of {tokens} at position {DEEP_POS} ({width} C128 entries at its end): "
          f"{flops / 1e12:.2f} TFLOP")
    print(f"{'h_block':>7} {'block_k':>7} {'warps':>5} {'stages':>6} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6}")
    failures = 0
    for hb, bk, nw, ns, splits in [(None,) * 5, (64, 64, 8, 2, None)] + scan:
        knobs = dict(h_block=hb, block_k=bk, num_warps=nw, num_stages=ns, num_splits=splits)
        try:
            out = tri.sparse_attention(q, sources, sinks, scale, **knobs)
            ok = bool(((out.float() - want).abs() <= TOL + TOL * want.abs()).all())
            ms = median_ms(lambda: tri.sparse_attention(q, sources, sinks, scale, **knobs), reps=10)
            tfs = flops / ms / 1e9
            print(f"{str(hb):>7} {str(bk):>7} {str(nw):>5} {str(ns):>6} {ms:9.3f} {tfs:8.1f} "
                  f"{100 * tfs * 1e12 / PEAK_FLOPS:5.1f}%"
                  f"{'' if ok else '  MISMATCH'}")
            failures += not ok
        except Exception as e:     # a tile that does not fit (shared memory) is reported, not fatal
            print(f"{str(hb):>7} {str(bk):>7} {str(nw):>5} {str(ns):>6}  failed: {type(e).__name__}: {str(e)[:80]}")
    return failures


def time_ms(fn, reps: int) -> float:
    """CUDA: median of CUDA events; CPU (--smoke): one call's wall time (meaningless, run only)."""
    if DEVICE == "cuda":
        return median_ms(fn, reps=reps)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def variants_table(gen, scale, tokens: int, pos0: int, heads: int = H, dim: int = D) -> int:
    """--variants: the per-token kernel's default tile (LONG_TILES at 900k) against every
    variant of VARIANTS on the deep chunk, each checked against the reference; -> failures."""
    q, sources, sinks, flops, width = deep_case(gen, tokens, pos0, heads, dim)
    if "--one-item" in sys.argv[1:]:
        sources[1] = (sources[1][0], sources[1][1].one_item_pages())
    want = reference(q, sources, sinks, scale).float()
    print(f"\nHCA layer, chunk of {tokens} at position {pos0} ({width} C128 entries at its end"
          f"{', one-item pages' if '--one-item' in sys.argv[1:] else ''}): "
          f"{flops / 1e12:.3g} TFLOP; variants against the per-token kernel's default tile")
    print(f"{'variant':>8} {'knobs':>52} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} {'speedup':>7} {'max err':>8}")
    failures, base = 0, None
    for name, label, fn in candidates(q, sources, sinks, scale):
        try:
            out = fn().float()
            err = (out - want).abs()
            ok = bool((err <= TOL + TOL * want.abs()).all())
            ms = time_ms(fn, reps=10)
            base = base or ms
            tfs = flops / ms / 1e9
            print(f"{name:>8} {label:>52} {ms:9.3f} {tfs:8.1f} {100 * tfs * 1e12 / PEAK_FLOPS:5.1f}% "
                  f"{base / ms:6.2f}x {err.max().item():8.2e}{'' if ok else '  MISMATCH'}", flush=True)
            failures += not ok
        except Exception as e:     # a tile that does not fit (shared memory) is reported, not fatal
            print(f"{name:>8} {label:>52}  failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
            failures += name in ("per-tok", "default")
    return failures


def candidates(q, sources, sinks, scale) -> list[tuple[str, str, object]]:
    """(name, knobs label, call) of --variants: the per-token kernel at its default tile for these
    inputs (LONG_TILES at 900k), the dispatch's default (`LONG_KERNEL`'s kernel where it is set),
    then VARIANTS."""
    tiles = tri._default_tiles(q, sum(i.width for _, i in sources), [kv for kv, _ in sources])
    per_token = dict(zip(("h_block", "block_k", "num_warps", "num_stages"), tiles))
    rows = [("per-tok", str(tiles).replace(" ", ""),
             lambda: tri.sparse_attention(q, sources, sinks, scale, **per_token)),
            ("default", f"LONG_KERNEL={tri.LONG_KERNEL}", lambda: tri.sparse_attention(q, sources, sinks, scale))]
    for name, knobs in VARIANTS:
        if name == "wgmma" and not wgmma.supports_wgmma(q, sources, sinks):
            continue
        rows.append((name, " ".join(str(v).replace(" ", "") for v in knobs.values()),
                     lambda k=knobs, f=VARIANT_FNS[name]: f(q, sources, sinks, scale, **k)))
    return rows


def reference(*args):
    with backend.forced("reference"):
        return dispatch(*args)


def main() -> int:
    global DEVICE
    if SMOKE:                   # the variants' V4 tiles on a 4-token chunk in Triton's interpreter (checks)
        DEVICE = "cpu"
        failures = variants_table(torch.Generator().manual_seed(0), D ** -0.5, 4, 20000)
        print("OK" if not failures else f"{failures} FAILED")
        return 1 if failures else 0
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    scale = D ** -0.5
    failures = 0
    if "--variants" in sys.argv[1:]:
        failures = variants_table(gen, scale, DEEP_T, DEEP_POS)
        print("OK" if not failures else f"{failures} FAILED")
        return 1 if failures else 0
    if "--deep-hca" in sys.argv[1:]:
        failures = deep_hca_table(gen, scale)
        for tokens in DEEP_SHORT_T if "--deep-short" in sys.argv[1:] else ():
            failures += deep_hca_table(gen, scale, tokens, DEEP_SHORT_SCAN)
        print("OK" if not failures else f"{failures} FAILED")
        return 1 if failures else 0
    print(f"sparse attention, H={H} D={D} W={W} K={K} bf16 on {torch.cuda.get_device_name()}")
    print(f"{'case':>14} {'max err':>8} {'ref ms':>9} {'triton ms':>10} {'speedup':>8} "
          f"{'MB':>8} {'GB/s':>7} {'%HBM':>5} {'TFLOP/s':>8} {'%peak':>6}")
    for kind, T in CASES:
        q, sources, sinks = make_case(kind, T, gen)
        out = tri.sparse_attention(q, sources, sinks, scale)
        want = reference(q, sources, sinks, scale)
        err = (out.float() - want.float()).abs()
        bad = (err > TOL + TOL * want.float().abs()).sum().item()
        if bad or not torch.isfinite(out).all():
            print(f"MISMATCH {kind} T={T}: {bad} elements, max err {err.max().item():.3g}")
            failures += 1
        ref_ms = median_ms(lambda: reference(q, sources, sinks, scale), reps=5 if T >= 4096 else 20)
        tri_ms = median_ms(lambda: tri.sparse_attention(q, sources, sinks, scale), reps=50)
        nbytes = 2 * T * H * D * 2 + T * (W + K) * (D * 2 + 8)
        flops = 4 * T * H * (W + K) * D
        gbs, tfs = nbytes / tri_ms / 1e6, flops / tri_ms / 1e9
        print(f"{kind + ' T=' + str(T):>14} {err.max().item():8.2e} {ref_ms:9.3f} {tri_ms:10.4f} "
              f"{ref_ms / tri_ms:7.1f}x {nbytes / 1e6:8.1f} {gbs:7.0f} {100 * gbs * 1e9 / HBM_BPS:4.0f}% "
              f"{tfs:8.1f} {100 * tfs * 1e12 / PEAK_FLOPS:5.1f}%")
        del q, sources, out, want, err
        torch.cuda.empty_cache()

    failures += paged_table(gen, scale)

    print("\ntile shapes (tuning aid): h_block, block_k, num_warps, num_stages, num_splits (None = auto)")
    for kind, T in TUNE_CASES:
        q, sources, sinks = make_case(kind, T, gen)
        want = reference(q, sources, sinks, scale).float()
        for hb, bk, nw, ns, splits in (PREFILL_SCAN if kind == "prefill" else TILES):
            knobs = dict(h_block=hb, block_k=bk, num_warps=nw, num_stages=ns, num_splits=splits)
            try:
                out = tri.sparse_attention(q, sources, sinks, scale, **knobs)
                ok = bool(((out.float() - want).abs() <= TOL + TOL * want.abs()).all())
                ms = median_ms(lambda: tri.sparse_attention(q, sources, sinks, scale, **knobs), reps=30)
                print(f"{kind + ' T=' + str(T):>14}  {hb:3d} {bk:3d} {nw:2d} {ns:2d} {str(splits):>5}  "
                      f"{ms:9.4f} ms{'' if ok else '  MISMATCH'}")
                failures += not ok
            except Exception as e:     # a tile that does not fit (shared memory) is reported, not fatal
                print(f"{kind + ' T=' + str(T):>14}  {hb:3d} {bk:3d} {nw:2d} {ns:2d} {str(splits):>5}  "
                      f"failed: {type(e).__name__}: {str(e)[:80]}")
        del q, sources, want
        torch.cuda.empty_cache()
    print("OK" if not failures else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
