"""Closing compressor groups on the GPU: the Triton kernels (dsv4/ops/triton/compress.py: pool,
then the fused norm + RoPE + scatter) against the reference composition of dsv4/ops/compress.py
(cat(ring, fresh) -> compress_pool -> rms_norm -> RoPE -> pool[entry_slot]) at V4-Flash shapes,
bf16 sources and pool.

    python -m benchmarks.kernels.compress           # needs CUDA; well under a minute

Geometries: CSA (m = 4, D = 512, C = 1024, overlap), the CSA indexer (m = 4, D = 128, C = 256,
overlap), HCA (m = 128, D = 512); RoPE on the last 64 channels (R = 32, theta 160000).
Cases: decode, G groups of G requests, each group's rows in its request's ring but the last
(the step's fresh token), positions up to 2^20; prefill, one request's chunk of T fresh tokens
at positions 0..T-1, G = T / m groups (CSA's first group has no previous half: -1).

Checks first (exit 1 on a mismatch): bf16 within 2e-2 (abs + rel; both round the products
and the sums to bf16, in different orders); for decode G = 8 also the fp32 path within 1e-5. Then times both
(CUDA events, median; the kernel also at other tile sizes) and prints a table. Bytes
(nominal, each group's reads counted once): kv + gate G*span*D*2*2 + rows G*span*8 + entry
written G*D*2 + ape m*C*4, against 4.2 TB/s.
"""
import sys


import torch

from dsv4.ops.backend import forced
from dsv4.ops.compress import compress_pool
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import apply_rope, rope_cos_sin
from dsv4.ops.triton import compress as tri
from dsv4.bench.timing import median_ms

HBM_BPS = 4.2e12
R, THETA, EPS = 32, 160000.0, 1e-6
GEOMETRIES = [("csa", True, 4, 512), ("indexer", True, 4, 128), ("hca", False, 128, 512)]
CASES = [("decode", 1), ("decode", 8), ("decode", 64), ("prefill", 4096), ("prefill", 16384)]
TILES = (512, 1024, 2048, 4096)     # tile sizes timed for the kernel (tuning aid; default tri.TILE)
DEVICE = "cuda"


def make_case(overlap, m, D, kind, n, dtype, gen):
    """-> close_groups arguments for `kind` with n = G (decode) or T (prefill)."""
    C, span = (2 * D, 2 * m) if overlap else (D, m)
    arange = lambda k: torch.arange(k, device=DEVICE)  # noqa: E731
    if kind == "decode":        # request g: ring rows [g*ring, (g+1)*ring); fresh token g closes its group
        G, T, ring = n, n, span + 2
        ring_rows = G * ring
        rows = torch.cat([arange(G)[:, None] * ring + arange(span - 1)[None, :],
                          ring_rows + arange(G)[:, None]], dim=1)
        entry_pos = torch.randint(0, 2 ** 20 // m, (G,), generator=gen, device=DEVICE) * m
    else:                       # group e pools fresh tokens [e*m, (e+1)*m) (and the group before, CSA)
        G, T, ring_rows = n // m, n, span + 2
        first = arange(G)[:, None] * m + arange(span)[None, :] - (m if overlap else 0)
        rows = torch.where(first >= 0, ring_rows + first, -1)
        entry_pos = arange(G) * m
    src = lambda k: torch.randn(k, C, generator=gen, device=DEVICE).to(dtype)  # noqa: E731
    ape = 0.5 * torch.randn(m, C, generator=gen, device=DEVICE)
    norm_w = 1 + 0.1 * torch.randn(D, generator=gen, device=DEVICE)
    inv_freq = 1.0 / THETA ** (torch.arange(R, device=DEVICE, dtype=torch.float32) / R)
    pool = torch.zeros(2 * G + 1, D, device=DEVICE, dtype=dtype)
    entry_slot = torch.randperm(pool.shape[0], generator=gen, device=DEVICE)[:G]
    cos, sin = rope_cos_sin(entry_pos, inv_freq)
    return (src(ring_rows), src(ring_rows), src(T), src(T), rows, ring_rows, ape, overlap, norm_w, EPS,
            cos, sin, pool, entry_slot)


def reference(ring_kv, ring_gate, kv, gate, rows, ring_rows, ape, overlap, norm_w, eps, cos, sin,
              pool, entry_slot):
    """The composition in dsv4/ops/compress.py (torch ops only), writing into `pool`."""
    with forced("reference"):
        pooled = compress_pool(torch.cat([ring_kv, kv.to(ring_kv.dtype)]),
                               torch.cat([ring_gate, gate.to(ring_gate.dtype)]), rows, ape, overlap)
        pool[entry_slot] = apply_rope(rms_norm(pooled, norm_w, eps), cos, sin).to(pool.dtype)


def check(args, tol):
    """-> error message or None: the kernel's pool against the reference's."""
    args = list(args)
    want = args[12].clone()
    reference(*args[:12], want, args[13])
    tri.close_groups(*args)
    got, want = args[12].float(), want.float()
    err = ((got - want).abs() - tol * want.abs()).max().item()
    return None if err <= tol else f"off by {err:.3g} beyond {tol} (abs + rel)"


def run_case(name, overlap, m, D, kind, n, gen):
    """Check and time one case, print its row; -> True on a mismatch."""
    args = make_case(overlap, m, D, kind, n, torch.bfloat16, gen)
    errors = [e for e in [check(args, 2e-2)] if e]
    if kind == "decode" and n == 8:
        e = check(make_case(overlap, m, D, kind, n, torch.float32, gen), 1e-5)
        errors += [f"fp32: {e}"] if e else []
    G, span = args[4].shape
    reps = 20 if kind == "prefill" else 100
    ref_ms = median_ms(lambda: reference(*args), reps)
    tiles = {t: median_ms(lambda: tri.close_groups(*args, tile=t), reps) for t in TILES}
    tri_ms = tiles[tri.TILE]
    nbytes = G * span * D * 2 * 2 + G * span * 8 + G * D * 2 + args[6].numel() * 4
    gbs = nbytes / tri_ms / 1e6
    for e in errors:
        print(f"  MISMATCH {name} {kind} n={n}: {e}")
    print(f"{name:8} {kind:8} {n:6d} {G:5d} {span:4d} {D:4d} {ref_ms:8.3f} {tri_ms:9.4f} {ref_ms / tri_ms:6.1f} "
          f"{nbytes / 1e6:8.2f} {gbs:7.0f} {100 * gbs * 1e9 / HBM_BPS:5.1f}  "
          + " ".join(f"{tiles[t]:8.4f}" for t in TILES))
    return bool(errors)


def main():
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"compressor group close (pool + norm + RoPE + write), bf16; {torch.cuda.get_device_name()}")
    head = (f"{'geometry':8} {'case':8} {'G|T':>6} {'G':>5} {'span':>4} {'D':>4} {'ref ms':>8} {'triton ms':>9} "
            f"{'x':>6} {'MB':>8} {'GB/s':>7} {'%HBM':>5}  " + " ".join(f"{'t' + str(t) + ' ms':>8}" for t in TILES))
    print(head)
    print("-" * len(head))
    failed = False
    for name, overlap, m, D in GEOMETRIES:
        for kind, n in CASES:
            failed |= run_case(name, overlap, m, D, kind, n, gen)
    print("FAIL: Triton disagrees with the reference" if failed else "OK: Triton agrees with the reference")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
