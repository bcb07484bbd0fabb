"""The prefix cache under data-parallel attention (dsv4/engine/data_parallel.py): `LLMEngine`
with data_parallel_size 2 (rank 1 a spawned process) and a prefix tree per rank. A resent prompt
goes to the rank whose tree holds it, although the other rank is as idle, and resumes there
(the checkpoint restored into that rank's own storage); a prompt of another prefix goes to the
other rank; greedy tokens equal one process without a prefix cache (invariant 5); the metrics
sum the ranks; `reset_prefix_cache` clears every rank's tree and the pages come back."""
from __future__ import annotations

import pytest

from dsv4.cache.layout import PAGE_TOKENS
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams
from ranks import MODEL, SMALL, prompts

DP = dict(data_parallel_size=2, enable_expert_parallel=True, enable_prefix_caching=True)
PROMPT = prompts([530], seed=21)[0]         # two whole pages: a resend resumes at 512
# the first wave puts "x" on rank 0 and "a" on rank 1; the second resends "a"'s prompt (both
# ranks idle: only the hit sends it to rank 1) beside "c", a prompt no tree holds
WAVES = [{"x": prompts([300], seed=22)[0], "a": PROMPT}, {"a2": PROMPT, "c": prompts([300], seed=23)[0]}]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def _run_waves(engine: LLMEngine, on_wave=None) -> tuple[dict, dict, dict]:
    """Each wave added at once and run to the end -> (tokens, num_cached_tokens, rank) by request id."""
    tokens, cached, rank = {}, {}, {}
    for wave in WAVES:
        for rid, prompt in wave.items():
            engine.add_request(rid, prompt, PARAMS)
            rank[rid] = getattr(engine.cache, "rank_of", {}).get(rid, 0)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id], cached[out.request_id] = out.token_ids, out.num_cached_tokens
        if on_wave is not None:
            on_wave()
    return tokens, cached, rank


@pytest.fixture(scope="module")
def one_process_without_prefix_cache():
    engine = LLMEngine(MODEL, EngineConfig(**SMALL))
    try:
        return _run_waves(engine)[0]
    finally:
        engine.close()


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_dp2_prefix_cache_hits_on_the_rank_holding_the_prefix(one_process_without_prefix_cache, async_scheduling):
    engine = LLMEngine(MODEL, EngineConfig(**{**SMALL, **DP, "async_scheduling": async_scheduling}))
    try:
        ranks = engine.cache.ranks
        initial = [c.usage() for c in ranks]
        trees = []                                  # per wave, each rank's prefix pages after it
        tokens, cached, rank = _run_waves(engine, lambda: trees.append([c.prefix.num_pages for c in ranks]))

        assert tokens == one_process_without_prefix_cache, "greedy tokens differ from one process"
        assert rank == {"x": 0, "a": 1, "a2": 1, "c": 0}, rank
        assert trees[0] == [1, 2], "after the first wave rank 0 holds x's page, rank 1 a's two"
        assert cached["a2"] >= (len(PROMPT) // PAGE_TOKENS - 1) * PAGE_TOKENS, cached
        assert cached["x"] == cached["a"] == cached["c"] == 0, cached
        queries, hits, pages = engine.prefix_stats()
        assert queries == sum(len(p) for wave in WAVES for p in wave.values())
        assert hits == cached["a2"] and pages == sum(trees[1]) > 0
        assert engine.cache.available_pages() == sum(c.plan.num_pages for c in ranks)   # tree pages reclaimable

        assert engine.reset_prefix_cache() == sum(trees[1])
        assert [c.prefix.num_pages for c in ranks] == [0, 0] and engine.prefix_stats()[2] == 0
        assert [c.usage() for c in ranks] == initial, "pages, SWA pages or slots left held"
    finally:
        engine.close()
