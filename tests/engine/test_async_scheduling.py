"""Async scheduling (docs/architecture.md, "Engine"): step k+1 is launched before step k's tokens are read, its
decode tokens taken from the device. Invariant 5: the same tokens, logprobs and finish
reasons as the synchronous engine, through stop tokens, seeded sampling, penalties (which
count the tokens in flight on the device), min_tokens, prompt logprobs, preemption and aborts; every page returns."""
from __future__ import annotations

import pytest

from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _params(i: int, stop: int | None) -> SamplingParams:
    kinds = [dict(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2),
             dict(temperature=0.9, top_k=20, seed=7, max_tokens=12, ignore_eos=True),
             dict(temperature=0.0, max_tokens=14, stop_token_ids=[stop] if stop is not None else None),
             dict(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                  frequency_penalty=0.2),
             dict(temperature=0.8, top_p=0.9, seed=11, max_tokens=11, min_tokens=6, ignore_eos=True),
             dict(temperature=0.0, max_tokens=7, ignore_eos=True, prompt_logprobs=1)]
    return SamplingParams(**kinds[i % len(kinds)])


def _requests(h, prompts, stop=None, arrivals=None) -> list:
    """Request i (id str(i)) of `prompts`, sampled with _params(i, stop), arriving at step arrivals[i]."""
    arrivals = arrivals or [0] * len(prompts)
    return [h.Req(str(i), p, _params(i, stop), arrivals[i]) for i, p in enumerate(prompts)]


def _spy_launches(engine):
    """Record, per runner call, whether it took tokens from the step in flight."""
    calls, execute = [], engine.runner.execute
    engine.runner.execute = lambda chunks, prev=None: calls.append(prev is not None) or execute(chunks, prev)
    return calls


def test_async_equals_sync_on_a_mixed_workload(tiny, h):
    prompts = [tiny.ids(n, seed=n) for n in (5, 40, 130, 17, 66, 9)]
    arrivals = [0, 0, 2, 3, 3, 6]
    sync = h.drive(tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16,
                               async_scheduling="off"), _requests(h, prompts, None, arrivals))
    stop = sync["2"].token_ids[5]            # request 2 then stops on a token mid-way
    sync = h.drive(tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16,
                               async_scheduling="off"), _requests(h, prompts, stop, arrivals))
    assert sync["2"].finish_reason == "stop" and len(sync["2"].token_ids) <= 6
    eng = tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16, async_scheduling="on")
    calls = _spy_launches(eng)
    h.assert_same_outputs(sync, h.drive(eng, _requests(h, prompts, stop, arrivals), check=True))
    assert sum(calls) >= len(calls) - 12, f"decode steps took their tokens from the step in flight: {calls}"
    assert eng.cache.available_pages() == eng.plan.num_pages and eng._inflight is None


def test_async_equals_sync_through_preemption(tiny, h):
    prompts = [tiny.ids(n, seed=100 + n) for n in (200, 180, 150)]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1)
    results = []
    for mode in ("off", "on"):
        eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=3, num_pages=3, async_scheduling=mode)
        reqs = [eng.add_request(str(i), p, greedy) for i, p in enumerate(prompts)]
        done = h.drive(eng, check=True)
        assert sum(r.num_preemptions for r in reqs) > 0, "the cache is small enough to preempt"
        results.append((done, eng))
    (sync, _), (asy, eng) = results
    h.assert_same_outputs(sync, asy)
    assert eng.cache.available_pages() == eng.plan.num_pages


def test_abort_while_a_step_is_in_flight(tiny, h):
    prompts = [tiny.ids(n, seed=200 + n) for n in (12, 30, 7)]
    sync = h.drive(tiny.engine(max_num_batched_tokens=64, max_num_seqs=4, num_pages=8, async_scheduling="off"),
                   _requests(h, prompts), abort_at=("1", 4))
    eng = tiny.engine(max_num_batched_tokens=64, max_num_seqs=4, num_pages=8, async_scheduling="on")
    asy = h.drive(eng, _requests(h, prompts), check=True, abort_at=("1", 4))
    assert "1" not in asy and "1" not in sync
    h.assert_same_outputs(sync, asy)
    assert eng.cache.available_pages() == eng.plan.num_pages and len(eng.cache.free_slots) == 4
