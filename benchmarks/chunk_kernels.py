"""The deep-chunk target with each long-list attention and indexer scores kernel, in one process
(one machine, one model load): the 2,048-token chunk at position 0 once, then the chunk at ~900k
once per name: "attention[/scores[/inline]]", attention dsv4/ops/triton/attention.py's LONG_KERNEL
("shared", or "none" for the per-token kernel), scores dsv4/ops/triton/indexer.py's TILED_SCORES
("heads", or "heads=BTxBExWxS" for that kernel at HeadLoopTiles(BT, BE, W, S, q_tma=True) instead
of HEAD_TILES; none named: None, indexer_scores' GEMM_TILES kernel), "inline": the tiles' top-k in
order on one stream (indexer.py OVERLAP_TOPK off; else beside the next tile's scores); each the
median of --repeats runs after a warm-up (benchmarks/long_context.py chunk_case), with the ratio
less the indexer's O(E) roofline term (target <= 1.5). `--mid` times every case twice: with the
request ending in the chunk's step (as benchmarks/long_context.py does) and going on after it (a
chunk in the middle of a long prompt: the request's end, its pages and prompt freed, left out).

    python -m benchmarks.chunk_kernels [--kernels shared/heads,shared/heads/inline] [--repeats 3] [--spec S] [--smoke]

--spec loads another model (e.g. `random:flash-slice:6:n_routed_experts=128`, half the experts'
weights, for an 80 GB card): its chunks are not the target's, only the kernels' A/B.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import long_context as lc
from dsv4.model.weights import load_model
from dsv4.ops.triton import attention as triton_attention
from dsv4.ops.triton import indexer as triton_indexer
from dsv4.ops.triton.indexer_scores_heads import HeadLoopTiles


def net_ratio(deep: dict, first: dict) -> float:
    """(deep chunk - its O(E) term) / (chunk at 0 - its term)."""
    return (deep["ms"] - deep["indexer_bound_ms"]) / (first["ms"] - first["indexer_bound_ms"])


def scores_kernel(scores: str) -> tuple[str | None, HeadLoopTiles]:
    """"heads=64x256x8x3" -> ("heads", HeadLoopTiles(64, 256, 8, 3, q_tma=True)); else (scores or
    None, HEAD_TILES)."""
    name, _, tiles = scores.partition("=")
    if not tiles:
        return name or None, triton_indexer.HEAD_TILES
    return name, HeadLoopTiles(*(int(v) for v in tiles.split("x")), q_tma=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", default="shared/heads,shared/heads/inline",
                   help="comma-separated LONG_KERNEL[/TILED_SCORES[/inline]] values ('none': None)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--spec", default=lc.SPEC, help="the model (default: the target's)")
    p.add_argument("--mid", action="store_true", help="also time the chunks with the request going on after them")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a 64-token chunk at 4096")
    args = p.parse_args()
    device, dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    sizes = lc.SMOKE if args.smoke else lc.GPU
    first, deep = sizes["chunk_at"]
    tokens = sizes["chunk_tokens"]
    model = load_model("random:tiny" if args.smoke else args.spec, device, getattr(torch, dtype))
    lines = [f"| kernel | request ends in the step | at {deep} | at {first} | ratio | "
             f"less the O(E) term ({lc.TARGET_CHUNK_900K_VS_0}) | runs |", "|---|---|---|---|---|---|---|"]
    defaults = (triton_attention.LONG_KERNEL, triton_indexer.TILED_SCORES, triton_indexer.OVERLAP_TOPK,
                triton_indexer.HEAD_TILES)
    for ends in (True, False) if args.mid else (True,):
        # the chunk at 0 with the default kernels (not the last name's)
        (triton_attention.LONG_KERNEL, triton_indexer.TILED_SCORES, triton_indexer.OVERLAP_TOPK,
         triton_indexer.HEAD_TILES) = defaults
        at0 = lc.chunk_case(model, device, dtype, "auto", first, tokens, args.repeats, ends)
        lc.log(f"chunk at {first}, request ends {ends}: {at0}")
        for name in args.kernels.split(","):
            attention, scores, topk = (name.split("/") + ["", ""])[:3]
            triton_attention.LONG_KERNEL = None if attention == "none" else attention
            triton_indexer.TILED_SCORES, triton_indexer.HEAD_TILES = scores_kernel(scores)
            triton_indexer.OVERLAP_TOPK = topk != "inline"
            r = lc.chunk_case(model, device, dtype, "auto", deep, tokens, args.repeats, ends)
            lc.log(f"chunk at {deep}, {name}, request ends {ends}: {r}")
            lines.append(f"| {name} | {'yes' if ends else 'no'} | {r['ms']:.1f} ms | {at0['ms']:.1f} ms | "
                         f"{r['ms'] / at0['ms']:.2f}x | {net_ratio(r, at0):.2f}x | {r['runs_ms']} / {at0['runs_ms']} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
