"""FP8 routed experts kept quantised (W8A16, `--keep-fp8`) on the GPU at V4-Flash shapes
(E = 256, k = 6, H = 4096, I = 2048, bf16 activations, SwiGLU limit 10).

    python -m benchmarks.kernels.moe_fp8            # needs CUDA (~35 GiB of GPU memory); ~1 minute
    python -m benchmarks.kernels.moe_fp8 --tune [decode|grouped]   # + tile scans on FP8 weights (~3 more)

The experts of benchmarks/kernels/moe.py are quantised to float8_e4m3fn with power-of-two
(E8M0) 128x128 block scales; `dq` are the dequantised bf16 weights (what the load without
keep_fp8 stores). Checks first (exit 1 on a mismatch):
  * whether decode GEMVs and grouped GEMMs on FP8 equal the same kernels on dq bit for bit
    (printed only: the values are the same, as the scales are powers of two, but the compiler
    may lay out an FP8 tile unlike a bf16 one and so sum in another order);
  * FP8 within moe.py's tolerance of the reference `routed_experts_loop` on FP8 (which
    dequantises the experts it uses); with the shared expert fused as pair k, within moe.py's
    coarse shared-part bound of the reference + `dense_swiglu`.
Then times, bf16 (dq) vs FP8, from CUDA graphs: the decode op at T = 1..8 (GB/s of the bytes
that must move: distinct experts x 3 I H x (1 B + scales), and % of 4.2 TB/s), and the grouped
GEMMs at T = 64 (a batch-64 decode step) .. 16384 (TFLOP/s).
"""
import argparse
import sys


import torch

from benchmarks.kernels import moe as bench  # shapes, weights, routing, timing
from dsv4.ops.quant import dequant_kept, quant_fp8_stacked
from dsv4.ops import moe as ref
from dsv4.ops.triton import moe as tri
from dsv4.ops.triton import moe_grouped as grp

E, K, H, I, LIMIT = bench.E, bench.K, bench.H, bench.I, bench.LIMIT
DECODE_TOKENS = (1, 2, 4, 8)
GROUPED_TOKENS = (64, 512, 4096, 16384)
FP8_BYTES = 1 + 4 / (128 * 128)


def quantised(ws):
    """bf16 stacks -> (FP8 stacks, fp32 scales, dq: the dequantised bf16 stacks)."""
    q, s = zip(*(quant_fp8_stacked(w) for w in ws))
    return q, s, tuple(dequant_kept(w, sc).to(torch.bfloat16) for w, sc in zip(q, s))


def checks(q, s, dq, sq, ss, sdq, gen) -> list[str]:
    """Bit equality FP8 vs dq per kernel path, and the reference tolerance; -> failures."""
    failures = []
    print("checks: FP8 kernels == bf16 kernels on the dequantised weights; vs the reference (err/tol <= 1)")
    for T in DECODE_TOKENS + GROUPED_TOKENS[:3]:
        x, weights, ids = bench.make_routing(T, gen)
        for shared in ((False, True) if T * K <= ref.TRITON_MAX_PAIRS else (False,)):
            kw8 = dict(shared=sq, shared_scales=ss) if shared else {}
            kw16 = dict(shared=sdq) if shared else {}
            op = tri.routed_experts if T * K <= ref.TRITON_MAX_PAIRS else grp.routed_experts_grouped
            got = op(x, weights, ids, *q, LIMIT, scales=s, **kw8)
            same = torch.equal(got, op(x, weights, ids, *dq, LIMIT, **kw16))
            want = ref.routed_experts_loop(x, weights, ids, *q, LIMIT, scales=s)
            if shared:   # coarse, as moe.py's shared part: max |diff| within 2^-5 of max |out|
                want = want + ref.dense_swiglu(x, *sq, LIMIT, scales=ss)
                ratio = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() / 2 ** -5
            else:
                ratio = bench.bound_ratio(got, want, x, weights, ids, *dq)
            print(f"  T={T:<5d} {op.__module__.split('.')[-1]:11s} shared {shared!s:5s} bit-equal {same!s:5s} "
                  f"err/tol {ratio:.3f}")
            if ratio > 1:
                failures.append(f"T={T} shared={shared}: err/tol {ratio:.2f}")
    return failures


def decode_times(q, s, dq, gen, label="fp8", weight_bytes=FP8_BYTES) -> None:
    """bf16 (dq) vs the quantised weights q (`label`, weight_bytes per weight with its scales)."""
    head = f"{'T':>3} {'bf16 ms':>8} {'GB/s':>6} {'%HBM':>5} {label + ' ms':>8} {'GB/s':>6} {'%HBM':>5} {'speed-up':>8}"
    print("\ndecode GEMVs from CUDA graphs (default tiles):\n" + head + "\n" + "-" * len(head))
    for T in DECODE_TOKENS:
        x, weights, ids = bench.make_routing(T, gen)
        ms16 = bench.graph_ms(lambda: tri.routed_experts(x, weights, ids, *dq, LIMIT))
        ms8 = bench.graph_ms(lambda: tri.routed_experts(x, weights, ids, *q, LIMIT, scales=s))
        experts = ids.unique().numel() * 3 * I * H
        act = bench.op_bytes(T, ids) - experts * 2
        cols = []
        for ms, wb in ((ms16, 2), (ms8, weight_bytes)):
            gbs = (experts * wb + act) / ms / 1e6
            cols.append(f"{ms:8.4f} {gbs:6.0f} {100 * gbs * 1e9 / bench.HBM_BPS:5.1f}")
        print(f"{T:3d} {' '.join(cols)} {ms16 / ms8:7.2f}x")


def tune_decode(q, s, gen, fmt="FP8", up_grid=bench.UP_GRID, down_grid=bench.DOWN_GRID) -> None:
    """Whole-op ms on quantised weights (format fmt) per up-gate tiles, then per down tiles x
    split (T = 1, 8)."""
    cases = {T: bench.make_routing(T, gen) for T in (1, 8)}
    run = lambda T, **kw: bench.graph_ms(lambda: tri.routed_experts(*cases[T], *q, LIMIT, scales=s, **kw))  # noqa: E731
    scans = (("up-gate (BLOCK_I, BLOCK_H, warps)", [dict(up_tiles=t) for t in up_grid]),
             ("down (BLOCK_H, BLOCK_I, warps) x split",
              [dict(down_tiles=t, down_split=sp) for t in down_grid for sp in (1, 2, 4, 8)]))
    for label, configs in scans:
        print(f"\n{fmt} tuning {label}, bf16 defaults up {(tri.UP_BLOCK_I, tri.UP_BLOCK_H, tri.UP_WARPS)} "
              f"down {(tri.DOWN_BLOCK_H, tri.DOWN_BLOCK_I, tri.DOWN_WARPS)}:")
        best = {T: (float("inf"), None) for T in cases}
        for kw in configs:
            ms = {T: run(T, **kw) for T in cases}
            best = {T: min(best[T], (ms[T], str(kw))) for T in cases}
            print(f"  {str(kw):>44} " + " ".join(f"T={T} {m:8.4f}" for T, m in ms.items()))
        for T, (m, kw) in best.items():
            print(f"  best at T={T}: {kw} {m:.4f} ms")


def grouped_times(q, s, dq, gen, label="fp8") -> None:
    head = f"{'T':>6} {'bf16 ms':>8} {'TFLOP/s':>7} {label + ' ms':>8} {'TFLOP/s':>7} {'speed-up':>8}"
    print("\ngrouped GEMMs (eager; T=64 also from a CUDA graph):\n" + head + "\n" + "-" * len(head))
    for T in GROUPED_TOKENS:
        x, weights, ids = bench.make_routing(T, gen)
        timer = bench.graph_ms if T == GROUPED_TOKENS[0] else bench.timer
        ms16 = timer(lambda: grp.routed_experts_grouped(x, weights, ids, *dq, LIMIT))
        ms8 = timer(lambda: grp.routed_experts_grouped(x, weights, ids, *q, LIMIT, scales=s))
        flops = 6 * T * K * H * I
        print(f"{T:6d} {ms16:8.3f} {flops / ms16 / 1e9:7.1f} {ms8:8.3f} {flops / ms8 / 1e9:7.1f} {ms16 / ms8:7.2f}x")


def setup(quantise):
    """-> (CUDA generator, quantise(experts) = (q, s, dq), the bf16 shared expert (w1, w2, w3))
    at moe.py's shapes and scales; exits without CUDA."""
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = quantise(bench.make_weights(gen))
    torch.cuda.empty_cache()
    sw = tuple(torch.randn(*shape, generator=gen, device="cuda").mul_(std).to(torch.bfloat16)
               for shape, std in (((I, H), 6 / H ** 0.5), ((H, I), 1 / I ** 0.5), ((I, H), 4 / H ** 0.5)))
    return gen, experts, sw


def main() -> int:
    p = argparse.ArgumentParser(description="FP8 routed experts (W8A16) vs bf16 on the GPU (see the docstring)")
    p.add_argument("--tune", nargs="?", const="all", choices=("all", "decode", "grouped"),
                   help="scan the decode and/or grouped tiles on FP8 weights")
    args = p.parse_args()
    gen, (q, s, dq), sw = setup(quantised)
    sq, ss, sdq = quantised(sw)
    failures = checks(q, s, dq, sq, ss, sdq, gen)
    decode_times(q, s, dq, gen)
    grouped_times(q, s, dq, gen)
    if args.tune in ("all", "decode"):
        tune_decode(q, s, gen)
    if args.tune in ("all", "grouped"):
        bench.tune_prefill({T: bench.make_routing(T, gen) for T in (64, 4096, 16384)}, *q, scales=s)
    print("\nFAILURES:\n  " + "\n  ".join(failures) if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
