"""Host microseconds a call of the grammar mask's device work costs the main thread, at the
structured-output benchmark's shape (batch 64, the demo model's vocabulary): what the
`upload` and `apply` figures of benchmarks/structured_output.py are made of.

    python -m benchmarks.kernels.mask_host [--rows 64] [--vocab 129280] [--calls 2000]
    python -m benchmarks.kernels.mask_host --smoke      # the CPU, a few calls

Each line times `--calls` calls back to back (no sync in between; one at the end) and prints
the host µs a call. First it checks the one-launch kernel against the torch definition.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from dsv4.engine.sampler import Sampler, SamplingBatch, SamplingRow, apply_grammar_mask
from dsv4.engine.upload import HostToDevice
from dsv4.ops.backend import forced
from dsv4.sampling_params import SamplingParams
from dsv4.structured.masks import GrammarMask, keep_bits, words


def per_call_us(fn, calls: int, device: str) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    calls = 20 if args.smoke else args.calls
    rows, vocab, width = args.rows, args.vocab, words(args.vocab)
    logits = torch.randn(rows, vocab, device=device)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, width), dtype=torch.int32)
    keep = torch.full((width,), -1, dtype=torch.int32)
    pinned = bitmask.pin_memory() if device == "cuda" else bitmask.clone()
    on_device = bitmask.to(device)
    mask = GrammarMask(torch.arange(rows, device=device), on_device, True, keep.to(device),
                       keep_bits(keep.to(device), device))
    want = logits.clone()
    with forced("reference"):
        apply_grammar_mask(want, mask)
    got = logits.clone()
    apply_grammar_mask(got, mask)
    assert torch.equal(got, want), "the one-launch mask differs from the torch definition"
    batch = dataclasses.replace(SamplingBatch.build([SamplingRow(SamplingParams(temperature=0.0), [1], [])] * rows,
                                                    vocab, "cpu"), grammar=mask)
    batch = dataclasses.replace(batch, is_greedy=batch.is_greedy.to(device), temperature=batch.temperature.to(device))
    h2d = HostToDevice(device)
    dst = torch.empty_like(on_device)
    work = logits.clone()

    def reference():
        with forced("reference"):
            apply_grammar_mask(work, mask)

    cases = [("apply_grammar_mask (dispatch: Triton on CUDA)", lambda: apply_grammar_mask(work, mask)),
             ("apply_grammar_mask, torch definition (3 kernels)", reference),
             ("logits.to(float32, copy=True)", lambda: logits.to(torch.float32, copy=True)),
             ("Sampler.processed_logits (the copy and the mask)", lambda: Sampler.processed_logits(logits, batch)),
             ("bitmask: pinned -> kept device buffer, copy_", lambda: dst.copy_(pinned, non_blocking=True)),
             ("bitmask + rows: packed upload (HostToDevice)", lambda: h2d.upload([mask.rows.cpu(), bitmask])),
             ("an empty torch op (x.add_(0))", lambda: work[:1, :1].add_(0))]
    print(f"host µs a call on {device}, [{rows}, {vocab}] logits, {calls} calls each")
    for name, fn in cases:
        print(f"{name:<52}{per_call_us(fn, calls, device):>9.1f}")


if __name__ == "__main__":
    main()
