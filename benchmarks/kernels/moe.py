"""Routed experts on the GPU at V4-Flash shapes (E = 256 experts, k = 6 per token, H = 4096,
I = 2048, bf16, SwiGLU limit 10), random routing with distinct experts per token.

    python -m benchmarks.kernels.moe                   # needs CUDA (~30 GiB of GPU memory); ~3 minutes
    python -m benchmarks.kernels.moe --part prefill [--tune]   # prefill only (~1 minute, + ~2 with --tune)
    python -m benchmarks.kernels.moe --part gate       # the router only (seconds); --part shared: the shared expert
    python -m benchmarks.kernels.moe --dry-run         # CPU, Triton interpreter, tiny shapes: gate, shared, prefill

Decode part: the Triton GEMV kernels (dsv4/ops/triton/moe.py) against the torch reference
`routed_experts_loop` (the definition) and the grouped-GEMM path `routed_experts_grouped`
(dsv4/ops/moe.py).
Checks first (exit 1 on a mismatch): the reference rounds gate, up, h, each expert's output and
the sum to bf16, the kernel only h and the sum, so the outputs must agree within a bf16 ulp of
sum_j w_j |w2[e_j]| |h_j| + |out| (2^-7 of it).
Then times the three (CUDA events, median of REPS after warm-up) and prints a table; it also
times the Triton op replayed from a CUDA graph (as in decode: no launch gaps) with the down
projection unsplit (split 1, all k experts per program) and at the default split
(tri.default_down_split). Roofline: bytes that must move = distinct experts touched x 3 x I x H
x 2 B + activations (x, h written and read, out), over the CUDA-graph time, against 4.2 TB/s.
At T = 1 the 6 experts are 302 MB (288 MiB, > the 50 MB L2), ~72 us at full bandwidth.
Then the crossover with the grouped GEMM (for moe.TRITON_MAX_PAIRS), a tile tuning grid for
the up-gate kernel, and a (tiles, SPLIT) grid for the down kernel at T = 1, 2, 4, 8 with the
best per T (whole op from a CUDA graph, the other kernel at its default).

Gate part: the router (dsv4/ops/triton/moe_gate.py, one launch; and its two-launch fallback)
against the torch reference route_topk / route_hash at T = 1 .. 64 (for moe.ROUTE_MAX_TOKENS):
checks the same experts (rows where the reference's k-th and (k+1)-th biased scores are closer
than 1e-4 are only counted) and the weights (rtol 1e-4), and the arrival counters back at 0;
times each from a CUDA graph (eager, wall clock, in the dry run).

Shared part: the MoE experts at decode sizes with the shared expert fused as one more pair of
the GEMV kernels (moe_experts) against the routed kernels + the torch shared expert
(dense_swiglu) + add, from CUDA graphs; checks they agree within 2^-5 of the output's scale
(coarse: the tests bound the difference per element).

Prefill part: the torch grouped path `routed_experts_grouped` (torch._grouped_mm) against the
Triton grouped GEMMs (dsv4/ops/triton/moe_grouped.py) at T = 64 (a batch-64 decode step, the
smallest that takes the grouped path), 512, 4096, 16384, eager as in prefill. Checks both against `routed_experts_loop` within the bound above (exit 1 beyond it)
and that the Triton path captures in a CUDA graph (no host sync); prints ms, TFLOP/s (6 P H I
FLOPs, P = T k pairs), GB/s of the expert weights touched (each must be read once), which is
faster per T, and what moe.GROUPED_GEMM should be. --tune scans the Triton tiles per kernel
(the other at its default) and GROUP_M, printing the best per T.
"""
import argparse
import os
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description="Routed experts: decode GEMV kernels and prefill grouped GEMMs "
                                            "against the torch reference (see the module docstring).")
    p.add_argument("--part", choices=("all", "decode", "prefill", "gate", "shared"), default="all")
    p.add_argument("--tune", action="store_true", help="prefill: scan the Triton tiles and GROUP_M")
    p.add_argument("--dry-run", action="store_true",
                   help="the prefill, gate and shared parts on the CPU in Triton's interpreter at tiny "
                        "shapes (tests the script)")
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported


import torch

from dsv4.bench.timing import median_ms
from dsv4.ops import backend
from dsv4.ops import moe as ref
from dsv4.ops.triton import moe_gate as gate_tri
from dsv4.ops.triton import moe as tri
from dsv4.ops.triton import moe_grouped as grp

E, K, H, I, LIMIT = 256, 6, 4096, 2048, 10.0
TOKENS = (1, 2, 4, 8, 16)
CROSSOVER_TOKENS = (1, 2, 4, 8, 11, 16, 24, 32, 48, 64)
HBM_BPS = 4.2e12
REPS = 30
DEVICE = "cuda"
UP_GRID = [(bi, bh, nw) for bi, bh in ((8, 256), (16, 128), (16, 256), (16, 512), (32, 128), (32, 256))
           for nw in (4, 8)]                                   # (BLOCK_I, BLOCK_H, num_warps)
DOWN_GRID = [(bh, bi, nw) for bh, bi in ((8, 256), (16, 128), (16, 256), (16, 512), (32, 128), (32, 256))
             for nw in (4, 8)]                                 # (BLOCK_H, BLOCK_I, num_warps)
DOWN_SPLITS = (1, 2, 4, 8, 16, 24, 48)                         # down_split, capped at the units
DOWN_TOKENS = (1, 2, 4, 8)
GATE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
SHARED_TOKENS = (1, 2, 4, 8)
PREFILL_TOKENS = (64, 512, 4096, 16384)   # 64: a batch-64 decode step (384 pairs, CUDA graph)
UP_TUNE = [(16, 128, 64, 4, 5), (32, 128, 64, 4, 4), (64, 128, 64, 4, 3), (64, 128, 64, 4, 4),
           (64, 128, 64, 8, 4), (64, 64, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3),
           (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)]   # (BM, BN, BK, warps, stages)
DOWN_TUNE = [(16, 128, 64, 4, 5), (32, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 4, 5),
             (64, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 32, 8, 5),
             (128, 128, 128, 8, 3), (256, 128, 64, 8, 3)]
GROUP_TUNE = (1, 4, 8, 16, 32)


def make_weights(gen):
    """w1/w3 [E, I, H], w2 [E, H, I] bf16; gate std ~6 and up std ~4 for x ~ N(0, 1), so the
    clamp at 10 engages for a few percent of the entries."""
    def randn(*shape, std):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.bfloat16).mul_(std)
    return (randn(E, I, H, std=6 / H ** 0.5), randn(E, H, I, std=1 / I ** 0.5), randn(E, I, H, std=4 / H ** 0.5))


def make_routing(T, gen):
    x = torch.randn(T, H, generator=gen, device=DEVICE).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=gen, device=DEVICE).argsort(dim=1)[:, :K]   # distinct per token
    weights = torch.rand(T, K, generator=gen, device=DEVICE) * 0.5
    return x, weights, ids


def check(T, x, weights, ids, w1, w2, w3, split=None):
    """-> failure message or None. split: down_split (None: the default)."""
    got = tri.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, down_split=split)
    want = ref.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT)
    terms = torch.zeros(T, H, device=DEVICE)
    clamped = 0
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            gate, up = w1[e].float() @ x[t].float(), w3[e].float() @ x[t].float()   # [I]
            clamped += int((gate > LIMIT).sum() + (up.abs() > LIMIT).sum())
            h = ref.swiglu_clamped(gate, up, LIMIT)
            terms[t] += weights[t, j] * (w2[e].float().abs() @ h.abs())
    err = (got.float() - want.float()).abs()
    ratio = (err / (2 ** -7 * (terms + want.float().abs()))).max().item()
    split = split or tri.default_down_split(T, K, H, I)
    print(f"  T={T:<3d} split {split:<3d} max |err| {err.max().item():.3e}  "
          f"max |out| {want.float().abs().max().item():.3g}  err / tolerance {ratio:.3f}  clamped entries {clamped}/{2 * T * K * I}")
    return f"T={T} split {split}: beyond tolerance ({ratio:.2f}x)" if ratio > 1 else None


def graph_ms(fn):
    """Median ms of replaying `fn` captured in a CUDA graph (compiled and warmed up first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def op_bytes(T, ids):
    distinct = ids.unique().numel()
    return distinct * 3 * I * H * 2 + 2 * T * H * 2 + 2 * T * K * I * 2


def decode(w1, w2, w3, gen):
    """The decode-size tables; -> mismatch messages."""
    cases = {T: make_routing(T, gen) for T in sorted(set(TOKENS + CROSSOVER_TOKENS))}

    print("correctness (Triton vs routed_experts_loop):")
    failures = [e for T, split in [(T, None) for T in TOKENS] + [(1, 1), (1, 5), (1, 48), (8, 7)]
                if (e := check(T, *cases[T], w1, w2, w3, split))]

    head = (f"{'T':>4} {'pairs':>5} {'loop ms':>8} {'grouped ms':>10} {'triton ms':>9} {'vs grouped':>10} "
            f"{'graph split1':>12} {'split':>5} {'graph ms':>8} {'MB':>7} {'GB/s':>6} {'%HBM':>5}")
    print("\n" + head + "\n" + "-" * len(head))
    for T in TOKENS:
        x, weights, ids = cases[T]
        args = (x, weights, ids, w1, w2, w3, LIMIT)
        loop_ms = median_ms(lambda: ref.routed_experts_loop(*args), reps=10)
        grouped_ms = median_ms(lambda: ref.routed_experts_grouped(*args))
        tri_ms = median_ms(lambda: tri.routed_experts(*args))
        split1_ms = graph_ms(lambda: tri.routed_experts(*args, down_split=1))
        graph = graph_ms(lambda: tri.routed_experts(*args))
        nbytes = op_bytes(T, ids)
        gbs = nbytes / graph / 1e6
        print(f"{T:4d} {T * K:5d} {loop_ms:8.3f} {grouped_ms:10.3f} {tri_ms:9.4f} {grouped_ms / tri_ms:9.1f}x "
              f"{split1_ms:12.4f} {tri.default_down_split(T, K, H, I):5d} {graph:8.4f} "
              f"{nbytes / 1e6:7.1f} {gbs:6.0f} {100 * gbs * 1e9 / HBM_BPS:5.1f}")

    print(f"\ncrossover (moe.TRITON_MAX_PAIRS = {ref.TRITON_MAX_PAIRS}):")
    crossover = None
    for T in CROSSOVER_TOKENS:
        args = (*cases[T], w1, w2, w3, LIMIT)
        grouped_ms = median_ms(lambda: ref.routed_experts_grouped(*args))
        tri_ms = median_ms(lambda: tri.routed_experts(*args))
        print(f"  T={T:<3d} pairs={T * K:<4d} grouped {grouped_ms:7.3f} ms  triton {tri_ms:7.3f} ms")
        if crossover is None and grouped_ms < tri_ms:
            crossover = T
    print(f"  grouped GEMM faster from T = {crossover} (pairs = {crossover * K})" if crossover
          else f"  Triton faster up to T = {CROSSOVER_TOKENS[-1]} (pairs = {CROSSOVER_TOKENS[-1] * K})")

    print(f"\ntuning up-gate (BLOCK_I, BLOCK_H, warps), whole-op ms "
          f"(default {(tri.UP_BLOCK_I, tri.UP_BLOCK_H, tri.UP_WARPS)}):")
    print(f"  {'tiles':>14} " + " ".join(f"{f'T={T}':>8}" for T in (1, 8)))
    for tiles in UP_GRID:
        ms = [graph_ms(lambda: tri.routed_experts(*cases[T], w1, w2, w3, LIMIT, up_tiles=tiles))
              for T in (1, 8)]
        print(f"  {str(tiles):>14} " + " ".join(f"{m:8.4f}" for m in ms))

    default = (tri.DOWN_BLOCK_H, tri.DOWN_BLOCK_I, tri.DOWN_WARPS)
    print(f"\ntuning down (BLOCK_H, BLOCK_I, warps) x SPLIT, whole-op ms (default {default}, split "
          + ", ".join(f"{tri.default_down_split(T, K, H, I)} at T={T}" for T in DOWN_TOKENS) + "):")
    print(f"  {'tiles':>14} {'split':>5} " + " ".join(f"{f'T={T}':>8}" for T in DOWN_TOKENS))
    best = {T: (float("inf"), None) for T in DOWN_TOKENS}
    for tiles in DOWN_GRID:
        for split in (sp for sp in DOWN_SPLITS if sp <= K * -(-I // tiles[1])):   # <= units
            ms = [graph_ms(lambda: tri.routed_experts(*cases[T], w1, w2, w3, LIMIT,
                                                      down_tiles=tiles, down_split=split))
                  for T in DOWN_TOKENS]
            best = {T: min(best[T], (m, (tiles, split))) for T, m in zip(DOWN_TOKENS, ms)}
            print(f"  {str(tiles):>14} {split:5d} " + " ".join(f"{m:8.4f}" for m in ms))
    for T, (m, (tiles, split)) in best.items():
        print(f"  best at T={T}: tiles {tiles} split {split}: {m:.4f} ms")

    return failures


def timer(fn, reps=REPS):
    """Median ms: CUDA events on the GPU, wall clock for the CPU dry run."""
    if DEVICE == "cuda":
        return median_ms(fn, reps)
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def bound_ratio(got, want, x, weights, ids, w1, w2, w3):
    """max |got - want| / (2^-7 (sum_j w_j |w2[e_j]| |h_j| + |want|)), h in fp32, one expert at a time."""
    terms = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        xe = x[tok].float()
        h = ref.swiglu_clamped(xe @ w1[e].float().T, xe @ w3[e].float().T, LIMIT)
        terms.index_add_(0, tok, weights[tok, j, None] * (h.abs() @ w2[e].float().abs().T))
    err = (got.float() - want.float()).abs()
    return (err / (2 ** -7 * (terms + want.float().abs()) + 1e-30)).max().item()


def step_ms(fn):
    """ms of one call: replayed from a CUDA graph on the GPU, eager wall clock in the dry run."""
    return graph_ms(fn) if DEVICE == "cuda" else timer(fn)


def gate(gen):
    """Router: reference vs the Triton kernel (one and two launches) per T; -> mismatch messages."""
    print(f"\ngate: route_topk / route_hash, E={E} k={K} H={H}, bf16 x and gate weight, fp32 bias "
          f"(moe.ROUTE_MAX_TOKENS = {ref.ROUTE_MAX_TOKENS})")
    gate_w = (torch.randn(E, H, generator=gen, device=DEVICE) / H ** 0.5).to(torch.bfloat16)
    bias = torch.randn(E, generator=gen, device=DEVICE) * 0.1
    tid2eid = torch.rand(1000, E, generator=gen, device=DEVICE).argsort(dim=1)[:, :K]
    failures = []
    print(f"  {'T':>3s} {'mode':5s} {'reference ms':>12s} {'1 launch ms':>11s} {'2 launches ms':>13s}  check")
    for T in GATE_TOKENS:
        x = torch.randn(T, H, generator=gen, device=DEVICE).to(torch.bfloat16)
        tok = torch.randint(0, 1000, (T,), generator=gen, device=DEVICE)
        for mode in ("topk", "hash"):
            args = (x, gate_w, bias, K, 2.5) if mode == "topk" else (x, gate_w, tok, tid2eid, 2.5)
            op = getattr(ref, f"route_{mode}")
            kernel = getattr(gate_tri, f"route_{mode}")

            def reference(op=op, args=args):
                with backend.forced("reference"):
                    return op(*args)
            msg = check_routing(mode, reference(), kernel(*args), x, gate_w, bias)
            if msg:
                failures.append(f"gate T={T} {mode}: {msg}")
            times = [step_ms(reference), step_ms(lambda: kernel(*args)),
                     step_ms(lambda: kernel(*args, one_launch=False))]
            print(f"  {T:3d} {mode:5s} {times[0]:12.4f} {times[1]:11.4f} {times[2]:13.4f}  {msg or 'ok'}")
    if (torch.cat(list(gate_tri._COUNTERS.values())) != 0).any():
        failures.append("gate: arrival counters not left at 0")
    return failures


def check_routing(mode, want, got, x, gate_w, bias):
    """-> None or what differs: the sets of experts (rows without a 1e-4 margin at the k-th
    biased score excepted), the weights per expert (rtol 1e-4)."""
    (want_w, want_ids), (got_w, got_ids) = want, got
    same = (got_ids.sort(1).values == want_ids.sort(1).values).all(1)
    if mode == "topk":
        biased = (ref._gate_scores(x, gate_w) + bias).topk(K + 1, dim=1).values
        same |= (biased[:, K - 1] - biased[:, K]) < 1e-4
    if not same.all():
        return f"{int((~same).sum())} rows chose other experts"
    w_by_id = lambda w, ids: torch.zeros(w.shape[0], E, device=w.device).scatter(1, ids, w)  # noqa: E731
    rel = ((w_by_id(got_w, got_ids) - w_by_id(want_w, want_ids)).abs().max() / want_w.abs().max()).item()
    return f"weights differ by {rel:.2e} (relative)" if rel > 1e-4 else None


def shared(w1, w2, w3, gen):
    """moe_experts with the shared expert fused vs the routed kernels + dense_swiglu + add."""
    print("\nshared expert: fused as pair k of the routed GEMVs vs routed kernels + torch shared expert + add")
    sw1, sw3 = (torch.randn(I, H, generator=gen, device=DEVICE).mul_(s / H ** 0.5).to(torch.bfloat16)
                for s in (6, 4))
    sw2 = (torch.randn(H, I, generator=gen, device=DEVICE) / I ** 0.5).to(torch.bfloat16)
    sw = (sw1, sw2, sw3)
    failures = []
    print(f"  {'T':>3s} {'separate ms':>11s} {'fused ms':>8s}  max |diff| / max |out|")
    for T in SHARED_TOKENS:
        x, weights, ids = make_routing(T, gen)
        fused = lambda: tri.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, shared=sw)  # noqa: E731
        separate = lambda: tri.routed_experts(x, weights, ids, w1, w2, w3, LIMIT) + ref.dense_swiglu(x, *sw, LIMIT)  # noqa: E731
        want = separate().float()
        rel = ((fused().float() - want).abs().max() / want.abs().max()).item()
        if rel > 2 ** -5:   # coarse (roundings of the separate path's bf16 GEMMs and add; the
            # tests bound it per element): catches a missing or misplaced expert
            failures.append(f"shared T={T}: fused differs by {rel:.2e} of max |out|")
        print(f"  {T:3d} {step_ms(separate):11.4f} {step_ms(fused):8.4f}  {rel:.2e}")
    return failures


def prefill(w1, w2, w3, gen):
    """torch grouped vs Triton grouped at PREFILL_TOKENS; -> mismatch messages."""
    print(f"\nprefill: torch._grouped_mm path vs Triton grouped GEMMs (moe.GROUPED_GEMM = {ref.GROUPED_GEMM!r}), "
          f"E={E} k={K} H={H} I={I} bf16")
    paths = {"torch": ref.routed_experts_grouped, "triton": grp.routed_experts_grouped}
    cases = {T: make_routing(T, gen) for T in PREFILL_TOKENS}
    failures, faster = [], {}
    head = (f"{'T':>6} {'pairs':>6} {'torch ms':>9} {'TFLOP/s':>7} {'GB/s':>5} {'triton ms':>9} {'TFLOP/s':>7} "
            f"{'GB/s':>5} {'speed-up':>8} {'err/tol torch':>13} {'triton':>6}  faster")
    print(head + "\n" + "-" * len(head))
    for T, (x, weights, ids) in cases.items():
        args = (x, weights, ids, w1, w2, w3, LIMIT)
        want = ref.routed_experts_loop(*args)
        ms, ratio = {}, {}
        for name, fn in paths.items():
            try:
                ratio[name] = bound_ratio(fn(*args), want, *args[:6])
                ms[name] = timer(lambda: fn(*args))
            except Exception as exc:  # a kernel that fails to compile: report, keep going
                print(f"  T={T} {name}: {type(exc).__name__}: {str(exc)[:400]}")
                ratio[name], ms[name] = float("inf"), float("inf")
            if ratio[name] > 1:
                failures.append(f"prefill T={T} {name}: beyond tolerance ({ratio[name]:.2f}x)")
        flops, nbytes = 6 * T * K * H * I, ids.unique().numel() * 3 * I * H * 2
        faster[T] = min(ms, key=ms.get)
        print(f"{T:6d} {T * K:6d} " + " ".join(f"{ms[n]:9.3f} {flops / ms[n] / 1e9:7.1f} {nbytes / ms[n] / 1e6:5.0f}"
                                                for n in paths)
              + f" {ms['torch'] / ms['triton']:7.2f}x {ratio['torch']:13.3f} {ratio['triton']:6.3f}  {faster[T]}")
    if DEVICE == "cuda":
        T = PREFILL_TOKENS[0]   # the decode batch: replayed from a CUDA graph in the engine
        fn = lambda: grp.routed_experts_grouped(*cases[T], w1, w2, w3, LIMIT)  # noqa: E731
        try:
            print(f"  Triton path replayed from a CUDA graph at T={T} (no host sync): {graph_ms(fn):.3f} ms")
        except Exception as exc:
            failures.append(f"prefill T={T} triton: CUDA graph capture failed: {type(exc).__name__}: {exc}")
        profile_kernels(cases[4096 if 4096 in cases else T], w1, w2, w3, paths)
    votes = list(faster.values())
    best = max(set(votes), key=votes.count)
    print("  faster: " + ", ".join(f"T={T} {n}" for T, n in faster.items())
          + f"; GROUPED_GEMM in dsv4/ops/moe.py should be {best!r} (now {ref.GROUPED_GEMM!r})")
    if ARGS.tune:
        tune_prefill(cases, w1, w2, w3)
    return failures


def profile_kernels(case, w1, w2, w3, paths):
    """GPU time per kernel of each path (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile
    for name, fn in paths.items():
        fn(*case, w1, w2, w3, LIMIT)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*case, w1, w2, w3, LIMIT)
            torch.cuda.synchronize()
        print(f"\n  {name} path kernels at T={case[0].shape[0]}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))


def tune_prefill(cases, w1, w2, w3, scales=None):
    """Whole-op ms of the Triton path per tile config of one kernel (the other at its default);
    scales: FP8 weights' (benchmarks/kernels/moe_fp8.py)."""
    for label, grid, kw in (("up-gate (BM, BN, BK, warps, stages)", UP_TUNE, lambda c: dict(up_tiles=c)),
                            ("down (BM, BN, BK, warps, stages)", DOWN_TUNE, lambda c: dict(down_tiles=c)),
                            ("GROUP_M", GROUP_TUNE, lambda c: dict(group_m=c))):
        print(f"\ntuning {label}, whole-op ms (defaults (up, down): {grp.SMALL_M_TILES}, from {grp.LARGE_M_ROWS} "
              f"rows per expert {grp.LARGE_M_TILES}; GROUP_M {grp.GROUP_M}):")
        print(f"  {'config':>22} " + " ".join(f"{f'T={T}':>8}" for T in cases))
        best = {T: (float("inf"), None) for T in cases}
        for cfg in grid:
            ms = []
            for T, case in cases.items():
                try:
                    ms.append(timer(lambda: grp.routed_experts_grouped(*case, w1, w2, w3, LIMIT, scales=scales,
                                                                       **kw(cfg))))
                except Exception as exc:
                    print(f"  {str(cfg):>22} T={T}: {type(exc).__name__}: {str(exc)[:200]}")
                    ms.append(float("inf"))
            best = {T: min(best[T], (m, cfg)) for T, m in zip(cases, ms)}
            print(f"  {str(cfg):>22} " + " ".join(f"{m:8.3f}" for m in ms))
        for T, (m, cfg) in best.items():
            print(f"  best at T={T}: {cfg}: {m:.3f} ms")


def main():
    global E, K, H, I, DEVICE, PREFILL_TOKENS, GATE_TOKENS, SHARED_TOKENS
    if ARGS.dry_run:
        E, K, H, I, DEVICE, PREFILL_TOKENS = 8, 3, 64, 32, "cpu", (5, 37)
        GATE_TOKENS, SHARED_TOKENS = (1, 5), (1, 3)
    elif not torch.cuda.is_available():
        sys.exit("needs CUDA (or --dry-run)")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu dry run"
    print(f"routed experts, E={E} k={K} H={H} I={I} bf16, limit {LIMIT}; {gpu}")
    w1, w2, w3 = make_weights(gen)
    failures = []
    if ARGS.part in ("all", "decode") and not ARGS.dry_run:
        failures += decode(w1, w2, w3, gen)
    if ARGS.part in ("all", "gate"):
        failures += gate(gen)
    if ARGS.part in ("all", "shared"):
        failures += shared(w1, w2, w3, gen)
    if ARGS.part in ("all", "prefill"):
        failures += prefill(w1, w2, w3, gen)
    for f in failures:
        print(f"MISMATCH {f}")
    print("\nFAIL: a kernel disagrees with the reference" if failures else "\nOK: the kernels agree with the reference")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
