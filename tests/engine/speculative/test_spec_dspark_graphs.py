"""DSpark speculative steps through the CUDA-graph shapes (run eagerly here with capture=False,
captured on a GPU): uniform verify steps replay the padded verify graph, which also outputs the
taps (engine/cuda_graphs.py), and their drafts the padded DSpark draft graph
(speculative/dspark_graphs.py: window keys, block, Markov and confidence heads). Invariant 5:
greedy tokens with graphs equal the eager DSpark run's and plain decoding's, at batch 1 and in
mixed batches, the drafts equal the eager drafter's at every anchor, and a request ending inside
an accepted run ends as without drafts. Greedy drafts stay on the device between steps."""
from __future__ import annotations

import pytest

from dsv4.engine.speculative.dspark_graphs import DSparkGraphs
from dsv4.sampling_params import SamplingParams

import graph_paths
from test_spec_dspark import ENGINE, SteeredProposer, dspark, greedy, tiny  # noqa: F401  (tiny: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def with_graph_shapes(eng, graphs=DSparkGraphs) -> dict:
    return graph_paths.with_graph_shapes(eng, graphs)


def record_drafts(eng) -> dict:
    """(rid, anchor position) -> the drafts the drafter proposed there (read back for the test)."""
    seen, propose = {}, eng.spec.proposer.propose

    def spy(works, taps, batch_of):
        out = propose(works, taps, batch_of)
        for w, (d, _) in zip([w for w in works if w.tokens and w.num_drafts > 0], out):
            seen[(w.request.request_id, w.start + w.anchor)] = d.tolist()
        return out
    eng.spec.proposer.propose = spy
    return seen


def batch_one(tiny, sp):
    return [sp.Req("solo", tiny.ids(23, 11), greedy(24))]


def mixed(tiny, sp):
    """Greedy requests of several lengths and ends, arriving over time (chunked prefills beside
    verify steps), and one sampling request (its steps draft eagerly)."""
    ids = tiny.ids
    return [sp.Req("a", ids(9, 1), greedy(21)), sp.Req("b", ids(40, 2), greedy(26)),
            sp.Req("c", ids(70, 3), greedy(17), arrival=2), sp.Req("d", ids(5, 4), greedy(9), arrival=4),
            sp.Req("e", ids(17, 5), SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=12), arrival=9)]


@pytest.mark.parametrize("make", [batch_one, mixed])
def test_dspark_graphs_equal_eager_and_plain(tiny, h, sp, make):
    reqs = make(tiny, sp)
    plain = sp.drive(tiny.engine(**ENGINE), reqs)
    runs, drafts = {}, {}
    for graphs in (False, True):
        eng = tiny.engine(speculative_config=dspark(3), **ENGINE)
        calls = with_graph_shapes(eng) if graphs else None
        initial = h.free_counts(eng)
        drafts[graphs] = record_drafts(eng)
        runs[graphs] = sp.drive(eng, reqs, check=True)
        assert h.free_counts(eng) == initial
    greedy_rids = [r.rid for r in reqs if r.params.temperature == 0]
    sp.assert_same_outputs(runs[False], plain, greedy_rids)
    sp.assert_same_outputs(runs[True], plain, greedy_rids)
    assert drafts[True] == drafts[False] and len(drafts[True]) >= 8
    assert calls["verify"] >= 5 and calls["draft"] >= 5 and calls["held"] >= calls["draft"], calls


class SteeredGraphs(DSparkGraphs):
    """The padded DSpark draft graph (window keys, block and heads all run) with each draft's
    Markov-corrected logits pushed towards the plain run's token: every draft right."""
    truth: dict[str, list[int]] = {}

    def run(self, works, taps):
        self._works = works
        return super().run(works, taps)

    def _pick(self, logits, i):
        logits = logits.clone()
        for r, w in enumerate(self._works):
            seq, p = self.truth[w.request.request_id], w.start + w.anchor + 2 + i
            if p < len(seq):
                logits[r, seq[p]] += 1e6
        return super()._pick(logits, i)


@pytest.mark.parametrize("together", [False, True])
def test_dspark_graphs_end_inside_an_accepted_run(tiny, h, sp, together):
    """Every draft right (k = 3): a stop token ends one request inside a run of accepted drafts
    verified after a graph draft, max_tokens others at a run's end; tokens past the end are
    dropped, as without drafts. Alone (batch 1) or all at once beside a later prefill."""
    prompt = tiny.ids(12, seed=31)
    base = sp.drive(tiny.engine(**ENGINE), [sp.Req("p", prompt, greedy(16))])["p"].token_ids
    stop = next(t for i, t in enumerate(base) if 5 <= i and i % 4 != 0 and t not in base[:i])
    reqs = [sp.Req("tok", prompt, greedy(16, stop_token_ids=[stop])), sp.Req("len", prompt, greedy(9)),
            sp.Req("long", prompt, greedy(16)), sp.Req("late", tiny.ids(30, 7), greedy(10), arrival=2)]
    want = sp.drive(tiny.engine(**ENGINE), reqs)
    truth = {r.rid: prompt + base for r in reqs[:3]} | {"late": list(reqs[3].prompt) + want["late"].token_ids}
    got = {}
    for group in ([reqs] if together else [[r] for r in reqs]):
        eng = tiny.engine(speculative_config=dspark(3), **ENGINE)
        eng.spec.proposer = SteeredProposer(eng.spec.proposer, truth, lambda rid, p: False)   # (eager drafts)
        calls = with_graph_shapes(eng, type("Steered", (SteeredGraphs,), {"truth": truth}))
        initial = h.free_counts(eng)
        got |= sp.drive(eng, group, check=True)
        stats = eng.spec.stats
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0      # every draft accepted
        assert calls["draft"] >= 1 and h.free_counts(eng) == initial, calls
    sp.assert_same_outputs(got, want)
    assert got["tok"].finish_reason == "stop" and got["tok"].token_ids[-1] == stop
    assert len(got["tok"].token_ids) < len(want["long"].token_ids)
    assert got["len"].finish_reason == "length" and len(got["len"].token_ids) == 9


def test_dspark_graphs_confidence_threshold(tiny, sp):
    """With a confidence threshold the graph's confidence logits cut the drafts (read back, not
    held on the device): fewer drafts verified than without, the same greedy output."""
    reqs = mixed(tiny, sp)[:4]
    plain = sp.drive(tiny.engine(**ENGINE), reqs)
    stats = {}
    for threshold in (0.0, 0.5):
        eng = tiny.engine(speculative_config=dspark(3, confidence_threshold=threshold), **ENGINE)
        calls = with_graph_shapes(eng)
        sp.assert_same_outputs(sp.drive(eng, reqs, check=True), plain)
        assert calls["draft"] >= 5 and (calls["held"] > 0) == (threshold == 0), calls
        stats[threshold] = eng.spec.stats
    assert 0 < stats[0.5].num_draft_tokens < stats[0.0].num_draft_tokens


def test_draft_graph_writes_committed_rows_only(tiny, sp):
    """The graph writes the window keys of a verify step's rows up to each request's anchor and
    sends the rejected rows' and the padding rows' writes to the scratch page."""
    eng = tiny.engine(speculative_config=dspark(3), **ENGINE)
    calls = with_graph_shapes(eng)
    graphs, seen = eng.spec.proposer.graphs, []
    inputs = graphs._inputs

    def spy(works, q):
        packed, shapes = inputs(works, q)
        B = shapes[0].seqs
        seen.append(([w.anchor for w in works], packed[B * q:2 * B * q].reshape(B, q), B))
        return packed, shapes
    graphs._inputs = spy
    sp.drive(eng, mixed(tiny, sp)[:3])
    scratch = eng.runner.storage.scratch_swa_page * eng.layout.swa_pitch
    assert calls["draft"] == len(seen) >= 5
    for anchors, write, B in seen:
        for r in range(B):
            last = anchors[r] if r < len(anchors) else -1
            assert (write[r, last + 1:] == scratch).all() and (write[r, :last + 1] != scratch).all()
    assert any(min(a) < 3 for a, _, _ in seen)


def test_dspark_graphs_with_fp8_kv(tiny, h, sp):
    """Packed FP8 KV: the graph writes the window keys packed (committed rows only) and the block
    reads them as the eager drafter does; greedy output equals a plain FP8 engine's."""
    fp8 = dict(ENGINE, kv_cache_dtype="fp8")
    reqs = mixed(tiny, sp)[:4]
    want = sp.drive(tiny.engine(**fp8), reqs)
    eng = tiny.engine(speculative_config=dspark(3), **fp8)
    calls = with_graph_shapes(eng)
    initial = h.free_counts(eng)
    sp.assert_same_outputs(sp.drive(eng, reqs, check=True), want)
    assert calls["verify"] >= 5 and calls["draft"] >= 5, calls
    assert h.free_counts(eng) == initial
