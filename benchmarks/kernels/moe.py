"""Routed experts at decode sizes on the GPU: the Triton GEMV kernels (dsv4/ops/triton/moe.py)
against the torch reference `routed_experts_loop` (the definition) and the grouped-GEMM path
`routed_experts_grouped` (dsv4/ops/moe.py), at V4-Flash shapes (E = 256 experts, k = 6 per
token, H = 4096, I = 2048, bf16, SwiGLU limit 10), random routing with distinct experts per token.

    python benchmarks/kernels/moe.py            # needs CUDA (~25 GiB of GPU memory); ~2 minutes

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
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from dsv4.perf.timing import median_ms  # noqa: E402
from dsv4.ops import moe as ref  # noqa: E402
from dsv4.ops.triton import moe as tri  # noqa: E402

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


def main():
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"routed experts, E={E} k={K} H={H} I={I} bf16, limit {LIMIT}; {torch.cuda.get_device_name()}")
    w1, w2, w3 = make_weights(gen)
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

    for f in failures:
        print(f"MISMATCH {f}")
    print("\nFAIL: Triton disagrees with the reference" if failures else "\nOK: Triton agrees with the reference")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
