"""Invariant 5 (docs/architecture.md, "Cache"), fuzzed: a seeded draw combines engine features
-- prompts crossing the C4 / C128 group ends, the sliding window and the 256-token pages,
shared prefixes (prefix cache on), the host tier, small chunk budgets, cache budgets small
enough to preempt, MTP speculative decoding (its own drafts or scripted ones that are right at
random positions), n > 1 copies, stop tokens, max_tokens, prompt logprobs, late arrivals, an
abort, async scheduling, greedy and seeded sampling -- and every request that finishes must
give the tokens (and finish reason) it gives alone on a plain engine.

Seeded sampling under speculative decoding draws other uniforms (docs/speculative.md): those
requests are compared with a run alone on a plain engine with the same MTP drafter (with
scripted drafts, not compared). `FUZZ_SEEDS=0-300` (a range or a
comma list) runs other seeds than the committed ones, to hunt.
"""
from __future__ import annotations

import dataclasses
import os
import random
import zlib

import pytest
import torch

from dsv4.sampling_params import SamplingParams
from scripted_drafts import ScriptedProposer     # (tests/engine/scripted_drafts.py)

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = 256
# prompt lengths around the C4 / C128 group ends, the window (32 in the tiny model) and pages
EDGES = [1, 2, 3, 4, 5, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 383, 384, 385, 511, 512, 513]
COMMITTED_SEEDS = [0, 9, 23, 27, 29, 38]   # together: preemption, prefix and host-tier hits, accepted drafts, FP8, aborts, async


def fuzz_seeds() -> list[int]:
    spec = os.environ.get("FUZZ_SEEDS")
    if not spec:
        return COMMITTED_SEEDS
    if "-" in spec:
        lo, hi = map(int, spec.split("-"))
        return list(range(lo, hi))
    return [int(s) for s in spec.split(",")]


@dataclasses.dataclass
class Draw:
    engine: dict                      # EngineConfig fields of the engine under test
    reqs: list                        # h.Req of every request (n > 1 copies expanded)
    abort: tuple[str, int] | None     # (request id, step) of the abort
    scripted: bool                    # MTP drafts scripted from the plain tokens
    wrong_every: int                  # a scripted draft is wrong where hash(rid, pos) % this == 0
    reset_at: int | None = None       # the step after which the GPU prefix cache is forgotten


def draw_prompt(rng: random.Random, bases: list[list[int]], vocab: int) -> list[int]:
    if rng.random() < 0.35:           # a long prefix of a shared base (prefix-cache pages), a short tail
        cut = rng.choice([256, 257, 300, 511, 512, 513, 580])
        return rng.choice(bases)[:cut] + [rng.randrange(2, vocab) for _ in range(rng.choice([0, 0, 1, 5, 20]))]
    n = rng.choice(EDGES) if rng.random() < 0.7 else rng.randint(1, 600)
    if rng.random() < 0.5:            # a prefix of a shared base, then its own tokens
        cut = min(n, rng.choice([n, PAGE, PAGE + 1, 2 * PAGE, rng.randint(1, n)]))
        return rng.choice(bases)[:cut] + [rng.randrange(2, vocab) for _ in range(n - cut)]
    return [rng.randrange(2, vocab) for _ in range(n)]


def draw_params(rng: random.Random) -> dict:
    kw = dict(max_tokens=rng.choice([1, 2, 3, 5, 8, 17, 30, 40, 70, 130]), ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.3:
        kw.update(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 20]), seed=rng.randrange(1000))
    else:
        kw.update(temperature=0.0)
    if rng.random() < 0.1:
        kw["prompt_logprobs"] = 0
    if rng.random() < 0.2:
        kw["logprobs"] = 1
    if rng.random() < 0.15:
        kw.update(repetition_penalty=1.3, frequency_penalty=0.2)
    if rng.random() < 0.15:
        kw["min_tokens"] = min(kw["max_tokens"], rng.choice([1, 3, 10]))
    return kw


def draw_case(seed: int, h, vocab: int) -> Draw:
    rng = random.Random(seed)
    bases = [[rng.randrange(2, vocab) for _ in range(600)] for _ in range(2)]
    reqs, stop_rids = [], []
    for i in range(rng.randint(1, 6)):
        prompt, kw, arrival = draw_prompt(rng, bases, vocab), draw_params(rng), rng.choice([0, 0, 0, 1, 3, 6, 12, 25, 50])
        n = rng.choice([1, 1, 1, 2, 3])
        for k in range(n):
            seed_k = None if kw.get("seed") is None else kw["seed"] + k
            reqs.append(h.Req(f"r{i}.{k}", prompt, SamplingParams(**{**kw, "seed": seed_k}), arrival))
        if rng.random() < 0.3:
            stop_rids.append(f"r{i}.")
    longest = max(len(r.prompt) + r.params.max_tokens for r in reqs)
    need = -(-longest // PAGE)
    spec = rng.random() < 0.35
    engine = dict(max_num_batched_tokens=rng.choice([8, 16, 33, 64, 200, 2048]),
                  max_num_seqs=rng.choice([1, 2, 3, 8]),
                  num_pages=need + rng.choice([0, 0, 0, 1, 8]),
                  enable_prefix_caching=rng.random() < 0.8,
                  async_scheduling=rng.choice(["on", "off"]))
    if engine["enable_prefix_caching"] and rng.random() < 0.4:
        engine["host_cache_gb"] = 0.02
    if engine["enable_prefix_caching"] and rng.random() < 0.2:
        engine["num_checkpoints"] = rng.choice([1, 2, 3])
    if rng.random() < 0.15:           # the plain run then keeps FP8 rows too
        engine["kv_cache_dtype"] = "fp8"
    if spec:
        engine["speculative_config"] = {"method": "mtp", "num_speculative_tokens": rng.randint(1, 3)}
    abort = None
    if len(reqs) > 1 and rng.random() < 0.3:
        victim = rng.choice(reqs)
        abort = (victim.rid, victim.arrival + rng.randint(0, 20))
    d = Draw(engine, reqs, abort, spec and rng.random() < 0.7, rng.choice([2, 3, 5]))
    if engine["enable_prefix_caching"] and rng.random() < (0.9 if "host_cache_gb" in engine else 0.3):
        d.reset_at = rng.randint(0, 40)
    d.stop_prefixes = stop_rids
    d.stop_pick = rng.random()
    return d


class Plain:
    """Each request alone on a plain engine (no prefix cache, no async, no speculation unless
    `spec` is given, one big budget), memoised by prompt and parameters."""

    def __init__(self, tiny, h, kv_cache_dtype: str = "auto", spec: dict | None = None):
        self.tiny, self.h, self.kv, self.spec, self.done = tiny, h, kv_cache_dtype, spec, {}

    def run(self, prompt: list[int], params: SamplingParams):
        key = (tuple(prompt), repr(params))
        if key not in self.done:
            eng = self.tiny.engine(max_num_batched_tokens=2048, max_num_seqs=1, num_pages=4, kv_cache_dtype=self.kv,
                                   enable_prefix_caching=False, async_scheduling="off", speculative_config=self.spec)
            self.done[key] = self.h.drive(eng, [self.h.Req("solo", prompt, params)])["solo"]
        return self.done[key]


def add_stops(d: Draw, plain: Plain) -> None:
    """A drawn request stops on a token its plain run emits (the same for its n copies)."""
    for prefix in d.stop_prefixes:
        group = [r for r in d.reqs if r.rid.startswith(prefix)]
        out = plain.run(group[0].prompt, group[0].params).token_ids
        stop = out[int(d.stop_pick * len(out))]
        for r in group:
            r.params = dataclasses.replace(r.params, stop_token_ids=[stop])


def run_case(seed: int, tiny, h) -> dict:
    d = draw_case(seed, h, tiny.cfg.vocab_size)
    plain = Plain(tiny, h, d.engine.get("kv_cache_dtype", "auto"))
    add_stops(d, plain)
    want = {r.rid: plain.run(r.prompt, r.params) for r in d.reqs}
    eng = tiny.engine(**d.engine)
    if d.scripted:
        truth = {r.rid: r.prompt + want[r.rid].token_ids for r in d.reqs}
        every = d.wrong_every     # wrong where (rid, p) hashes to 0 mod every: runs of every length
        eng.spec.proposer = ScriptedProposer(
            truth, lambda rid, p: zlib.crc32(f"{rid}@{p}".encode()) % every == 0, tiny.cfg.vocab_size)
    reset = lambda eng, step: step == d.reset_at and eng.reset_prefix_cache()   # noqa: E731
    got = h.drive(eng, d.reqs, check=True, abort_at=d.abort, on_step=reset)
    spec = d.engine.get("speculative_config")
    # seeded sampling draws other uniforms with drafts (docs/speculative.md): compared with the
    # request alone on a plain engine with the same drafter where no step can verify fewer
    # drafts than alone (scripted drafts, or a budget or cache that can cut drafts: not compared)
    spec_plain = (Plain(tiny, h, d.engine.get("kv_cache_dtype", "auto"), spec)
                  if spec and not d.scripted and drafts_never_cut(d) else None)
    for r in d.reqs:
        if d.abort is not None and r.rid == d.abort[0]:
            continue
        a, b = got[r.rid], want[r.rid]
        if spec and not r.params.is_greedy:
            if spec_plain is None:
                continue
            b = spec_plain.run(r.prompt, r.params)
        if (a.token_ids, a.finish_reason, a.stop_reason) == (b.token_ids, b.finish_reason, b.stop_reason):
            continue
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        assert i is not None and near_tie(tiny, h, r, b.token_ids[:i], (a.token_ids[i], b.token_ids[i])), (
            f"seed {seed}: {r.rid} (prompt {len(r.prompt)}, {r.params}) under {d.engine}, "
            f"abort {d.abort}, reset {d.reset_at}, scripted {d.scripted}:\n got {a.token_ids}\nwant {b.token_ids}")
    return got


def drafts_never_cut(d: Draw) -> bool:
    """Every decode gets its k drafts: the budget holds k + 1 tokens of every sequence, the
    pages every request at once (no short chain, no preemption)."""
    k = d.engine["speculative_config"]["num_speculative_tokens"]
    pages = sum(-(-(len(r.prompt) + r.params.max_tokens + k) // PAGE) for r in d.reqs)
    return d.engine["max_num_batched_tokens"] >= (k + 1) * d.engine["max_num_seqs"] and d.engine["num_pages"] >= pages


def near_tie(tiny, h, r, before: list[int], pair: tuple[int, int]) -> bool:
    """Invariant 5 allows another greedy token where the top-2 margin is within the tolerance:
    are both tokens of `pair` within h.MARGIN of the top of the processed logits after
    prompt + `before`, or does the CSA top-k selection have a near-tie before it?"""
    from dsv4.engine.oneshot import full_logits
    from dsv4.engine.sampler import Sampler, SamplingBatch, SamplingRow
    if not r.params.is_greedy:
        return False
    ids = r.prompt + before
    if tiny.ties(ids):
        return True
    with torch.no_grad():
        row = full_logits(tiny.model, ids)[-1:].float()
    batch = SamplingBatch.build([SamplingRow(r.params, r.prompt, before)], tiny.cfg.vocab_size, "cpu",
                                tiny.cfg.eos_token_id)
    row = Sampler.processed_logits(row, batch)[0]
    return all(float(row.max() - row[t]) <= h.MARGIN for t in pair)


@pytest.mark.parametrize("seed", fuzz_seeds())
def test_features_give_the_plain_tokens(tiny, h, seed):
    run_case(seed, tiny, h)
