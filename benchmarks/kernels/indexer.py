"""Lightning indexer on the GPU: the Triton kernel (dsv4/ops/triton/indexer.py) against the
torch reference (dsv4/ops/indexer.py) at V4-Flash shapes (Hi = 64, Di = 128, top-k 512, bf16).

    python -m benchmarks.kernels.indexer            # needs CUDA; about half a minute

Checks first (exit 1 on a mismatch): scores within 1e-5 relative (fp32), the same -1 count on
every row, and the same set of chosen rows on every row whose k-th and (k+1)-th reference
scores are more than 1e-4 apart (relative). Then times both (CUDA events, median) and prints
a table. Roofline columns use the scores kernel alone (the top-k: benchmarks/kernels/topk.py):
bytes = keys T*E*Di*2 (upper bound: no reuse) + q T*Hi*Di*2 + weights T*Hi*4 + cand T*E*8
+ scores written T*E*4, against 4.2 TB/s; FLOPs = 2*T*E*Hi*Di against 800 TFLOP/s (bf16
dense). Both counts are nominal: padded (-1) candidates are included, though the kernel skips
blocks that hold only -1 (half the blocks of a causal prefill).

Cases: decode, T tokens of T different requests, each with E valid entries at distinct pool
rows; prefill, one chunk of T tokens at positions 0..T-1, E = T / 4 entries, token t sees
entries e < (t + 1) // 4 (causal -1 tail).

A second table times the same cases with the candidates as a PagedRows (dsv4/ops/paged.py:
token t's range [0, E) or [0, (t + 1) // 4) over shuffled 64-entry pages, LAYERS layers' pages
interleaved) against its dense form on the same rows: scores and selection must be
bit-identical (the dense kernel is checked against the reference in the first table).
"""
import sys

import torch

from dsv4.bench.timing import median_ms
from dsv4.ops import backend
from dsv4.ops import indexer as ref
from dsv4.ops.paged import PagedRows
from dsv4.ops.triton import indexer as tri

HI, DI, TOPK = 64, 128, 512
HBM_BPS, PEAK_FLOPS = 4.2e12, 800e12
CASES = [("decode", 1, 256), ("decode", 8, 256), ("decode", 64, 256),
         ("decode", 1, 4096), ("decode", 8, 4096), ("decode", 64, 4096),
         ("prefill", 4096, 1024), ("prefill", 16384, 4096)]
BLOCKS = (32, 64, 128)          # BLOCK_E values timed for the scores kernel (tuning aid)
TIE_GAP, RTOL = 1e-4, 1e-5
DEVICE = "cuda"
REF_CHUNK = 1024                # queries per chunk of the reference scores (as the reference)
PAGE, LAYERS = 64, 4            # C4 entries per page; layers whose pages interleave (pitch = LAYERS * PAGE)


def make_case(kind, T, E, gen):
    q = torch.randn(T, HI, DI, generator=gen, device=DEVICE).to(torch.bfloat16)
    weights = torch.randn(T, HI, generator=gen, device=DEVICE) * HI ** -0.5
    if kind == "decode":        # token t owns pool rows [t*E, (t+1)*E), in a random order
        keys = torch.randn(T * E, DI, generator=gen, device=DEVICE).to(torch.bfloat16)
        order = torch.rand(T, E, generator=gen, device=DEVICE).argsort(dim=1)
        cand = order + torch.arange(T, device=DEVICE)[:, None] * E
    else:                       # one request: entries at random pool rows, causal tails
        keys = torch.randn(E, DI, generator=gen, device=DEVICE).to(torch.bfloat16)
        rows = torch.randperm(E, generator=gen, device=DEVICE)
        e = torch.arange(E, device=DEVICE)[None, :]
        limit = (torch.arange(T, device=DEVICE) + 1)[:, None] // 4
        cand = torch.where(e < limit, rows[e], -1)
    return q, weights, keys, cand


def make_paged_case(kind, T, E, gen):
    """make_case's q and weights, candidates as a PagedRows over a pool of shuffled pages."""
    q, weights, _, _ = make_case(kind, T, E, gen)
    t = torch.arange(T, device=DEVICE)
    req = t if kind == "decode" else torch.zeros_like(t)
    hi = torch.full_like(t, E) if kind == "decode" else (t + 1) // 4
    R, P = int(req.max()) + 1, -(-E // PAGE)
    pages = torch.randperm(R * P, generator=gen, device=DEVICE).view(R, P)
    cand = PagedRows(pages, req, torch.zeros_like(t), hi, PAGE, LAYERS * PAGE, E)
    keys = torch.randn(R * P * LAYERS * PAGE, DI, generator=gen, device=DEVICE).to(torch.bfloat16)
    return q, weights, keys, cand


def run_paged_case(kind, T, E, gen):
    """Time paged against dense on the same rows, print its row; -> True on a difference."""
    q, weights, keys, cand = make_paged_case(kind, T, E, gen)
    dense = cand.dense()
    same = (torch.equal(tri.indexer_scores(q, weights, keys, cand), tri.indexer_scores(q, weights, keys, dense))
            and torch.equal(tri.indexer_topk(q, weights, keys, cand, TOPK),
                            tri.indexer_topk(q, weights, keys, dense, TOPK)))
    reps = 5 if T >= 4096 else 50
    times = [median_ms(lambda c=c: tri.indexer_topk(q, weights, keys, c, TOPK), reps) for c in (dense, cand)]
    times += [median_ms(lambda c=c: tri.indexer_scores(q, weights, keys, c), reps) for c in (dense, cand)]
    print(f"{kind:8} {T:6d} {E:5d} " + " ".join(f"{ms:9.3f}" for ms in times)
          + f" {times[1] / times[0]:11.2f} {'yes' if same else 'NO':>7}")
    return not same


def reference_scores(q, weights, keys, cand):
    """[T, E] fp32, the reference's math (dsv4.ops.indexer._select), in query chunks."""
    out = torch.empty(cand.shape, dtype=torch.float32, device=cand.device)
    for a in range(0, q.shape[0], REF_CHUNK):
        b = min(a + REF_CHUNK, q.shape[0])
        gathered = keys[cand[a:b].clamp(min=0)].float()                     # [t, E, Di]
        s = torch.relu(torch.einsum("thd,ted->the", q[a:b].float(), gathered)) * DI ** -0.5
        out[a:b] = (s * weights[a:b, :, None]).sum(dim=1).masked_fill(cand[a:b] < 0, float("-inf"))
    return out


def reference_topk(*args):
    with backend.forced("reference"):
        return ref.indexer_topk(*args)


def check(q, weights, keys, cand):
    """-> list of failure messages (empty = agrees with the reference)."""
    errors = []
    want_s = reference_scores(q, weights, keys, cand)
    got_s = tri.indexer_scores(q, weights, keys, cand)
    finite = torch.isfinite(want_s)
    if not torch.equal(finite, torch.isfinite(got_s)):
        errors.append("-inf positions differ")
    scale = want_s[finite].abs().max().item() if finite.any() else 1.0
    err = ((got_s - want_s).abs() - RTOL * want_s.abs())[finite].max().item() if finite.any() else 0.0
    if err > RTOL * scale:
        errors.append(f"scores off by {err:.3g} beyond rtol (scale {scale:.3g})")
    want = reference_topk(q, weights, keys, cand, TOPK)
    got = tri.indexer_topk(q, weights, keys, cand, TOPK)
    if got.shape != want.shape or not torch.equal((got < 0).sum(1), (want < 0).sum(1)):
        return errors + ["-1 counts differ"]
    k = want.shape[1]
    tie_free = torch.ones(cand.shape[0], dtype=torch.bool, device=cand.device)
    if k < cand.shape[1]:
        top = want_s.topk(k + 1, dim=1).values
        gap = top[:, k - 1] - top[:, k]
        tie_free = ~torch.isfinite(top[:, k]) | (gap > TIE_GAP * top[:, k - 1].abs())
    same = (got.sort(1).values == want.sort(1).values).all(1)
    bad = (tie_free & ~same).sum().item()
    if bad:
        errors.append(f"{bad} tie-free rows select differently")
    if tie_free.float().mean().item() < 0.5:
        errors.append(f"only {tie_free.sum().item()} of {cand.shape[0]} rows are tie-free")
    return errors


def run_case(kind, T, E, gen):
    """Check and time one case, print its row; -> True on a mismatch."""
    q, weights, keys, cand = make_case(kind, T, E, gen)
    args = (q, weights, keys, cand)
    reps = 5 if T >= 4096 else 50
    try:
        errors = check(*args)
        ref_ms = median_ms(lambda: reference_topk(*args, TOPK), reps)
    except torch.cuda.OutOfMemoryError:
        errors, ref_ms = [], None
        torch.cuda.empty_cache()
        print(f"  {kind} T={T} E={E}: the reference ran out of memory; Triton timed unchecked")
    for e in errors:
        print(f"  MISMATCH {kind} T={T} E={E}: {e}")
    tri_ms = median_ms(lambda: tri.indexer_topk(*args, TOPK), reps)
    blk = {b: median_ms(lambda: tri.indexer_scores(*args, block_e=b), reps) for b in BLOCKS}
    sc_ms = blk[tri.BLOCK_E]
    nbytes = T * E * DI * 2 + T * HI * DI * 2 + T * HI * 4 + T * E * 8 + T * E * 4
    flops = 2 * T * E * HI * DI
    gbs, tfs = nbytes / sc_ms / 1e6, flops / sc_ms / 1e9
    ref_col = f"{'OOM':>8} {tri_ms:9.3f} {'-':>6}" if ref_ms is None else \
        f"{ref_ms:8.3f} {tri_ms:9.3f} {ref_ms / tri_ms:6.1f}"
    valid = (cand >= 0).float().mean().item()
    print(f"{kind:8} {T:6d} {E:5d} {valid:6.2f} {ref_col} {sc_ms:9.3f} "
          f"{nbytes / 1e6:8.1f} {gbs:7.0f} {100 * gbs * 1e9 / HBM_BPS:5.1f} {flops / 1e9:7.1f} "
          f"{tfs:7.1f} {100 * tfs * 1e12 / PEAK_FLOPS:5.1f}  "
          + " ".join(f"{blk[b]:8.3f}" for b in BLOCKS))
    return bool(errors)


def main():
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False      # the reference is the fp32 definition
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"lightning indexer, Hi={HI} Di={DI} top-k={TOPK}, bf16 q/keys, fp32 weights/scores; "
          f"{torch.cuda.get_device_name()}")
    head = (f"{'case':8} {'T':>6} {'E':>5} {'valid':>6} {'ref ms':>8} {'triton ms':>9} {'x':>6} "
            f"{'scores ms':>9} {'MB':>8} {'GB/s':>7} {'%HBM':>5} {'GFLOP':>7} {'TFLOP/s':>7} "
            f"{'%peak':>5}  " + " ".join(f"{'E' + str(b) + ' ms':>8}" for b in BLOCKS))
    print(head)
    print("-" * len(head))
    failed = False
    for kind, T, E in CASES:
        failed |= run_case(kind, T, E, gen)
        torch.cuda.empty_cache()
    print(f"\npaged candidates against their dense form (same rows; {PAGE}-entry pages, pitch {LAYERS} x page)")
    head = (f"{'case':8} {'T':>6} {'E':>5} {'dense ms':>9} {'paged ms':>9} {'dense sc':>9} {'paged sc':>9} "
            f"{'paged/dense':>11} {'bitwise':>7}")
    print(head)
    print("-" * len(head))
    for kind, T, E in CASES:
        failed |= run_paged_case(kind, T, E, gen)
        torch.cuda.empty_cache()
    print("FAIL: Triton disagrees with the reference" if failed else "OK: Triton agrees with the reference")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
