"""The offline API `LLM(model=DIR).generate(...)`: results, sampling options, errors that
leave the engine clean, and the memory report."""
from __future__ import annotations

import pytest
import torch

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.llm import LLM
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = dict(max_num_batched_tokens=64, max_num_seqs=8, num_pages=16)


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny.path, **SETTINGS)


def assert_idle_and_empty(llm):
    eng = llm.engine
    assert not eng.has_unfinished() and not eng.requests
    assert eng.cache.available_pages() == eng.plan.num_pages
    assert eng.cache.swa.num_free == eng.plan.num_swa_pages
    assert len(eng.cache.free_slots) == eng.plan.max_num_seqs


def test_generate_greedy_matches_reference_in_prompt_order(tiny, h, llm):
    prompts = [tiny.tie_free_ids(n, seed=90 + n) for n in (7, 130, 45)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(60), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert len({o.request_id for o in outs}) == 3
    for p, o in zip(prompts, outs):
        assert o.finished and o.finish_reason == "length" and len(o.token_ids) == 60
        ties = tiny.ties(p + o.token_ids)
        compared = h.check_greedy_against_reference(o.token_ids, tiny.ref_logits(p + o.token_ids), len(p),
                                                    ties[0] if ties else None)
        assert compared >= 30
    assert_idle_and_empty(llm)


@pytest.mark.parametrize("budget", [1, 7, 512])
def test_logprobs_and_prompt_logprobs_match_reference(tiny, h, budget):
    """Every prompt position gets its logprobs whatever the chunking (1-token chunks too: the
    prompt of 148 ends with a 1-token chunk under a budget of 7)."""
    llm = LLM(tiny.path, max_num_batched_tokens=budget, max_num_seqs=2, num_pages=4)
    prompt = tiny.tie_free_ids(148, seed=95)
    [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(20, logprobs=3, prompt_logprobs=2),
                         use_tqdm=False)
    ref = torch.log_softmax(tiny.ref_logits(prompt + out.token_ids), dim=-1)
    tol = h.REL_TOL * float(tiny.ref_logits(prompt + out.token_ids).abs().max())
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert prompt[pos] in entry and len(entry) >= 2
        for tok, lp in entry.items():
            assert abs(lp - float(ref[pos - 1, tok])) <= tol, (pos, tok)
    assert len(out.logprobs) == 20
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in entry and entry[tok] == max(entry.values())        # greedy: the top one
        assert abs(entry[tok] - float(ref[len(prompt) - 1 + i, tok])) <= tol


def test_n_samples_with_seeds_are_reproducible(tiny, llm):
    prompt = tiny.ids(30, seed=96)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert len(first) == 3 and [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) > 1, "the n samples used the same seed"


def test_stop_token_finishes_with_stop(tiny, llm):
    prompt = tiny.ids(30, seed=97)
    [free] = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(30), use_tqdm=False)
    stop = free.token_ids[10]
    first = free.token_ids.index(stop)
    [out] = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(30, stop_token_ids=[stop]),
                         use_tqdm=False)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == free.token_ids[:first + 1]
    assert_idle_and_empty(llm)


def test_per_prompt_sampling_params(tiny, llm):
    prompts = [tiny.ids(10, seed=98), tiny.ids(12, seed=99)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[greedy(3), greedy(7)], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 7]
    with pytest.raises(ValueError, match=r"^sampling_params: 1 given for 2 prompts"):
        llm.generate(prompt_token_ids=prompts, sampling_params=[greedy(3)], use_tqdm=False)
    assert_idle_and_empty(llm)


def test_prompt_arguments_are_checked(llm):
    with pytest.raises(ValueError, match=r"^prompts: give exactly one"):
        llm.generate(use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts: give exactly one"):
        llm.generate("hello", prompt_token_ids=[[1, 2]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts: .*no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    assert_idle_and_empty(llm)


def test_unknown_engine_setting_is_a_type_error(tiny):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(tiny.path, max_num_sequences=4)


def test_bad_prompt_among_good_ones_leaves_nothing_behind(tiny, llm):
    """One bad prompt fails the whole call before anything runs, and none of the call's good
    prompts stays queued in the engine (they would be run, unseen, by the next call)."""
    good = [tiny.ids(10, seed=100), tiny.ids(10, seed=101)]
    with pytest.raises(ValueError, match=r"^prompt_token_ids: "):
        llm.generate(prompt_token_ids=[good[0], good[1], [1, 10_000]], sampling_params=greedy(5), use_tqdm=False)
    assert_idle_and_empty(llm)
    with pytest.raises(ValueError, match=r"^top_p: "):
        llm.generate(prompt_token_ids=good, sampling_params=[greedy(5), SamplingParams(top_p=2.0)],
                     use_tqdm=False)
    assert_idle_and_empty(llm)
    for n in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"^n: "):
            llm.generate(prompt_token_ids=good, sampling_params=[greedy(5), SamplingParams(n=n)], use_tqdm=False)
    assert_idle_and_empty(llm)
    outs = llm.generate(prompt_token_ids=good, sampling_params=greedy(5), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [5, 5]


def test_failure_during_generate_aborts_its_requests(tiny, llm, monkeypatch):
    eng = llm.engine
    real_step, calls = eng.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(eng, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(prompt_token_ids=[tiny.ids(80, seed=102), tiny.ids(5, seed=103)],
                     sampling_params=greedy(10), use_tqdm=False)
    monkeypatch.undo()
    assert_idle_and_empty(llm)


def test_memory_report_states_pages_tokens_and_requests(tiny):
    llm = LLM(tiny.path, max_num_batched_tokens=64, max_num_seqs=8, num_pages=16, max_model_len=1000)
    report = llm.engine.memory_report()
    assert "16 history pages x 256 tokens = 4096 tokens" in report
    assert "8 request slots" in report
    assert f"{llm.engine.plan.num_swa_pages} sliding-window pages" in report
    assert "4 request(s) of max_model_len 1000 fit at once" in report    # 1000 tokens = 4 pages each
    # the plan `dsv4 plan` prints, its workspace included (beside the cache: --num-pages sized it)
    assert "workspace (beside the cache: its size was given):" in report
    assert "indexer prefill scores" in report and "step activations" in report

    few_slots = LLM(tiny.path, max_num_batched_tokens=64, max_num_seqs=2, num_pages=16, max_model_len=1000)
    assert "2 request(s) of max_model_len 1000 fit at once" in few_slots.engine.memory_report()   # slots bound

    budget = LLM(tiny.path, max_num_batched_tokens=64, max_num_seqs=8, cache_memory_gb=0.01)
    plan = budget.engine.plan
    assert plan.num_pages > 16
    assert f"{plan.num_pages} history pages x 256 tokens = {plan.num_pages * 256} tokens" in \
        budget.engine.memory_report()


def test_seeded_sampling_does_not_depend_on_the_batch_or_preemption(tiny, h, llm):
    """A seeded sampled request draws the same tokens alone, in a batch with unseeded
    requests, and when it is preempted (recompute) on a cache too small for the batch."""
    prompt = tiny.ids(40, seed=104)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=42, max_tokens=120, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[prompt], sampling_params=seeded, use_tqdm=False)[0].token_ids

    eng = LLMEngine(tiny.path, EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, num_pages=3),
                    model=tiny.model)
    # a (200 + 130 tokens) and b (150 + 100) grow to two 256-token pages each, the seeded request needs one: more
    # than the 3 pages there are, so the newest (seeded) is preempted
    eng.add_request("a", tiny.ids(200, seed=105), SamplingParams(temperature=1.0, max_tokens=130, ignore_eos=True))
    eng.add_request("b", tiny.ids(150, seed=106), SamplingParams(temperature=1.0, max_tokens=100, ignore_eos=True))
    eng.add_request("seeded", prompt, seeded)
    req = eng.scheduler.waiting[-1]
    done = h.drive(eng)
    assert req.num_preemptions >= 1, "the seeded request was not preempted"
    assert done["seeded"].token_ids == alone
