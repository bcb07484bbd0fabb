"""The released weights kept quantised, on one H200 (about 3 minutes):

    python -m benchmarks.quant_gemm            # CUDA; prints tables, exit 1 on a failed check
    python -m benchmarks.quant_gemm --smoke    # CPU, tiny sizes, Triton's interpreter: runs every path
    python -m benchmarks.quant_gemm --part experts   # section 2 only (about a minute)

1. FP8 dense GEMMs (dsv4/ops/quant_gemm.py) at V4-Flash's FP8 projections, M = 1, 64, 2048
   rows: bf16 F.linear vs W8A16 vs W8A8 (act_quant + FP8 GEMM, timed together), each checked
   against the torch definition; ms, % of HBM bandwidth (weight + activation bytes / time /
   4.8 TB/s), and speed-up over bf16. Decides FP8_DENSE_GEMM (keep the faster per M).
2. Routed experts at V4-Flash shapes (E 256, k 6, H 4096, I 2048): bf16 vs FP8 vs MXFP4, the
   decode GEMVs (T = 1, 8) and grouped GEMMs (T = 64, 512, 4096), each checked against the
   reference; ms and % of HBM (distinct experts' bytes). Targets: MXFP4 >= 60% of HBM at decode
   sizes and >= bf16's speed at prefill sizes.
3. Building `random:flash:1` (one layer + MTP, released format, kept) on the GPU: seconds and
   peak memory, and the full model's size from its layout on the meta device.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported

import torch  # noqa: E402

from dsv4.bench.timing import graph_ms  # noqa: E402
from dsv4.ops import moe as moe_ops  # noqa: E402
from dsv4.ops.backend import forced  # noqa: E402
from dsv4.ops import quant_gemm as ref  # noqa: E402
from dsv4.ops.quant import dequant_fp8, e8m0_to_float, quant_fp8, quant_fp8_stacked, quant_mxfp4_stacked  # noqa: E402
from dsv4.ops.triton import moe as tri_moe  # noqa: E402
from dsv4.ops.triton import moe_grouped  # noqa: E402
from dsv4.ops.triton import quant_gemm as tq  # noqa: E402

HBM_BPS = 4.8e12
GRAPH_CALLS = 10
# V4-Flash FP8 projections: name, N (out), K (in), groups
FLASH_GEMMS = [("wq_a", 1024, 4096, 1), ("wq_b", 32768, 1024, 1), ("wkv", 512, 4096, 1),
               ("wo_a (8 groups)", 8192, 4096, 8), ("wo_b", 4096, 8192, 1), ("indexer wq_b", 8192, 1024, 1),
               ("e_proj", 4096, 4096, 1)]
SMOKE_GEMMS = [("wq_a", 128, 256, 1), ("wo_a (2 groups)", 256, 256, 2)]
LIMIT = 10.0


def timed_ms(fn, device, reps: int) -> float:
    return graph_ms(fn, device, reps, GRAPH_CALLS)


def close(got, want, tol) -> bool:
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= tol * want.abs().max() + tol * want.abs()).all())


def dense_gemms(device, dtype, Ms, gemms, reps, failures) -> None:
    head = f"{'projection':<16} {'M':>5} {'bf16 ms':>8} {'W8A16 ms':>9} {'%HBM':>5} {'W8A8 ms':>8} {'%HBM':>5} " \
           f"{'W8A16/bf16':>10} {'W8A8/bf16':>9}"
    print("\n1. FP8 dense GEMMs (x [M, K] bf16, W FP8 128x128 blocks)\n" + head + "\n" + "-" * len(head))
    gen = torch.Generator().manual_seed(0)
    totals = {M: [0.0, 0.0, 0.0] for M in Ms}          # bf16, W8A16, W8A8 ms summed over the projections
    for name, N, K, groups in gemms:
        w32 = torch.randn(N, K // groups, generator=gen) / (K // groups) ** 0.5
        q, s = quant_fp8(w32)
        w, s = q.to(device), e8m0_to_float(s).to(device).contiguous()
        dense = dequant_fp8(w, s).to(dtype)
        for M in Ms:
            x = torch.randn(M, K, generator=gen).to(device, dtype)
            with_bf16 = (lambda: ref.grouped_linear(x, dense, groups))
            w8a16 = (lambda: tq.fp8_gemm(x, w, s, groups=groups))
            w8a8_once = _w8a8(x, w, s, groups, dtype)
            tol = 2 ** -6
            with forced("reference"):          # the torch definitions (on CUDA the ops would run the kernels)
                want16, want8 = ref.fp8_linear(x.float(), w, s, groups), ref.fp8_linear_w8a8(x.float(), w, s, groups)
            if not close(w8a16(), want16, tol):
                failures.append(f"W8A16 {name} M={M}")
            if not close(w8a8_once(), want8, tol):
                failures.append(f"W8A8 {name} M={M}")
            ms = [timed_ms(f, device, reps) for f in (with_bf16, w8a16, w8a8_once)]
            totals[M] = [t + m for t, m in zip(totals[M], ms)]
            act = M * K * 2 + M * N * 2
            pct = [100 * (N * (K // groups) * (1 + 4 / 128 ** 2) + act) / (m * 1e-3) / HBM_BPS for m in ms[1:]]
            print(f"{name:<16} {M:5d} {ms[0]:8.4f} {ms[1]:9.4f} {pct[0]:5.1f} {ms[2]:8.4f} {pct[1]:5.1f} "
                  f"{ms[0] / ms[1]:9.2f}x {ms[0] / ms[2]:8.2f}x")
    print("summed over the projections: the faster FP8 GEMM per M (sets FP8_DENSE_GEMM, W8A8_MIN_TOKENS)")
    for M, (b, a16, a8) in totals.items():
        print(f"  M={M:5d}: bf16 {b:.4f} ms, W8A16 {a16:.4f} ms ({b / a16:.2f}x), W8A8 {a8:.4f} ms ({b / a8:.2f}x)"
              f" -> {'W8A16' if a16 <= a8 else 'W8A8'}")


def _w8a8(x, w, s, groups, dtype):
    def run():
        xq, xs = tq.act_quant(x)
        return tq.fp8_gemm(xq, w, s, groups=groups, x_scale=xs, out_dtype=dtype)
    return run


def experts(device, dtype, E, k, H, I, decode_T, grouped_T, reps, failures) -> None:
    gen = torch.Generator(device=device).manual_seed(1)
    w1 = (torch.randn(E, I, H, generator=gen, device=device) * (2 / H ** 0.5)).to(dtype)
    w3 = (torch.randn(E, I, H, generator=gen, device=device) * (1 / H ** 0.5)).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen, device=device) / I ** 0.5).to(dtype)
    formats = {"bf16": ((w1, w2, w3), None, 2.0)}
    for label, quant, nbytes in (("fp8", quant_fp8_stacked, 1 + 4 / 128 ** 2), ("mxfp4", quant_mxfp4_stacked, 0.5 + 1 / 32)):
        q, sc = zip(*(quant(w) for w in (w1, w2, w3)))
        formats[label] = (q, sc, nbytes)
    head = f"{'kernel':<8} {'T':>6} " + " ".join(f"{f + ' ms':>9} {'%HBM':>5}" for f in formats) + \
           f" {'fp8/bf16':>8} {'mxfp4/bf16':>10}"
    print(f"\n2. routed experts (E {E}, k {k}, H {H}, I {I})\n" + head + "\n" + "-" * len(head))
    targets = []
    for kind, Ts in (("decode", decode_T), ("grouped", grouped_T)):
        for T in Ts:
            x = torch.randn(T, H, generator=gen, device=device).to(dtype)
            ids = torch.rand(T, E, generator=gen, device=device).argsort(-1)[:, :k]       # k distinct experts
            wts = torch.rand(T, k, generator=gen, device=device)
            n_experts = ids.unique().numel()
            row, ms_of = [], {}
            for label, (ws, sc, nbytes) in formats.items():
                fn = (lambda: tri_moe.routed_experts(x, wts, ids, *ws, LIMIT, scales=sc)) if kind == "decode" else \
                     (lambda: moe_grouped.routed_experts_grouped(x, wts, ids, *ws, LIMIT, scales=sc))
                got = fn()
                if T <= 64 or SMOKE:     # the reference loop dequantises per expert: checked at small T
                    want = moe_ops.routed_experts_loop(x, wts, ids, *ws, LIMIT, sc)
                    if not close(got, want, 2 ** -5):
                        failures.append(f"{kind} {label} T={T}")
                ms = timed_ms(fn, device, reps)
                moved = n_experts * 3 * I * H * nbytes + T * H * 2 * 2 + T * k * I * 2 * 2
                ms_of[label] = ms
                row.append(f"{ms:9.4f} {100 * moved / (ms * 1e-3) / HBM_BPS:5.1f}")
            print(f"{kind:<8} {T:6d} " + " ".join(row) +
                  f" {ms_of['bf16'] / ms_of['fp8']:7.2f}x {ms_of['bf16'] / ms_of['mxfp4']:9.2f}x")
            pct = float(row[-1].split()[-1])
            if kind == "decode":
                targets.append(f"MXFP4 decode T={T}: {pct * HBM_BPS / 1e11:.0f} GB/s, {pct:.0f}% of HBM "
                               f"(4.8 TB/s; target >= 60%): {'met' if pct >= 60 else 'MISSED'}")
            elif T >= 512:
                ratio = ms_of['bf16'] / ms_of['mxfp4']
                targets.append(f"MXFP4 grouped T={T}: {ratio:.2f}x bf16's speed (target >= 1.0x): "
                               f"{'met' if ratio >= 1 else 'MISSED'}")
    print("targets:\n  " + "\n  ".join(targets))


def random_build(device, spec) -> None:
    from dsv4.model.random_model import build_random_model
    flags = dict(keep_fp8=True, keep_fp8_dense=True, keep_mxfp4=True)
    flags["released"] = True
    full = build_random_model(spec.rsplit(":", 1)[0], "meta", torch.bfloat16, **flags)
    full_gb = sum(t.numel() * t.element_size() for t in list(full.parameters()) + list(full.buffers())) / 1e9
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    m = build_random_model(spec, device, torch.bfloat16, **flags)
    if device == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t
    held = sum(p.numel() * p.element_size() for p in m.parameters()) / 1e9
    peak = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else float("nan")
    layers = len(m.layers)
    print(f"\n3. {spec} (FP8 + MXFP4 kept, MTP included) on {device}: {secs:.1f} s, weights {held:.2f} GB, "
          f"peak {peak:.2f} GB (peak - weights {peak - held:.2f} GB); full model {full_gb:.1f} GB "
          f"({len(full.layers)} layers + MTP); {layers} layer(s) took {secs:.1f} s -> full build ~"
          f"{secs * (len(full.layers) + 1) / (layers + 1):.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, Triton's interpreter")
    parser.add_argument("--part", choices=("all", "dense", "experts", "build"), default="all",
                        help="run one section: 1 dense, 2 experts, 3 build (default all)")
    args = parser.parse_args()
    failures: list[str] = []
    run = lambda part: args.part in ("all", part)  # noqa: E731
    if args.smoke:
        if run("dense"):
            dense_gemms("cpu", torch.float32, (1, 20), SMOKE_GEMMS, 1, failures)
        if run("experts"):
            experts("cpu", torch.float32, 8, 2, 128, 128, (1,), (20,), 1, failures)
        if run("build"):
            random_build("cpu", "random:tiny:2")
    else:
        assert torch.cuda.is_available(), "needs CUDA (or --smoke)"
        if run("dense"):
            dense_gemms("cuda", torch.bfloat16, (1, 64, 2048), FLASH_GEMMS, 20, failures)
        if run("experts"):
            experts("cuda", torch.bfloat16, 256, 6, 4096, 2048, (1, 8), (64, 512, 4096), 10, failures)
        if run("build"):
            random_build("cuda", "random:flash:1")
    print("\nFAILURES:\n  " + "\n  ".join(failures) if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
