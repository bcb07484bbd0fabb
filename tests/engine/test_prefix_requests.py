"""The prefix cache seen from requests (real engine steps, greedy sampling): resends and
multi-turn chats hit and generate what a cold engine (no prefix cache) generates; forks of one
prompt share its pages and resume from one checkpoint (also through padded CUDA-graph decode
steps and async scheduling); prompt-logprob requests never hit; preemption keeps committed
pages cached; `reset_prefix_cache` frees them."""
from __future__ import annotations

import pytest

from dsv4.engine.cuda_graphs import StepGraphs
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = dict(max_num_batched_tokens=512, max_num_seqs=8, num_pages=40)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def cold_tokens(tiny, h, prompt: list[int], max_tokens: int) -> list[int]:
    return cold_batch(tiny, h, {"cold": prompt}, max_tokens)["cold"]


_COLD: dict = {}


def cold_batch(tiny, h, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Greedy tokens of a cold engine (no prefix cache) for each prompt, run once per prompts
    and max_tokens (the two fork cases compare with the same cold run)."""
    key = (tuple((rid, tuple(p)) for rid, p in sorted(prompts.items())), max_tokens)
    if key not in _COLD:
        eng = tiny.engine(**SETTINGS, enable_prefix_caching=False)
        _COLD[key] = {rid: out.token_ids for rid, out in h.drive_greedy(eng, prompts, max_tokens).items()}
    return _COLD[key]


def test_resend_hits_and_generates_the_same(tiny, h):
    """The same 700-token prompt twice: the second resumes at 512 (>= (700 // 256 - 1) * 256)
    and generates the first's tokens, which are the cold engine's."""
    prompt = tiny.tie_free_ids(700, seed=301)
    eng = tiny.engine(**SETTINGS)
    first = h.drive_greedy(eng, {"a": prompt}, 40, check=True)["a"]
    second = h.drive_greedy(eng, {"b": prompt}, 40, check=True)["b"]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 512
    assert second.num_cached_tokens >= (len(prompt) // 256 - 1) * 256
    assert first.token_ids == second.token_ids == cold_tokens(tiny, h, prompt, 40)
    queries, hits, pages = eng.prefix_stats()
    assert (queries, hits) == (1400, 512) and pages >= 2


def test_a_prompt_ending_on_a_page_boundary(tiny, h):
    """A 768-token prompt prefilled in one chunk: its resend resumes one page earlier (512, the
    staged boundary; at least one token must be computed) and a longer prompt at 768 (taken
    from the ring at the chunk's end); both generate the cold engine's tokens."""
    prompt = tiny.tie_free_ids(808, seed=305)
    eng = tiny.engine(**{**SETTINGS, "max_num_batched_tokens": 1024})
    h.drive_greedy(eng, {"a": prompt[:768]}, 8, check=True)
    resend = h.drive_greedy(eng, {"b": prompt[:768]}, 8, check=True)["b"]
    longer = h.drive_greedy(eng, {"c": prompt}, 8, check=True)["c"]
    assert (resend.num_cached_tokens, longer.num_cached_tokens) == (512, 768)
    cold = cold_batch(tiny, h, {"b": prompt[:768], "c": prompt}, 8)
    assert resend.token_ids == cold["b"] and longer.token_ids == cold["c"]


def test_multi_turn_reuses_the_previous_prompt_and_answer(tiny, h):
    """Three turns, each prompt = the previous prompt + its answer + 80 new tokens: turn k + 1
    resumes at the last page boundary the previous turn's prompt and answer reached (turn 0's
    answer crosses 512 while decoding: that boundary was checkpointed then), and every turn
    generates the cold engine's tokens."""
    eng = tiny.engine(**SETTINGS, async_scheduling="on")
    prompt, reached = tiny.tie_free_ids(460, seed=311), None
    for turn in range(3):
        out = h.drive_greedy(eng, {f"t{turn}": prompt}, 60, check=True)[f"t{turn}"]
        if reached is not None:
            assert out.num_cached_tokens == reached // 256 * 256 == 512
        assert out.token_ids == cold_tokens(tiny, h, prompt, 60), f"turn {turn}"
        reached = len(prompt) + len(out.token_ids) - 1         # the last token's KV is never written
        prompt = prompt + out.token_ids + tiny.ids(80, seed=320 + turn)


@pytest.mark.parametrize("padded, async_scheduling", [(False, "off"), (True, "on")])
def test_forks_share_pages_and_resume_from_one_checkpoint(tiny, h, padded, async_scheduling):
    """Four requests of one 600-token prompt added together: one prefills it, the others wait
    for it and resume at 512 from its checkpoint; while they run, their pages of [0, 512) are
    the same physical pages and their SWA pages and slots their own. All four generate the cold
    engine's tokens (with padded, graph-shaped decode steps and async scheduling too)."""
    prompt = tiny.tie_free_ids(600, seed=331)
    eng = tiny.engine(**SETTINGS, async_scheduling=async_scheduling)
    if padded:
        eng.runner.graphs = StepGraphs(eng.model, eng.runner.storage, max_bs=8, capture=False)
    seen = []

    def look(engine, step):
        held = [engine.cache.seq(r) for r in engine.scheduler.running]
        if len(held) == 4 and all(len(s.pages) >= 3 for s in held):
            seen.append(held)

    outs = h.drive_greedy(eng, {f"f{i}": prompt for i in range(4)}, 30, check=True, on_step=look)
    assert sorted(o.num_cached_tokens for o in outs.values()) == [0, 512, 512, 512]
    assert seen, "the four never ran together"
    held = seen[0]
    assert len({tuple(s.pages[:2]) for s in held}) == 1, "history pages of the prompt not shared"
    assert len({s.pages[2] for s in held}) == 4 and len({s.slot for s in held}) == 4
    swa = [p for s in held for p in s.swa_pages if p >= 0]
    assert len(set(swa)) == len(swa)
    want = cold_tokens(tiny, h, prompt, 30)
    assert all(o.token_ids == want for o in outs.values())


def test_prompt_logprobs_are_computed_not_hit(tiny, h):
    """A request asking for prompt logprobs computes every prompt position even though its
    prompt is cached, and gets the logprobs the first request got."""
    prompt = tiny.tie_free_ids(600, seed=341)
    eng = tiny.engine(**SETTINGS)
    first = h.drive_greedy(eng, {"a": prompt}, 5, check=True, prompt_logprobs=1)["a"]
    assert eng.cache.prefix.match(prompt, 599) is not None
    second = h.drive_greedy(eng, {"b": prompt}, 5, check=True, prompt_logprobs=1)["b"]
    assert second.num_cached_tokens == 0 and len(second.prompt_logprobs) == len(prompt)
    for x, y in zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:]):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_preemption_keeps_committed_pages_cached(tiny, h):
    """Three requests that outgrow a 5-page cache as they decode past 256: the preempted one
    leaves its committed page in the prefix cache and resumes from its own checkpoint when
    readmitted; all generate the cold engine's tokens and every page comes back."""
    prompts = {f"p{i}": tiny.tie_free_ids(200, seed=351 + i) for i in range(3)}
    eng = tiny.engine(max_num_batched_tokens=512, max_num_seqs=3, num_pages=5)
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy(120))
    reqs = list(eng.scheduler.waiting)
    outs = h.drive(eng, check=True)
    assert sum(r.num_preemptions for r in reqs) >= 1, "the test did not exercise preemption"
    assert eng.scheduler.prefix_hits >= 256, "no preempted request resumed from its checkpoint"
    cold = cold_batch(tiny, h, prompts, 120)
    for rid in prompts:
        assert outs[rid].token_ids == cold[rid], rid
    assert h.free_counts(eng) == (5, eng.plan.num_swa_pages, 3)
    cached = eng.cache.prefix.num_pages
    assert cached and eng.reset_prefix_cache() == cached
    assert eng.cache.pages.num_free == 5 and eng.cache.prefix.num_pages == 0


def test_llm_n_copies_share_the_prompt(tiny):
    """`LLM.generate` with n = 3: the children of one prompt hit its checkpoint."""
    from dsv4.engine.llm import LLM
    llm = LLM(tiny.path, **SETTINGS)
    prompt = tiny.tie_free_ids(300, seed=361)
    outs = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(n=3, temperature=0.0,
                        max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 256, 256]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
