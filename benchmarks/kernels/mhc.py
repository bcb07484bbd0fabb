"""mHC on the GPU: the Triton kernels (dsv4/ops/triton/mhc.py) against the torch reference
(dsv4/ops/mhc.py) at V4-Flash shapes (N = hc_mult = 4, D = 4096, 20 Sinkhorn iterations, bf16
streams, fp32 mixing weights).

    python -m benchmarks.kernels.mhc            # needs CUDA; well under a minute

Checks first (exit 1 on a mismatch): post and comb within 1e-5 (fp32, values O(1)); the bf16
collapse of hc_pre / hc_head within one bf16 ulp (both sides round fp32 values that agree to
~1e-7) + 1e-5 sum_j |h_j| (for sums that cancel); hc_post within the reference's own
roundings (it rounds post*out, the matmul and their sum to bf16 separately, the kernel once):
2^-8 (|post*out| + |comb^T h|) + 2^-7 |new|.
Then times both (CUDA events, median of REPS after warm-up) and prints a table. Roofline:
bytes the op must move (pre: h + fn + collapsed/post/comb written; post: h + out + post/comb
+ new streams written; head: h + fn + collapsed) over the kernel time, against 4.2 TB/s.
The hc_pre kernels read h twice (projection, then collapse); at T <= 64 the second read hits
L2. A second table times the projection kernel alone for a few tile shapes (tuning aid).
"""
import sys


import torch

from dsv4.bench.timing import median_ms
from dsv4.ops import backend
from dsv4.ops import mhc as ref
from dsv4.ops.triton import mhc as tri

N, D, ITERS, NORM_EPS, HC_EPS = 4, 4096, 20, 1e-6, 1e-6
TOKENS = (1, 8, 64, 512, 4096)
HBM_BPS = 4.2e12
REPS = 50
DEVICE = "cuda"
PROJ_TILES = ((64, 64), (32, 64), (128, 64), (64, 32), (64, 128))  # (BT, BK); first = default


def reference(fn, *args):
    with backend.forced("reference"):
        return fn(*args)


def make_case(T, gen):
    h = torch.randn(T, N, D, generator=gen, device=DEVICE).to(torch.bfloat16)
    fn = torch.randn((2 + N) * N, N * D, generator=gen, device=DEVICE) * (N * D) ** -0.5
    base = torch.randn((2 + N) * N, generator=gen, device=DEVICE)
    scale = 0.5 + torch.rand(3, generator=gen, device=DEVICE)
    out = torch.randn(T, D, generator=gen, device=DEVICE).to(torch.bfloat16)
    return h, fn, base, scale, out


def excess(got, want, tol):
    """max(|got - want| - tol) over the elements: > 0 means a mismatch."""
    return ((got.float() - want.float()).abs() - tol).max().item()


def check(T, h, fn, base, scale, out):
    """-> list of failure messages (empty = agrees with the reference)."""
    errors = []
    pre_args = (h, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    x, post, comb = tri.hc_pre(*pre_args)
    want_x, want_post, want_comb = reference(ref.hc_pre, *pre_args)
    for name, got, want in (("post", post, want_post), ("comb", comb, want_comb)):
        err = (got - want).abs().max().item()
        if err > 1e-5:
            errors.append(f"hc_pre {name} off by {err:.3g}")
    # one bf16 ulp, plus 1e-5 of the collapsed terms (pre <= 1 + eps) where the sum cancels
    abs_terms = h.float().abs().sum(dim=1)
    if (err := excess(x, want_x, 2 ** -7 * want_x.float().abs() + 1e-5 * abs_terms)) > 0:
        errors.append(f"hc_pre collapse beyond one bf16 ulp by {err:.3g}")

    new = tri.hc_post(out, h, want_post, want_comb)
    want_new = reference(ref.hc_post, out, h, want_post, want_comb)
    terms = (want_post.to(h.dtype).float()[..., None] * out.float()[:, None, :]).abs() \
        + torch.einsum("tjk,tjd->tkd", want_comb.to(h.dtype).float(), h.float()).abs()
    if (err := excess(new, want_new, 1.01 * (2 ** -8 * terms + 2 ** -7 * want_new.float().abs()) + 1e-6)) > 0:
        errors.append(f"hc_post beyond the reference's bf16 roundings by {err:.3g}")

    head_args = (h, fn[:N], base[:N], scale[:1], NORM_EPS, HC_EPS)
    xh, want_xh = tri.hc_head(*head_args), reference(ref.hc_head, *head_args)
    if (err := excess(xh, want_xh, 2 ** -7 * want_xh.float().abs() + 1e-5 * abs_terms)) > 0:
        errors.append(f"hc_head collapse beyond one bf16 ulp by {err:.3g}")
    print(f"  T={T:<5d} max |err|: post {(post - want_post).abs().max().item():.2e}  "
          f"comb {(comb - want_comb).abs().max().item():.2e}  "
          f"collapse {(x.float() - want_x.float()).abs().max().item():.2e}  "
          f"hc_post {(new.float() - want_new.float()).abs().max().item():.2e}  "
          f"hc_head {(xh.float() - want_xh.float()).abs().max().item():.2e}")
    return errors


def op_bytes(T):
    h, fn, x = T * N * D * 2, (2 + N) * N * N * D * 4, T * D * 2
    pc = T * (N + N * N) * 4
    return {"hc_pre": h + fn + x + pc, "hc_post": 2 * h + x + pc, "hc_head": h + N * N * D * 4 + x}


def main():
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is the fp32 definition
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"mHC, N={N} D={D} sinkhorn {ITERS}, bf16 streams, fp32 weights; {torch.cuda.get_device_name()}")
    cases = {T: make_case(T, gen) for T in TOKENS}

    print("correctness:")
    failed = False
    for T, case in cases.items():
        for e in check(T, *case):
            print(f"  MISMATCH T={T}: {e}")
            failed = True

    head = f"{'op':8} {'T':>6} {'ref ms':>8} {'triton ms':>9} {'x':>6} {'MB':>8} {'GB/s':>7} {'%HBM':>5}"
    print("\n" + head + "\n" + "-" * len(head))
    for T, (h, fn, base, scale, out) in cases.items():
        _, post, comb = tri.hc_pre(h, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
        ops = {
            "hc_pre": (ref.hc_pre, tri.hc_pre, (h, fn, base, scale, NORM_EPS, HC_EPS, ITERS)),
            "hc_post": (ref.hc_post, tri.hc_post, (out, h, post, comb)),
            "hc_head": (ref.hc_head, tri.hc_head, (h, fn[:N], base[:N], scale[:1], NORM_EPS, HC_EPS)),
        }
        nbytes = op_bytes(T)
        for name, (ref_fn, tri_fn, args) in ops.items():
            ref_ms = median_ms(lambda: reference(ref_fn, *args))
            tri_ms = median_ms(lambda: tri_fn(*args))
            gbs = nbytes[name] / tri_ms / 1e6
            print(f"{name:8} {T:6d} {ref_ms:8.3f} {tri_ms:9.4f} {ref_ms / tri_ms:6.1f} {nbytes[name] / 1e6:8.2f} "
                  f"{gbs:7.0f} {100 * gbs * 1e9 / HBM_BPS:5.1f}")

    print("\nhc_pre projection kernel alone (h + fn read), ms and GB/s, by (BT, BK) tile; T <= 16 uses BT=16")
    head = f"{'T':>6} " + " ".join(f"{f'{bt}x{bk}':>15}" for bt, bk in PROJ_TILES)
    print(head + "\n" + "-" * len(head))
    saved = tri._BT, tri._BK
    for T, (h, fn, *_) in cases.items():
        cells = []
        for bt, bk in PROJ_TILES:
            tri._BT, tri._BK = bt, bk
            ms = median_ms(lambda: tri._mix_partials(h, fn))
            cells.append(f"{ms:7.4f} {(h.numel() * 2 + fn.numel() * 4) / ms / 1e6:7.0f}")
        tri._BT, tri._BK = saved
        print(f"{T:6d} " + " ".join(cells))

    epilogue_scan(gen)
    print("\nFAIL: Triton disagrees with the reference" if failed else "\nOK: Triton agrees with the reference")
    sys.exit(1 if failed else 0)


EPI_CONFIGS = ((4, 512), (1, 512), (2, 512), (8, 512), (1, 128), (2, 256), (4, 1024))   # (warps, BD); first = default


def epilogue_scan(gen):
    """hc_pre (projection + epilogue) at prefill sizes by the epilogue's (num_warps, BD)."""
    print("\nhc_pre ms by epilogue (num_warps, BD) (tuning aid)")
    print(f"{'T':>6} " + " ".join(f"{f'{w}w/{bd}':>10}" for w, bd in EPI_CONFIGS))
    saved = tri._EPI_WARPS, tri._EPI_MANY, tri._BD
    tri._EPI_MANY = 1 << 40            # the scanned warps at every T
    for T in (4096, 16384):
        h, fn, base, scale, _ = make_case(T, gen)
        cells = []
        for w, bd in EPI_CONFIGS:
            tri._EPI_WARPS, tri._BD = w, bd
            cells.append(f"{median_ms(lambda: tri.hc_pre(h, fn, base, scale, NORM_EPS, HC_EPS, ITERS)):10.4f}")
        tri._EPI_WARPS, tri._EPI_MANY, tri._BD = saved
        print(f"{T:6d} " + " ".join(cells))


if __name__ == "__main__":
    main()
