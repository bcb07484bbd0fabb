"""Registers, spills and shared memory of the long-list attention variants for an H200 (sm_90),
without a GPU: each kernel of benchmarks/kernels/attention.py's VARIANTS (and the per-token
kernel's LONG_TILES) compiled ahead of time at V4 shapes (bf16, D = 512, H = 64, the window over
128-position pages, the history over 2-entry pages), read back with Triton's cuobjdump.

    python -m benchmarks.kernels.attention_sm90       # ~2 minutes of compiles on this host

Run it with the GPU's Triton version (see scripts/triton_compile_check.py) for its figures.
Integer arguments that are multiples of 16 at V4 sizes are marked so, as Triton's launch
specialises them. "stack" is the bytes a thread spills.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

D, PAGES = 512, dict(PER_PAGE0=128, PER_PAGE1=2)
DIV16 = {"H", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kv", "stride_kv0", "stride_kv1"}
FP32 = {"sink_ptr", "m_ptr", "l_ptr", "m0_ptr", "l0_ptr", "m1_ptr", "l1_ptr"}
INDEX = ("pages", "req", "lo", "hi", "idx")


def compile_sm90(fn, consts: dict, warps: int, stages: int):
    """triton.compile of fn for sm_90: pointers bf16 (fp32: FP32, int64: page tables and
    ranges), other integers i32 (multiples of 16 where DIV16 says) -> the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in FP32 else "*i64" if name.startswith(INDEX) else "*bf16"
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or n in DIV16}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def figures(kernel) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    regs, stack = m.groups() if m else ("?", "?")
    return (f"{regs:>4} regs {stack:>4} B stack {kernel.metadata.shared // 1024:4d} KB shared "
            f"{lowering(kernel.asm['ttgir'])}")


def lowering(ttgir: str) -> str:
    """How the dots and key loads lower: "wgmma yes" where a dot became Hopper's warp-group MMA
    (`ttng.warp_group_dot`), "no" where it stayed mma v2; "cp.async yes" where a global load
    goes to shared memory asynchronously (`ttg.async_copy_global_to_local`)."""
    wgmma = "yes" if "ttng.warp_group_dot" in ttgir else "no"
    cp_async = "yes" if "ttg.async_copy_global_to_local" in ttgir else "no"
    return f"wgmma {wgmma:>3} cp.async {cp_async:>3}"


def launches(name: str, knobs: dict) -> list[tuple[str, object, dict, int, int]]:
    """(label, kernel, constexprs, warps, stages) of one variant's kernels."""
    from dsv4.ops.triton import attention as tri
    from dsv4.ops.triton import attention_shared as shared
    if name == "per-tok":
        hb, bk, nw, ns = tri.LONG_TILES
        return [("per-token", tri._sparse_attn_kernel, dict(
            D=D, H_BLOCK=hb, BLOCK_K=bk, BLOCK_D=D, SPLIT=False, FP32_DOT=False, PAGED0=True, PAGED1=True,
            PACKED0=False, PACKED1=False, NOPE=D, ROPE=0, NOPE_P=D, ROPE_P=16, **PAGES), nw, ns)]
    if name == "shared":
        k = knobs
        dv = D // k["d_parts"]
        return [("shared", shared._shared_attn_kernel, dict(
            D=D, DV=dv, BLOCK_DV=dv, BLOCK_T=k["block_t"], H_BLOCK=k["h_block"], BLOCK_K=k["block_k"],
            D_PARTS=k["d_parts"], TWO=True, FP32_DOT=False, Q_REGS=k["q_regs"], LAZY=k["lazy"], **PAGES),
                 k["num_warps"], k["num_stages"])]
    raise ValueError(f"unknown variant {name}")


def main() -> int:
    from benchmarks.kernels.attention import VARIANTS
    failures = 0
    for name, knobs in [("per-tok", None)] + VARIANTS:
        tag = "LONG_TILES" if knobs is None else " ".join(str(v).replace(" ", "") for v in knobs.values())
        for label, fn, consts, warps, stages in launches(name, knobs):
            try:
                print(f"{name:>8} {tag:>52} {label:>9}: {figures(compile_sm90(fn, consts, warps, stages))}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                failures += 1
                print(f"{name:>8} {tag:>52} {label:>9}: FAIL {type(e).__name__}: {str(e)[-200:]}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
