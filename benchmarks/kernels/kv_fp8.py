"""Packed FP8 KV rows (dsv4/ops/kv_fp8.py) against model-dtype (bf16) rows in the decode-step
kernels, batch 1, at V4-Flash shapes and contexts of 4k, 128k and 1M tokens:

    python -m benchmarks.kernels.kv_fp8                    # CUDA; under a minute
    python -m benchmarks.kernels.kv_fp8 --tiles            # also the FP8 attention tile shapes
    python -m benchmarks.kernels.kv_fp8 --smoke            # CPU, Triton's interpreter, tiny

Per context c, the three reads of a decode step whose cost is in the KV dtype:
  CSA attention   window 128 (SWA, 128-position pages) + the top-k 512 rows of c/4 C4 entries
  HCA attention   window 128 + all c/128 C128 entries (2-entry pages: read slot by slot)
  indexer         top-k 512 of the c/4 indexer keys (64-entry pages), and its scores kernel alone
(H = 64, D = 512 with 64 RoPE channels, Hi = 64, Di = 128; LAYERS layers' pages interleave).
Then the writes of one decode step's rows (T = 1): a bf16 row stored as is, against the packed
row written by the torch definition (pack_entries / pack_index_keys and an index_put: ~20 ops)
and by the Triton writer (dsv4/ops/triton/kv_pack.py: one kernel), which must match bit for bit.
The bf16 attention pools hold the FP8 rows' exact dequantisation, so both kinds compute the
same thing: the FP8 outputs must be within 2e-2 of the bf16 ones, the FP8 indexer scores within
1e-5 (of the largest) of those of the exact fp32 dequantised keys, else exit 1. Times: median replay of a CUDA graph of
GRAPH_CALLS calls (launch gaps excluded), ms per call; the fp8/bf16 column is the target
(<= 1 at every context: the FP8 rows are 584 bytes against 1024, index keys 132 against 256).
"""
from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported

import torch  # noqa: E402

from dsv4.bench.timing import graph_ms  # noqa: E402
from dsv4.ops.kv_fp8 import (entry_bytes, index_key_bytes, pack_entries, pack_index_keys,  # noqa: E402
                             unpack_entries, unpack_index_keys)
from dsv4.ops.paged import PagedRows  # noqa: E402
from dsv4.ops.triton import attention as tri_attn  # noqa: E402
from dsv4.ops.triton import indexer as tri_idx  # noqa: E402
from dsv4.ops.triton import kv_pack  # noqa: E402
from benchmarks.kernels import parse_smoke_args  # noqa: E402

H, D, ROPE, HI, DI, WINDOW, TOPK = 64, 512, 64, 64, 128, 128, 512
SWA_PAGE, C4_PAGE, C128_PAGE, LAYERS = 128, 64, 2, 2
CONTEXTS = (4096, 131072, 1048576)
SMOKE_CONTEXTS = (1024, 4096)
GRAPH_CALLS = 10
# FP8 attention tiles (h_block, block_k, num_warps, num_stages) timed with --tiles; the first is the default
TILES = [(16, 32, 8, 2), (16, 32, 4, 2), (16, 64, 8, 2), (16, 16, 8, 2), (32, 32, 8, 2), (16, 32, 8, 3)]
ATTN_TOL, SCORE_RTOL = 2e-2, 1e-5


def timed_ms(fn, device, reps: int) -> float:
    return graph_ms(fn, device, reps, GRAPH_CALLS)


def pools(rows: int, gen, device, dim: int):
    """(packed uint8 attention pool, bf16 pool of its dequantisation: exact) of `rows` random rows."""
    packed = pack_entries(torch.randn(rows, dim, generator=gen, device=device), ROPE)
    return packed, unpack_entries(packed, dim, ROPE).to(torch.bfloat16)


def index_pools(rows: int, gen, device):
    """(packed index keys, bf16 keys, their exact dequantisation in fp32): an index key's fp32
    scale makes the bf16 copy a rounding, so the check compares with the fp32 one."""
    packed = pack_index_keys(torch.randn(rows, DI, generator=gen, device=device))
    exact = unpack_index_keys(packed)
    return packed, exact.to(torch.bfloat16), exact


def paged(width: int, per_page: int, gen, device) -> tuple[PagedRows, int]:
    """One token reading items [0, width) of one request over shuffled pages, LAYERS layers'
    pages interleaved -> (PagedRows, pool rows)."""
    n_pages = -(-width // per_page)
    pages = torch.randperm(n_pages, generator=gen, device=device)[None, :]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return PagedRows(pages, zero, zero, zero + width, per_page, LAYERS * per_page, width), n_pages * LAYERS * per_page


def attention_case(kind: str, ctx: int, gen, device):
    """-> q, sinks, {"fp8": sources, "bf16": sources}: window + (CSA) top-k of ctx/4 C4 rows or
    (HCA) every one of ctx/128 C128 entries."""
    q = torch.randn(1, H, D, generator=gen, device=device).to(torch.bfloat16)
    sinks = torch.randn(H, generator=gen, device=device)
    window, swa_rows = paged(WINDOW, SWA_PAGE, gen, device)
    swa = pools(swa_rows, gen, device, D)
    if kind == "CSA":
        entries = ctx // 4
        hist = pools(entries * LAYERS, gen, device, D)
        second = torch.randperm(entries * LAYERS, generator=gen, device=device)[None, :min(TOPK, entries)]
    else:
        second, rows = paged(ctx // 128, C128_PAGE, gen, device)
        hist = pools(rows, gen, device, D)
    return q, sinks, {name: [(swa[i], window), (hist[i], second)] for i, name in enumerate(("fp8", "bf16"))}


def run_attention(ctx: int, gen, device, reps: int, tiles: bool) -> bool:
    """Print the CSA and HCA rows of one context; -> True on a mismatch."""
    failed = False
    for kind in ("CSA", "HCA"):
        q, sinks, sources = attention_case(kind, ctx, gen, device)
        scale = D ** -0.5
        outs = {k: tri_attn.sparse_attention(q, s, sinks, scale, rope_dims=ROPE) for k, s in sources.items()}
        err = (outs["fp8"].float() - outs["bf16"].float()).abs().max().item()
        ok = err <= ATTN_TOL * (1 + outs["bf16"].float().abs().max().item())
        failed |= not ok
        ms = {k: timed_ms(lambda s=s: tri_attn.sparse_attention(q, s, sinks, scale, rope_dims=ROPE), device, reps)
              for k, s in sources.items()}
        width = sources["fp8"][1][1].width if kind == "HCA" else sources["fp8"][1][1].shape[1]
        print(f"{ctx:8d} {kind + ' attention':16} {WINDOW + width:8d} {ms['bf16']:9.4f} {ms['fp8']:9.4f} "
              f"{ms['fp8'] / ms['bf16']:8.2f} {err:9.2e} {'ok' if ok else 'MISMATCH'}")
        if tiles and kind == "HCA":
            for hb, bk, nw, ns in TILES:
                t_ms = timed_ms(lambda: tri_attn.sparse_attention(q, sources["fp8"], sinks, scale, rope_dims=ROPE,
                                                                  h_block=hb, block_k=bk, num_warps=nw,
                                                                  num_stages=ns), device, reps)
                print(f"{'':8} {'  fp8 tile':16} {hb:3d} {bk:3d} {nw:2d} {ns:1d} {t_ms:9.4f}")
    return failed


def run_indexer(ctx: int, gen, device, reps: int) -> bool:
    """Print the indexer rows of one context; -> True on a mismatch."""
    entries = ctx // 4
    cand, rows = paged(entries, C4_PAGE, gen, device)
    packed, plain, exact = index_pools(rows, gen, device)
    keys = {"fp8": packed, "bf16": plain}
    q = torch.randn(1, HI, DI, generator=gen, device=device).to(torch.bfloat16)
    weights = torch.randn(1, HI, generator=gen, device=device) * HI ** -0.5
    want = tri_idx.indexer_scores(q, weights, exact, cand)                  # fp32 keys: exact fp32 products
    err = (tri_idx.indexer_scores(q, weights, packed, cand) - want).abs().max().item()
    ok = err <= SCORE_RTOL * want.abs().max().item()
    for name, fn in (("indexer top-k", tri_idx.indexer_topk), ("indexer scores", None)):
        ms = {k: timed_ms((lambda v=v: fn(q, weights, v, cand, TOPK)) if fn else
                          (lambda v=v: tri_idx.indexer_scores(q, weights, v, cand)), device, reps)
              for k, v in keys.items()}
        print(f"{ctx:8d} {name:16} {entries:8d} {ms['bf16']:9.4f} {ms['fp8']:9.4f} {ms['fp8'] / ms['bf16']:8.2f} "
              f"{err:9.2e} {'ok' if ok else 'MISMATCH'}")
    return not ok


def run_writes(gen, device, reps: int) -> bool:
    """Print the write rows (one row into a pool, T = 1); -> True on a mismatch."""
    failed = False
    rows = torch.tensor([3], device=device)
    for name, dim in (("attention entry", D), ("index key", DI)):
        x = torch.randn(1, dim, generator=gen, device=device).to(torch.bfloat16)
        packed = torch.zeros(8, entry_bytes(D, ROPE) if dim == D else index_key_bytes(DI), dtype=torch.uint8,
                             device=device)
        plain = torch.zeros(8, dim, dtype=torch.bfloat16, device=device)
        if dim == D:
            torch_fn, triton_fn = (lambda: packed.index_put_((rows,), pack_entries(x, ROPE)),
                                   lambda: kv_pack.write_entries(packed, rows, x, ROPE))
        else:
            torch_fn, triton_fn = (lambda: packed.index_put_((rows,), pack_index_keys(x)),
                                   lambda: kv_pack.write_index_keys(packed, rows, x))
        torch_fn()
        want = packed.clone()
        packed.zero_()
        triton_fn()
        ok = torch.equal(packed, want)
        failed |= not ok
        ms = [timed_ms(fn, device, reps) for fn in (lambda: plain.index_put_((rows,), x), torch_fn, triton_fn)]
        print(f"{'write':>8} {name:16} {1:8d} {ms[0]:9.4f} {ms[2]:9.4f} {ms[2] / ms[0]:8.2f} "
              f"{'torch pack ' + format(ms[1], '.4f') + ' ms':>18} {'ok' if ok else 'MISMATCH'}")
    return failed


def main() -> int:
    def add(p):
        p.add_argument("--contexts", default=None, help="comma-separated context lengths (default 4k,128k,1M)")
        p.add_argument("--tiles", action="store_true", help="also time FP8 attention tile shapes (HCA)")
    args, device = parse_smoke_args(__doc__, "CPU, Triton's interpreter, tiny contexts", add)
    contexts = tuple(int(c) for c in args.contexts.split(",")) if args.contexts else \
        (SMOKE_CONTEXTS if args.smoke else CONTEXTS)
    reps = 1 if args.smoke else 20
    gen = torch.Generator(device=device).manual_seed(0)
    name = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"FP8 vs bf16 KV, batch-1 decode kernels, H={H} D={D} Hi={HI} Di={DI} top-k={TOPK}; {name}")
    head = f"{'context':>8} {'read':16} {'entries':>8} {'bf16 ms':>9} {'fp8 ms':>9} {'fp8/bf16':>8} {'max err':>9}"
    print(head + "\n" + "-" * (len(head) + 9))
    failed = False
    for ctx in contexts:
        failed |= run_attention(ctx, gen, device, reps, args.tiles)
        failed |= run_indexer(ctx, gen, device, reps)
        if device == "cuda":
            torch.cuda.empty_cache()
    failed |= run_writes(gen, device, reps)
    print("FAIL: FP8 disagrees with bf16" if failed else "OK: FP8 agrees with bf16")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
