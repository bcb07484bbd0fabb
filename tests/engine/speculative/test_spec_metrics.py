"""Speculative-decoding metrics: the engine core's stats carry the drafter's running
totals, the API's Prometheus counters follow them (`dsv4:spec_decode_*`, vLLM's names), and
the totals agree with the tokens the requests got."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv4.engine.core import EngineCore
from dsv4.engine.ipc import AddRequest
from dsv4.sampling_params import SamplingParams
from dsv4.serve.http.metrics import ServerMetrics

pytestmark = pytest.mark.usefixtures("one_thread")


def samples(text: str) -> dict:
    return {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith("dsv4:spec_decode")}


def test_stats_and_prometheus_counters(tiny, sp):
    k = 3
    eng = tiny.engine(speculative_config=sp.spec(k), max_num_batched_tokens=128, max_num_seqs=4, num_pages=8)
    prompt = tiny.ids(20, seed=3)
    plain = sp.drive(tiny.engine(max_num_batched_tokens=128, max_num_seqs=4, num_pages=8),
                     [sp.Req(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=30 + i, ignore_eos=True))
                      for i in range(2)])
    eng.spec.proposer = sp.ScriptedProposer({rid: prompt + o.token_ids for rid, o in plain.items()},
                                            lambda rid, p: p % 5 == 0, tiny.cfg.vocab_size)
    verifies = []          # (drafted, accepted) of every completing chunk, with or without drafts
    record = eng.spec.stats.record
    eng.spec.stats.record = lambda d, a: verifies.append((d, a)) or record(d, a)
    core, metrics = EngineCore(eng), ServerMetrics("m", eng.plan.num_pages)
    for i in range(2):
        core.handle(AddRequest(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=30 + i, ignore_eos=True)))
    generated, steps = 0, 0
    while core.has_work:
        generated += sum(len(o.token_ids) for o in core.step())
        metrics.update(core.stats())
        steps += 1
    stats, s = core.stats(), eng.spec.stats
    assert (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (
        s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
    assert stats.spec_accepted_per_pos == s.accepted_per_pos and len(s.accepted_per_pos) == k
    # every completing chunk emits its accepted drafts and one more token
    assert generated == 61 == len(verifies) + s.num_accepted_tokens
    assert s.num_drafts == sum(d > 0 for d, _ in verifies) and s.num_draft_tokens == sum(d for d, _ in verifies)
    assert 1 < s.mean_acceptance_length < k + 1 and steps < 61 // 2
    got = samples(metrics.render().decode())
    assert got[("dsv4:spec_decode_num_drafts_total", None)] == s.num_drafts
    assert got[("dsv4:spec_decode_num_draft_tokens_total", None)] == s.num_draft_tokens
    assert got[("dsv4:spec_decode_num_accepted_tokens_total", None)] == s.num_accepted_tokens
    assert [got[("dsv4:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(k)] == \
        s.accepted_per_pos
    summary = s.summary()
    assert summary["spec_mean_acceptance_length"] == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    assert summary["spec_acceptance_rate_per_pos"] == [round(n / s.num_drafts, 4) for n in s.accepted_per_pos]
