"""Indexer top-k of long rows: the radix select in Triton (dsv4/ops/triton/radix_topk.py)
against torch, at E = 4k, 64k and 262k scores per row (1M context: 262,144 C4 entries) and
batch 1, 8, 64, k = 512.

    python -m benchmarks.kernels.topk            # H200; well under a minute
    python -m benchmarks.kernels.topk --smoke    # CPU, Triton's interpreter, tiny rows

Checks first (exit 1 on a difference): keys and offsets bit for bit against the definition,
torch.topk over stream_topk's int64 keys (score desc, ties to the lower offset), on random
scores with a -inf tail per row and on small-integer scores (many exact ties, the tie scan).
Then times, each as the replay of a CUDA graph of 10 calls (how decode runs it), per call:
  torch keys   what the indexer ran before: score_keys + cat with the running top-k + topk
               (sorted) + key_offsets (dsv4/ops/stream_topk.py, RunningTopk)
  torch.topk   a bare torch.topk(scores, k) (values and indices, sorted): the floor of torch
  radix 8      radix_topk(scores, k): keys and offsets, sorted; digits of 8 bits (4 passes,
               the default)
  radix 11     the same with digits of 11, 11, 10 bits (3 passes, 8x the histogram bins)
"""
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported

import torch  # noqa: E402

from dsv4.bench.timing import graph_ms  # noqa: E402
from dsv4.ops.stream_topk import EMPTY_KEY, MIN_CHOSEN_KEY, RunningTopk, key_offsets, score_keys  # noqa: E402
from dsv4.ops.triton.radix_topk import radix_topk  # noqa: E402
from benchmarks.kernels import parse_smoke_args  # noqa: E402

LAYOUTS = ((8, 8, 8, 8), (11, 11, 10))

K = 512
ENTRIES, BATCHES = (4096, 65536, 262144), (1, 8, 64)
SMOKE_ENTRIES, SMOKE_BATCHES = (600, 3000), (1, 3)


def make_scores(T, E, device, gen, ties=False):
    """[T, E] fp32: indexer-like scores (a weighted sum of ReLUs: many near 0, a long upper
    tail), row t valid up to E - t * E // (2T) (a -inf tail); or small integers (ties)."""
    if ties:
        scores = torch.randint(0, 8, (T, E), generator=gen, device=device).float()
    else:
        scores = torch.relu(torch.randn(T, E, 4, generator=gen, device=device)).sum(-1) * 0.37
    lengths = E - torch.arange(T, device=device) * E // (2 * T)
    return scores.masked_fill(torch.arange(E, device=device)[None, :] >= lengths[:, None], float("-inf"))


def reference(scores, k):
    keys = score_keys(scores).topk(min(k, scores.shape[1]), dim=1).values
    keys = torch.where(keys >= MIN_CHOSEN_KEY, keys, EMPTY_KEY)
    return keys, key_offsets(keys)


def running_topk(scores, k):
    """The indexer's previous selection of one tile: RunningTopk.add, then its offsets."""
    running = RunningTopk(scores.shape[0], k, scores.device)
    running.add(scores, 0)
    return running.offsets()


def check(device, gen, entries, batches) -> list[str]:
    errors = []
    for E in entries:
        for T in batches:
            for ties in (False, True):
                scores = make_scores(T, E, device, gen, ties)
                want = reference(scores, K)
                for digits in LAYOUTS:
                    got = radix_topk(scores, K, digits=digits)
                    if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                        errors.append(f"E={E} T={T} ties={ties} digits={digits}: radix top-k differs")
    return errors


def main() -> int:
    args, device = parse_smoke_args(__doc__, "CPU, Triton's interpreter, tiny rows")
    entries, batches = (SMOKE_ENTRIES, SMOKE_BATCHES) if args.smoke else (ENTRIES, BATCHES)
    reps = 1 if args.smoke else 20
    gen = torch.Generator(device=device).manual_seed(0)
    name = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"indexer top-k {K} of E fp32 scores per row, {name}; ms per call (CUDA graph replay)")
    errors = check(device, gen, entries, batches)
    for e in errors:
        print(f"  MISMATCH {e}")
    head = (f"{'E':>7} {'batch':>5} {'torch keys':>10} {'torch.topk':>10} {'radix 8':>8} {'radix 11':>8} "
            f"{'keys/radix 8':>12}")
    print(head)
    print("-" * len(head))
    for E in entries:
        for T in batches:
            scores = make_scores(T, E, device, gen)
            ms = [graph_ms(lambda: running_topk(scores, K), device, reps),
                  graph_ms(lambda: torch.topk(scores, min(K, E), dim=1), device, reps),
                  *(graph_ms(lambda d=d: radix_topk(scores, K, digits=d), device, reps) for d in LAYOUTS)]
            print(f"{E:7d} {T:5d} {ms[0]:10.4f} {ms[1]:10.4f} {ms[2]:8.4f} {ms[3]:8.4f} {ms[0] / ms[2]:12.2f}",
                  flush=True)
    print("FAIL: radix top-k differs from the reference" if errors else "OK: radix top-k equals the reference")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
