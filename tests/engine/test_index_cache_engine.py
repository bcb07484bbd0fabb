"""IndexCache (index_topk_freq 4) through the engine: invariant 5 (path invariance) across
chunk boundaries at every offset mod 4, batching, speculative verify steps with rollback, and
decode steps padded to CUDA-graph shapes; the engine's --index-topk-freq override
(docs/architecture.md, "Cache" and "Model").

The reference is the same model's whole-sequence prefill on the torch ops (`full_logits`),
itself checked against transformers patched the same way in tests/model/test_index_cache.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from dsv4.config import ConfigError, EngineConfig
from dsv4.engine.cuda_graphs import StepGraphs
from dsv4.engine.engine import LLMEngine
from dsv4.engine.oneshot import full_logits
from dsv4.model.random_init import preset_config, random_state, save_checkpoint
from dsv4.model.weights import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

S = 4


@pytest.fixture(scope="module")
def plain_path(tmp_path_factory) -> str:
    """8 layers (0, 4, 128, 4, 0, 4, 128, 4): four CSA layers; config.json without IndexCache;
    3 Sinkhorn iterations, as tests/engine/conftest.py's tiny model (a runtime loop bound)."""
    cfg = preset_config("tiny", layers=8, index_n_heads=16, hc_sinkhorn_iters=3)
    path = str(tmp_path_factory.mktemp("tiny8"))
    save_checkpoint(cfg, random_state(cfg, seed=1234), path, names="deepseek")
    return path


@pytest.fixture(scope="module")
def tiny4(tiny, plain_path):
    """The `tiny` helper (tests/engine/conftest.py) over the 8-layer model at freq 4 (FSSS)."""
    model = load_model(plain_path, overrides={"index_topk_freq": 4})
    assert model.cfg.index_topk_pattern == "FSSS"
    return type(tiny)(plain_path, model.cfg, model)


class Reference:
    def __init__(self, model):
        self.model, self.cache = model, {}

    def __call__(self, ids):
        if tuple(ids) not in self.cache:
            self.cache[tuple(ids)] = full_logits(self.model, ids)
        return self.cache[tuple(ids)]


@pytest.fixture(scope="module")
def ref(tiny4):
    return Reference(tiny4.model)


def test_chunk_boundaries_at_every_offset_mod_4(tiny4, ref, h, stepper):
    """Requests of the same 300 tokens prefilled as [0, b) then [b, 300) with b at every offset
    mod 4 (and around a 128 boundary), all in the same two steps: the shared layers' selections
    come from the producer of the same step, so every row equals the whole prefill's."""
    tokens = tiny4.tie_free_ids(300, seed=31)
    want = ref(tokens)
    firsts = [1, 2, 3, 4, 5, 6, 7, 61, 62, 63, 64, 126, 127, 128, 129, 130, 131, 250]
    assert {b % 4 for b in firsts} == {0, 1, 2, 3}
    eng = tiny4.engine(max_num_batched_tokens=300 * len(firsts), max_num_seqs=len(firsts), num_pages=4 * len(firsts))
    reqs = [stepper.request(tokens) for _ in firsts]
    first = stepper.step(eng, list(zip(reqs, firsts)))
    second = stepper.step(eng, [(r, len(tokens) - b) for r, b in zip(reqs, firsts)])
    for b, a, z in zip(firsts, first, second):
        h.assert_rows_close(torch.cat([a, z]), want, range(len(tokens)), f"boundary at {b}")


def test_batch_invariance(tiny4, ref, h, stepper):
    """A request's logits alone and amid 7 others (other tokens, lengths and chunk sizes,
    joining and leaving), with prefill chunks and decode steps, equal the whole prefill's."""
    tokens = tiny4.tie_free_ids(280, seed=41)
    mine = [37, 37, 26] + [1] * 180
    cfg = dict(max_num_batched_tokens=4096, max_num_seqs=8, num_pages=32)
    eng = tiny4.engine(**cfg)
    alone_req = stepper.request(tokens)
    alone = torch.cat([stepper.step(eng, [(alone_req, n)])[0] for n in mine])

    eng = tiny4.engine(**cfg)
    rng = random.Random(1)
    me = stepper.request(tokens)
    others = [stepper.request(tiny4.ids(rng.randint(120, 330), seed=500 + i)) for i in range(7)]
    batched = []
    for n in mine:
        live = [o for o in others if o.num_computed < o.num_tokens]
        work = [(o, min(rng.choice([1, 1, 2, 5, 17, 40]), o.num_tokens - o.num_computed)) for o in live]
        k = len(work) // 2
        batched.append(stepper.step(eng, work[:k] + [(me, n)] + work[k:])[k])
        for o in live:
            if o.num_computed == o.num_tokens:
                eng.cache.release(o)
    positions = range(len(tokens))
    h.assert_rows_close(torch.cat(batched), alone, positions, "batched vs alone")
    h.assert_rows_close(alone, ref(tokens), positions, "alone vs whole prefill")


def test_speculative_verify_with_rollback(tiny4, ref, h, stepper):
    """Verify steps of S + 1 tokens (the last token and S drafts, some wrong), each followed by
    a rewind over the rejected drafts: every kept position equals the whole prefill's."""
    tokens = tiny4.tie_free_ids(220, seed=21)
    prompt, rng = 40, random.Random(0)
    eng = tiny4.engine(spec_slots=S, max_num_batched_tokens=512, max_num_seqs=2, num_pages=4)
    filler = stepper.request(tiny4.ids(8, seed=5))     # holds a page: the request's C4 rows are not its entries
    stepper.step(eng, [(filler, 8)])
    req = stepper.request(tokens[:prompt])
    kept = dict(zip(range(prompt), stepper.run(eng, req, [prompt])))
    assert eng.cache.seq(req).pages[0] != 0
    rewinds = 0
    while req.num_computed < len(tokens):
        n = req.num_computed
        width = min(S + 1, len(tokens) - n)
        accept = rng.randint(0, width - 1)
        req.prompt_token_ids = tokens[:n] + [t if i <= accept else (t + 7) % tiny4.cfg.vocab_size
                                             for i, t in enumerate(tokens[n:n + width])]
        rows = stepper.step(eng, [(req, width)])[0]
        kept.update({n + i: rows[i] for i in range(accept + 1)})
        req.num_computed = n + accept + 1
        rewinds += accept + 1 < width
    assert rewinds >= 20
    positions = sorted(kept)
    assert positions == list(range(len(tokens)))
    h.assert_rows_close(torch.stack([kept[p] for p in positions]), ref(tokens), positions, "verify + rollback")


def test_padded_decode_steps_equal_plain_ones(tiny4, h):
    """Decode steps padded to CUDA-graph shapes (padding rows read empty ranges: their offsets
    are all -1) give the plain steps' tokens and logprobs; here the padded step runs eagerly,
    on a GPU the same step is captured and replayed (the offsets are then a tensor of the
    graph's pool, written whole by the producer every replay)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, tiny4.cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 120, 126, 250, 61)]
    config = dict(max_num_batched_tokens=64, max_num_seqs=6, num_pages=24, async_scheduling="off")
    plain = h.greedy_outputs(tiny4.engine(**config), prompts, 24, logprobs=0)
    padded_engine = tiny4.engine(**config)
    padded_engine.runner.graphs = graphs = StepGraphs(tiny4.model, padded_engine.runner.storage, max_bs=8,
                                                      capture=False)
    calls = []
    run = graphs.run
    graphs.run = lambda seqs, fill=None: calls.append(len(seqs)) or run(seqs, fill)
    padded = h.greedy_outputs(padded_engine, prompts, 24, logprobs=0)
    assert calls and max(calls) == 5
    for a, b in zip(plain, padded):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            (ta, va), (tb, vb) = next(iter(la.items())), next(iter(lb.items()))
            assert ta == tb and abs(va - vb) < 1e-4


def test_engine_override_builds_the_index_cache_model(tiny4, h, plain_path):
    """--index-topk-freq 4 on a checkpoint without IndexCache: the engine's model is the freq-4
    model (same greedy tokens as an engine given that model); a model built elsewhere cannot
    take overrides."""
    prompts = [tiny4.ids(n, seed=n) for n in (90, 200)]
    eng = LLMEngine(plain_path, EngineConfig(index_topk_freq=4, max_num_seqs=2, num_pages=8))
    assert eng.cfg.index_topk_pattern == "FSSS" and eng.cfg == tiny4.cfg
    got = [o.token_ids for o in h.greedy_outputs(eng, prompts, 24, logprobs=0)]
    assert got == [o.token_ids for o in h.greedy_outputs(tiny4.engine(max_num_seqs=2, num_pages=8), prompts, 24,
                                                          logprobs=0)]
    plain = LLMEngine(plain_path, EngineConfig(max_num_seqs=2, num_pages=8))
    assert plain.cfg.index_topk_pattern == ""
    with pytest.raises(ConfigError, match="index_topk_freq"):
        LLMEngine(plain_path, EngineConfig(index_topk_freq=4), model=tiny4.model)
