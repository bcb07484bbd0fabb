"""SASS of the routed experts' decode kernels (dsv4/ops/triton/moe.py) for an H200 (sm_90), no GPU
needed: registers, and the instructions of each loop body by opcode, per weight element a thread
handles (the loop's tile / threads). How docs/benchmarks.md's "SASS instructions of the loop"
figures are made.

    python -m scripts.sass_loops                          # MXFP4, default tiles
    python -m scripts.sass_loops --up 16,512,4 --down 16,512,4 --format bf16
    python -m scripts.sass_loops --twin                   # MXFP4 with the pure-Triton word decode

Integer arguments that are multiples of 16 at V4 sizes (strides, H, I) are marked so, as Triton's
launch specialises them (16-byte vector loads); the GPU's Triton version may differ from this one's.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

DIV16 = {"H", "I", "stride_we", "stride_wi", "stride_si", "stride_se", "stride_sr", "stride_wh", "stride_sh"}


def compile_kernel(fn, types: dict, consts: dict, warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {n: types.get(n, "i32") for n in fn.arg_names if n not in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n in sig and (sig[n].startswith("*") or n in DIV16)}
    src = ASTSource(fn, {**sig, **{c: "constexpr" for c in consts}}, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def registers(cubin: bytes) -> str:
    """Registers a thread from cuobjdump (Triton's bundled one)."""
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)", out)
    return m.group(1) if m else "?"


def loop_bodies(sass: str) -> list[list[str]]:
    """Instructions between a label and a branch back to it: the innermost loops (those holding
    no other loop)."""
    labels, ins = {}, []
    for line in sass.splitlines():
        if m := re.match(r"^\.?(L\w+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"^\s*(?:/\*[0-9a-f]+\*/|[0-9a-f-]+:[-0-9]:[-0-9]:[-Y]:\w+)\s+(.*?);", line):
            ins.append(m.group(1))
    spans = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\()?\.?(L\w+)", text)
        if m and labels.get(m.group(1), i + 1) < i:
            spans.append((labels[m.group(1)], i + 1))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [ins[a:b] for a, b in inner]


def opcode(text: str) -> str:
    words = text.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def main() -> int:
    p = argparse.ArgumentParser(description="SASS loop counts of the decode kernels for sm_90 (see the docstring)")
    p.add_argument("--format", choices=("mxfp4", "bf16"), default="mxfp4")
    p.add_argument("--up", help="up-gate tiles BLOCK_I,BLOCK_H,warps (default: the format's)")
    p.add_argument("--down", help="down tiles BLOCK_H,BLOCK_I,warps (default: the format's)")
    p.add_argument("--twin", action="store_true", help="MXFP4: the pure-Triton word decode instead of the PTX")
    args = p.parse_args()
    import triton.language as tl

    from dsv4.ops.triton import moe
    mx = args.format == "mxfp4"
    types = {n: "*bf16" for n in ("x_ptr", "w1_ptr", "w3_ptr", "sw1_ptr", "sw3_ptr", "h_ptr", "w2_ptr", "sw2_ptr")}
    types.update(ids_ptr="*i64", wt_ptr="*fp32", out_ptr="*fp32", limit="fp32")
    types.update({n: "*fp32" for n in ("s1_ptr", "s3_ptr", "ss1_ptr", "ss3_ptr", "s2_ptr", "ss2_ptr")})
    consts = dict(SHARED=False, FP8=False, MXFP4=mx)
    up = (moe.MXFP4_UP_TILES if mx else (moe.UP_BLOCK_I, moe.UP_BLOCK_H, moe.UP_WARPS))
    down = (moe.MXFP4_DOWN_TILES if mx else (moe.DOWN_BLOCK_H, moe.DOWN_BLOCK_I, moe.DOWN_WARPS))
    up = tuple(map(int, args.up.split(","))) if args.up else up
    down = tuple(map(int, args.down.split(","))) if args.down else down
    if mx:
        types.update({n: "*u8" for n in ("s1_ptr", "s3_ptr", "ss1_ptr", "ss3_ptr", "s2_ptr", "ss2_ptr")})
        types.update({n: "*i32" for n in ("w1_ptr", "w3_ptr", "w2_ptr")}, x_ptr="*fp32", h_ptr="*fp32")
        consts.update(ASM=not args.twin)
    for name, fn, tiles, elems in (
            ("up-gate", moe._up_gate_kernel, dict(BLOCK_I=up[0], BLOCK_H=up[1]), 2 * up[0] * up[1] // (32 * up[2])),
            ("down", moe._down_kernel, dict(BLOCK_H=down[0], BLOCK_I=down[1]), down[0] * down[1] // (32 * down[2]))):
        warps = up[2] if name == "up-gate" else down[2]
        extra = dict(H_DTYPE=tl.bfloat16) if mx and name == "up-gate" else {}
        k = compile_kernel(fn, types, {**consts, **tiles, **extra}, warps)
        print(f"{name} {tiles} warps {warps}: {registers(k.asm['cubin'])} registers, "
              f"{elems} weight elements a thread an iteration")
        for body in loop_bodies(k.asm["sass"]):
            if len(body) < 20:
                continue
            ops = collections.Counter(opcode(t) for t in body)
            print(f"  loop {len(body)} instructions ({len(body) / elems:.2f} an element): "
                  + ", ".join(f"{o} {c}" for o, c in ops.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
