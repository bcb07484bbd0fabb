"""MXFP4 routed experts kept quantised (W4A16, `--keep-mxfp4`) on the GPU at V4-Flash shapes
(E = 256, k = 6, H = 4096, I = 2048, bf16 activations, SwiGLU limit 10).

    python -m benchmarks.kernels.moe_mxfp4          # needs CUDA (~30 GiB of GPU memory); ~1 minute
    python -m benchmarks.kernels.moe_mxfp4 --tune   # + a scan of the decode tiles (MXFP4_*_TILES; ~1 more minute)
    python -m benchmarks.kernels.moe_mxfp4 --tune grouped   # + the grouped GEMM tiles at T = 512, 4096

The experts of benchmarks/kernels/moe.py are quantised to MXFP4 (packed e2m1 pairs + an E8M0
byte per 32 inputs); `dq` are the dequantised bf16 weights (what the load without keep_mxfp4
stores); the shared expert stays bf16 (as loading the released format gives). The checks,
decode and grouped timings are moe_fp8.py's (its "fp8" columns read as MXFP4 here): the
kernels on MXFP4 within moe.py's tolerance of the reference (the check fails above it; "bit-equal"
to the kernels on dq is printed only: the decode GEMVs add in another order than the bf16 ones);
times bf16 vs MXFP4 from CUDA graphs, decode in GB/s and % of HBM, and the MXFP4 decode again
with its word decode compiled from the pure-Triton twin instead of the inline PTX (what the
decode's integer ops cost). Exit 1 on a failed check.
"""
import argparse
import sys


import torch

from benchmarks.kernels import moe as bench  # shapes, weights, routing, timing
from benchmarks.kernels import moe_fp8  # checks and timings, format-agnostic
from dsv4.ops.quant import FP4_BLOCK, dequant_kept, quant_mxfp4_stacked
from dsv4.ops.triton import moe as tri

I, H, LIMIT = bench.I, bench.H, moe_fp8.LIMIT
MXFP4_BYTES = 0.5 + 1 / FP4_BLOCK          # per weight: a nibble + its share of the E8M0 byte
# decode tiles scanned by --tune: (rows, packed-dim columns, num_warps); columns multiples of 64. The
# defaults (moe.MXFP4_UP_TILES / MXFP4_DOWN_TILES) hold 64 inputs of a tile a thread; the larger tiles
# here 128 (more bytes in flight a program, ~128 registers with 4 warps: fewer programs an SM)
UP_GRID = [(16, 256, 4), (16, 512, 4), (16, 512, 8), (16, 1024, 8), (32, 256, 4), (32, 512, 8), (32, 1024, 8),
           (64, 256, 8)]
DOWN_GRID = UP_GRID


def quantised(ws):
    """bf16 stacks -> (MXFP4 stacks, E8M0 bytes, dq: the dequantised bf16 stacks)."""
    q, s = zip(*(quant_mxfp4_stacked(w) for w in ws))
    return q, s, tuple(dequant_kept(w, sc).to(torch.bfloat16) for w, sc in zip(q, s))


def decode_ptx_vs_twin(q, s, gen) -> None:
    """Decode ms at T = 1 and 8 with the word decode in inline PTX (the default on the GPU) and
    with its pure-Triton twin compiled instead (the interpreter's code: about 1.7x the integer
    ops an element): how much the decode's integer ops cost."""
    print("\nMXFP4 decode, word decode in PTX vs its pure-Triton twin (default tiles):")
    for T in (1, 8):
        x, weights, ids = bench.make_routing(T, gen)
        ms = {}
        for label, twin in (("ptx", False), ("twin", True)):
            tri.INTERPRETING = twin                      # routed_experts passes ASM = not INTERPRETING
            try:
                ms[label] = bench.graph_ms(lambda: tri.routed_experts(x, weights, ids, *q, LIMIT, scales=s))
            finally:
                tri.INTERPRETING = False
        print(f"  T={T}: ptx {ms['ptx']:.4f} ms, twin {ms['twin']:.4f} ms ({ms['twin'] / ms['ptx']:.2f}x)")


def main() -> int:
    p = argparse.ArgumentParser(description="MXFP4 routed experts (W4A16) vs bf16 on the GPU (see the docstring)")
    p.add_argument("--tune", nargs="?", const="decode", choices=("decode", "grouped", "all"),
                   help="scan the decode (default) and/or grouped tiles on MXFP4 weights")
    args = p.parse_args()
    gen, (q, s, dq), sw = moe_fp8.setup(quantised)
    failures = moe_fp8.checks(q, s, dq, sw, None, sw, gen)       # the shared expert unquantised
    moe_fp8.decode_times(q, s, dq, gen, "mxfp4", MXFP4_BYTES)
    decode_ptx_vs_twin(q, s, gen)
    moe_fp8.grouped_times(q, s, dq, gen, "mxfp4")
    if args.tune in ("decode", "all"):
        moe_fp8.tune_decode(q, s, gen, "MXFP4", UP_GRID, DOWN_GRID)
    if args.tune in ("grouped", "all"):
        bench.tune_prefill({T: bench.make_routing(T, gen) for T in (512, 4096)}, *q, scales=s)
    print("\nFAILURES:\n  " + "\n  ".join(failures) if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
