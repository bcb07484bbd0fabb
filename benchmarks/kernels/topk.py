"""The indexer's top-k select over long rows (dsv4/ops/stream_topk.py `top_keys`): one torch
topk over the row against two stages (the top k of every piece, then of their union), for the
rows a decode step merges at 16k, 256k and 1M context (E / 4 C4 entries + the k kept), k = 512.

    python -m benchmarks.kernels.topk          # needs CUDA; seconds

Checks first: every variant returns the one-stage keys exactly (exit 1 otherwise). Then the
median ms of each (CUDA events) and which is fastest per case; `TWO_STAGE_MIN` / `PIECE` in
stream_topk.py are set from this table.
"""
import sys

import torch

from dsv4.bench.timing import median_ms
from dsv4.ops.stream_topk import PIECE, TWO_STAGE_MIN, score_keys, top_keys

K = 512
CONTEXTS = (16384, 262144, 1048576)
BATCHES = (1, 8, 64)
PIECES = (2048, 4096, 8192, 16384)


def main() -> int:
    dev = torch.device("cuda")
    print(f"top {K} of T rows of W keys; default two-stage from {TWO_STAGE_MIN} keys, pieces of {PIECE}")
    print(f"{'T':>4} {'W':>8} {'one stage ms':>13}" + "".join(f"{f'piece {p}':>12}" for p in PIECES) + "  best")
    failures = 0
    for ctx in CONTEXTS:
        W = ctx // 4 + K
        for T in BATCHES:
            keys = score_keys(torch.randn(T, W, device=dev))
            one = keys.topk(K, dim=1).values
            row = [median_ms(lambda: keys.topk(K, dim=1))]
            for p in PIECES:
                failures += not torch.equal(top_keys(keys, K, two_stage_min=0, piece=p), one)
                row.append(median_ms(lambda: top_keys(keys, K, two_stage_min=0, piece=p)))
            names = ["one stage"] + [f"piece {p}" for p in PIECES]
            best = names[min(range(len(row)), key=row.__getitem__)]
            print(f"{T:>4} {W:>8} {row[0]:>13.3f}" + "".join(f"{t:>12.3f}" for t in row[1:]) + f"  {best}", flush=True)
    print("all variants equal to one stage" if not failures else f"{failures} MISMATCH(ES)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
