"""The prefix cache on the GPU path (Triton kernels, CUDA graphs, async scheduling): resends,
forks and a second turn generate the greedy tokens of a cold engine (no prefix cache), with the
hits they should get. Prints one line per case and exits 1 on a mismatch. In float32 the tokens
must be identical; in bfloat16 a difference is printed with the cold engine's top-2 logprob
margin where the runs part (another batch composition sums in another order, so a near-tie
may flip) and fails only when that margin exceeds `--tie-margin`.

    python -m benchmarks.prefix_check [--model DIR|random:...] [--device cuda] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams


def generate(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def parting_margin(got, want) -> float | None:
    """None when the token lists are equal; else the cold run's top-1 minus top-2 logprob at the
    first position where they differ."""
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:
            top = sorted(want.logprobs[i].values(), reverse=True)
            return top[0] - top[1] if len(top) > 1 else float("inf")
    return None if len(got.token_ids) == len(want.token_ids) else float("inf")


def main(argv=None) -> int:
    from dsv4.assets import demo_model_dir
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=demo_model_dir())
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tie-margin", type=float, default=0.1,
                   help="bfloat16: largest top-2 logprob margin at a parting that counts as a tie")
    args = p.parse_args(argv)
    settings = dict(device=args.device, dtype=args.dtype, max_num_batched_tokens=2048, max_num_seqs=16,
                    cache_memory_gb=4, tokenizer=args.tokenizer)
    t0 = time.perf_counter()
    hot = LLMEngine(args.model, EngineConfig(**settings))
    cold = LLMEngine(args.model, EngineConfig(**settings, enable_prefix_caching=False), model=hot.model,
                     tokenizer=hot.tokenizer)
    vocab = min(hot.cfg.vocab_size, 8000)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (1500,), generator=gen).tolist()
    failures = 0

    def case(name: str, got: dict, want: dict, cached: list[int]) -> None:
        nonlocal failures
        margins = [parting_margin(got[r], want[r]) for r in want]
        partings = [m for m in margins if m is not None]
        ties = all(m <= args.tie_margin for m in partings) and args.dtype != "float32"
        hits = sorted(o.num_cached_tokens for o in got.values())
        ok = (not partings or ties) and hits == sorted(cached)
        failures += not ok
        parted = f"{len(partings)} of {len(want)} part, cold top-2 margins {[round(m, 4) for m in partings]}"
        print(f"{name:<28} tokens {'same' if not partings else parted}; cached {hits} (want {sorted(cached)})"
              f"{'' if ok else '  <-- FAIL'}", flush=True)

    want = generate(cold, {"a": prompt}, 64)
    generate(hot, {"a": prompt}, 64)
    case("resend", generate(hot, {"b": prompt}, 64), {"b": want["a"]}, [1280])
    forks = {f"f{i}": prompt[:1300] for i in range(4)}
    case("forks (n = 4)", generate(hot, forks, 48), generate(cold, dict(forks), 48), [1280, 1280, 1280, 1280])
    turn2 = prompt + want["a"].token_ids + torch.randint(100, vocab, (700,), generator=gen).tolist()
    case("second turn", generate(hot, {"t": turn2}, 64), generate(cold, {"t": turn2}, 64), [1536])
    print(f"{failures} failure(s) in {time.perf_counter() - t0:.1f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
