"""Greedy output with speculative decoding equals greedy output without it (invariant 5),
token for token, with the same finish reasons, texts and logprobs (docs/architecture.md, Speculative decoding): MTP
k = 1..4 on mixed batches whose prefills are chunked into the same steps as verifies; drafts
that are accepted in runs of every length (scripted drafts); stop tokens, stop strings and
max_tokens reached inside an accepted run; an abort while a request has drafts in flight;
preemption by recompute. Every page and slot comes back."""
from __future__ import annotations

import random

import pytest

from dsv4.engine.engine import LLMEngine
from dsv4.config import EngineConfig
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def workload(tiny, sp, stop_token: int | None = None):
    """Mixed arrivals and lengths; a budget of 64 tokens chunks the longer prefills into steps
    that also verify the earlier requests' drafts. 'e' samples (not compared: its draws differ
    with drafts), to show it does not disturb the greedy ones."""
    ids = lambda n, s: tiny.ids(n, seed=s)     # noqa: E731
    return [sp.Req("a", ids(5, 1), greedy(20, ignore_eos=True, logprobs=2)),
            sp.Req("b", ids(40, 2), greedy(25, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2)),
            sp.Req("c", ids(70, 3), greedy(18, min_tokens=5), arrival=2),
            sp.Req("d", ids(130, 4), greedy(16, stop_token_ids=[stop_token] if stop_token is not None else None),
                   arrival=3),
            sp.Req("e", ids(17, 5), SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=14), arrival=3),
            sp.Req("f", ids(66, 6), greedy(15, ignore_eos=True, prompt_logprobs=1), arrival=6)]


GREEDY = ["a", "b", "c", "d", "f"]


@pytest.fixture(scope="module")
def plain(tiny, sp):
    """The plain run, then again with 'd' stopping on its sixth token."""
    first = sp.drive(tiny.engine(**ENGINE), workload(tiny, sp))
    stop = first["d"].token_ids[5]
    run = sp.drive(tiny.engine(**ENGINE), workload(tiny, sp, stop))
    assert run["d"].finish_reason == "stop" and len(run["d"].token_ids) <= 6
    return run, stop


def _mixed_steps(engine) -> list:
    """Record per step whether it verified drafts beside a prefill chunk that does not complete."""
    mixed, execute = [], engine.runner.execute

    def spy(chunks, prev=None, *fills):
        verify = any((c.num_logits or 0) > 1 for c in chunks)
        prefill = any(not c.completes for c in chunks)
        mixed.append(verify and prefill)
        return execute(chunks, prev, *fills)
    engine.runner.execute = spy
    return mixed


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_greedy_equals_plain(tiny, h, sp, plain, k):
    want, stop = plain
    eng = tiny.engine(speculative_config=sp.spec(k), **ENGINE)
    assert eng.config.spec_slots == k and eng.layout.with_mtp and not eng.async_scheduling
    initial = h.free_counts(eng)
    mixed = _mixed_steps(eng)
    got = sp.drive(eng, workload(tiny, sp, stop), check=True)
    sp.assert_same_outputs(got, want, GREEDY)
    assert got["e"].finish_reason == "length" and len(got["e"].token_ids) == 14
    assert any(mixed), "no step verified drafts beside a chunked prefill"
    stats = eng.spec.stats
    assert stats.num_drafts > 20 and stats.num_draft_tokens >= stats.num_drafts
    assert len(stats.accepted_per_pos) == k
    assert h.free_counts(eng) == initial


@pytest.mark.parametrize("k", [2, 4])
def test_scripted_drafts_accepted_in_runs_of_every_length(tiny, h, sp, plain, k):
    """Drafts read from the plain run, a quarter of them wrong: verifies accept 0..k drafts."""
    want, stop = plain
    eng = tiny.engine(speculative_config=sp.spec(k), **ENGINE)
    truth = {r.rid: r.prompt + want[r.rid].token_ids for r in workload(tiny, sp) if r.rid in want}
    truth["e"] = []
    rng = random.Random(k)
    wrongs = {(rid, p): rng.random() < 0.25 for rid, seq in truth.items() for p in range(len(seq) + 40)}
    eng.spec.proposer = sp.ScriptedProposer(truth, lambda rid, p: wrongs.get((rid, p), True), tiny.cfg.vocab_size)
    lengths = []
    record = eng.spec.stats.record
    eng.spec.stats.record = lambda drafted, accepted: lengths.append((drafted, accepted)) or record(drafted, accepted)
    got = sp.drive(eng, workload(tiny, sp, stop), check=True)
    sp.assert_same_outputs(got, want, GREEDY)
    accepted = {a for d, a in lengths if d == k}
    assert accepted == set(range(k + 1)), f"accepted run lengths seen: {sorted(accepted)}"
    stats = eng.spec.stats
    assert 1.5 < stats.mean_acceptance_length < k + 1
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)


def test_stops_and_max_tokens_inside_an_accepted_run(tiny, h, sp):
    """Every draft right (k = 4): a stop token, a stop string and max_tokens each end a request
    inside a run of accepted drafts; the tokens after the end are dropped, as without drafts."""
    prompt = tiny.ids(12, seed=31)
    probe = _char_engine(tiny, sp, None)
    base = sp.drive(probe, [sp.Req("p", prompt, greedy(12, ignore_eos=True))])["p"]
    text = CharTokenizerText(base.token_ids)
    stop_token = next(t for i, t in enumerate(base.token_ids) if 2 <= i <= 4 and t not in base.token_ids[:i])
    stop_str = next(text[i:i + 2] for i in range(2, 5) if text.find(text[i:i + 2]) == i)
    reqs = [sp.Req("tok", prompt, greedy(12, ignore_eos=True, stop_token_ids=[stop_token], logprobs=1)),
            sp.Req("str", prompt, greedy(12, ignore_eos=True, stop=[stop_str])),
            sp.Req("str+", prompt, greedy(12, ignore_eos=True, stop=[stop_str], include_stop_str_in_output=True)),
            sp.Req("len", prompt, greedy(6, ignore_eos=True, logprobs=0))]
    want = sp.drive(_char_engine(tiny, sp, None), reqs)
    eng = _char_engine(tiny, sp, sp.spec(4))
    initial = h.free_counts(eng)
    eng.spec.proposer = sp.ScriptedProposer({r.rid: prompt + base.token_ids for r in reqs}, lambda rid, p: False,
                                            tiny.cfg.vocab_size)
    got = sp.drive(eng, reqs, check=True)
    sp.assert_same_outputs(got, want)
    assert got["tok"].finish_reason == "stop" and got["tok"].stop_reason == stop_token
    assert got["str"].stop_reason == stop_str and not got["str"].text.endswith(stop_str)
    assert got["str+"].text.endswith(stop_str)
    assert got["len"].finish_reason == "length" and len(got["len"].token_ids) == 6
    # one prefill token, then one verify of 4 accepted drafts + the bonus ends every request
    assert eng.spec.stats.num_drafts == 4 and eng.spec.stats.num_accepted_tokens == 16
    assert h.free_counts(eng) == initial


def CharTokenizerText(ids: list[int]) -> str:  # noqa: N802 - the text the CharTokenizer gives
    return "".join(chr(ord("a") + t % 26) for t in ids)


def _char_engine(tiny, sp, spec):
    return LLMEngine(tiny.path, EngineConfig(speculative_config=spec, **ENGINE), model=tiny.model,
                     tokenizer=sp.CharTokenizer())


def test_abort_while_drafts_are_in_flight(tiny, h, sp, plain):
    """'b' is aborted when it holds drafts (after step 4): the others' outputs are unchanged and
    every page returns."""
    want_all, stop = plain
    want = sp.drive(tiny.engine(**ENGINE), workload(tiny, sp, stop), abort_at=("b", 4))
    eng = tiny.engine(speculative_config=sp.spec(3), **ENGINE)
    truth = {r.rid: r.prompt + want_all[r.rid].token_ids for r in workload(tiny, sp)}
    eng.spec.proposer = sp.ScriptedProposer(truth, lambda rid, p: p % 3 == 0, tiny.cfg.vocab_size)
    initial = h.free_counts(eng)
    seen = []
    got = sp.drive(eng, workload(tiny, sp, stop), check=True, abort_at=("b", 4),
                   on_step=lambda e, s: s == 3 and seen.append(list(e.requests["b"].spec_token_ids)))
    assert seen and seen[0], "'b' had no drafts when it was aborted"
    assert "b" not in got
    sp.assert_same_outputs(got, want, ["a", "c", "d", "f"])
    assert h.free_counts(eng) == initial and not eng.spec._draft_probs


def test_preemption_with_drafts(tiny, h, sp):
    """Three long requests on 3 history pages: the newest are preempted (their drafts dropped,
    their state recomputed) and every request still gets the plain run's tokens."""
    reqs = [sp.Req(str(i), tiny.ids(n, seed=100 + n), greedy(60, ignore_eos=True, logprobs=1))
            for i, n in enumerate((200, 180, 150))]
    config = dict(max_num_batched_tokens=256, max_num_seqs=3, num_pages=3)
    want = sp.drive(tiny.engine(**config), reqs)
    eng = tiny.engine(speculative_config=sp.spec(2), **config)
    initial = h.free_counts(eng)
    preempted = []
    got = sp.drive(eng, reqs, check=True, on_step=lambda e, s: preempted.extend(
        r.request_id for r in e.scheduler.waiting if r.num_preemptions))
    assert preempted, "the cache is small enough to preempt"
    sp.assert_same_outputs(got, want)
    assert h.free_counts(eng) == initial
