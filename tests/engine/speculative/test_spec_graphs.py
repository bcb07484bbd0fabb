"""Speculative steps through the CUDA-graph shapes (run eagerly here with capture=False, captured
on a GPU): uniform verify steps replay the padded verify graph (engine/cuda_graphs.py, with the
final streams kept for the drafter) and their drafts the padded draft graph
(speculative/draft_graphs.py). Greedy output still equals plain decoding, and the drafts still
equal the MTP block's predictions from scratch."""
from __future__ import annotations

import pytest

from dsv4.engine.speculative.draft_graphs import DraftGraphs
from dsv4.sampling_params import SamplingParams

import graph_paths
from test_spec_mtp_drafts import check_drafts

pytestmark = pytest.mark.usefixtures("one_thread")


def with_graph_shapes(eng) -> dict:
    return graph_paths.with_graph_shapes(eng, DraftGraphs)


@pytest.mark.parametrize("k", [1, 3])
def test_graph_shapes_keep_greedy_output(tiny, h, sp, k):
    reqs = [sp.Req(str(i), tiny.ids(n, seed=40 + n), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                                     logprobs=1))
            for i, n in enumerate((9, 62, 126))]
    config = dict(max_num_batched_tokens=256, max_num_seqs=4, num_pages=8)
    want = sp.drive(tiny.engine(**config), reqs)
    eng = tiny.engine(speculative_config=sp.spec(k), **config)
    calls = with_graph_shapes(eng)
    initial = h.free_counts(eng)
    sp.assert_same_outputs(sp.drive(eng, reqs, check=True), want)
    assert calls["verify"] >= 8 and calls["draft"] >= 8, calls
    assert h.free_counts(eng) == initial


def test_a_prefill_chunks_draft_makes_no_graph(tiny, h, sp):
    """One request at a time: each prompt length's first draft runs eagerly (a graph per prompt
    length would fill the LRU), the verify steps' drafts replay graphs keyed (bucket, q, n)."""
    k, config = 2, dict(max_num_batched_tokens=256, max_num_seqs=4, num_pages=8)
    eng = tiny.engine(speculative_config=sp.spec(k), **config)
    calls = with_graph_shapes(eng)
    for n in (9, 23, 40):
        req = sp.Req(str(n), tiny.ids(n, seed=n), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        sp.assert_same_outputs(sp.drive(eng, [req]), sp.drive(tiny.engine(**config), [req]))
    keys = list(eng.spec.proposer.graphs.graphs)
    assert calls["draft"] >= 6 and keys and all(q <= k + 1 for _, q, _ in keys), (calls, keys)


def test_graph_shapes_draft_what_the_mtp_block_predicts(demo, sp):
    from dsv4.config import EngineConfig
    from dsv4.engine.engine import LLMEngine
    k = 3
    eng = LLMEngine(demo.path, EngineConfig(speculative_config=sp.spec(k), max_num_batched_tokens=256,
                                            max_num_seqs=4, num_pages=8), model=demo.model)
    calls = with_graph_shapes(eng)
    checked = []
    reqs = [sp.Req(str(i), p, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
            for i, p in enumerate(demo.prompts[2:4])]
    sp.drive(eng, reqs, on_step=lambda e, s: check_drafts(e, demo.model, k, checked))
    assert calls["draft"] >= 5 and len(checked) >= 30, (calls, len(checked))
    assert eng.spec.stats.mean_acceptance_length > 1.8
