"""Drafts that stay on the device (engine/speculative/device_drafts.py): a plain greedy
request's drafts are never read back — its `spec_token_ids` hold placeholders, the values are
the MTP block's — while requests whose drafts the host needs (logprobs, penalties, sampling)
keep them on the host; verify steps mixing both, through the eager and the padded (graph)
paths, give the tokens of decoding without drafts (invariant 5)."""
from __future__ import annotations

import pytest

from dsv4.engine.cuda_graphs import StepGraphs
from dsv4.engine.speculative.device_drafts import PLACEHOLDER
from dsv4.engine.speculative.draft_graphs import DraftGraphs
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = dict(max_num_batched_tokens=96, max_num_seqs=4, num_pages=12)


def workload(tiny, sp):
    plain = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    return [sp.Req("plain", tiny.ids(9, seed=1), plain),
            sp.Req("plain2", tiny.ids(30, seed=2), plain, arrival=1),
            sp.Req("logprobs", tiny.ids(12, seed=3), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                                    logprobs=1)),
            sp.Req("penalty", tiny.ids(20, seed=4), SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                                                                   presence_penalty=0.5), arrival=2)]


def watch(seen: dict):
    """After each step: which requests hold drafts on the device, which on the host."""
    def on_step(eng, step):
        for req in eng.scheduler.running:
            if not req.spec_token_ids:
                continue
            values = eng.spec.drafts_of(req)
            assert len(values) == len(req.spec_token_ids) and all(0 <= t < eng.cfg.vocab_size for t in values)
            if eng.spec.device_drafts.holds(req):
                assert req.spec_token_ids == [PLACEHOLDER] * len(values), req.request_id
                seen.setdefault("device", set()).add(req.request_id)
            else:
                assert req.spec_token_ids == values, req.request_id
                seen.setdefault("host", set()).add(req.request_id)
    return on_step


@pytest.mark.parametrize("graphs", [False, True])
def test_plain_greedy_drafts_stay_on_the_device(tiny, h, sp, graphs):
    want = sp.drive(tiny.engine(**CONFIG), workload(tiny, sp))
    eng = tiny.engine(speculative_config=sp.spec(2), **CONFIG)
    if graphs:      # the padded verify and draft paths (CUDA graphs on a GPU), run eagerly
        runner = eng.runner
        runner.graphs = StepGraphs(eng.model, runner.storage, 4, capture=False, h2d=runner.h2d, keep_streams=True)
        eng.spec.proposer.graphs = DraftGraphs(eng.model, runner.storage, 4, eng.spec.k + 1, capture=False, h2d=runner.h2d)
    initial, seen = h.free_counts(eng), {}
    got = sp.drive(eng, workload(tiny, sp), check=True, on_step=watch(seen))
    sp.assert_same_outputs(got, want)
    assert seen["device"] == {"plain", "plain2"} and seen["host"] == {"logprobs", "penalty"}, seen
    assert not eng.spec.device_drafts.held and h.free_counts(eng) == initial
    assert eng.spec.stats.num_draft_tokens > 0


def test_rejected_device_drafts_are_not_emitted(tiny, h, sp):
    """Scripted drafts, every third one wrong, held on the device: accepted runs of every length
    and rejections give the plain tokens (the forward's inputs and the acceptance test read the
    same device rows)."""
    reqs = workload(tiny, sp)[:2]
    want = sp.drive(tiny.engine(**CONFIG), reqs)
    eng = tiny.engine(speculative_config=sp.spec(3), **CONFIG)
    truth = {r.rid: r.prompt + want[r.rid].token_ids for r in reqs}
    eng.spec.proposer = sp.ScriptedProposer(truth, lambda rid, p: p % 3 == 0, tiny.cfg.vocab_size)
    seen = {}
    sp.assert_same_outputs(sp.drive(eng, reqs, check=True, on_step=watch(seen)), want)
    assert seen == {"device": {"plain", "plain2"}}, seen
    stats = eng.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (stats.num_accepted_tokens, stats.num_draft_tokens)
