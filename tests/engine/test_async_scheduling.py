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


def _drive(engine, prompts, stop=None, arrivals=None, abort_at=None, h=None):
    """Add request i at step arrivals[i]; abort request `abort_at[0]` at step abort_at[1]."""
    arrivals = arrivals or [0] * len(prompts)
    done, step = {}, 0
    while step < 2000:
        for i, p in enumerate(prompts):
            if arrivals[i] == step:
                engine.add_request(str(i), p, _params(i, stop))
        if abort_at is not None and step == abort_at[1]:
            engine.abort(str(abort_at[0]))
        if step > max(arrivals) and not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if h is not None:
            h.assert_cache_accounting(engine)
        step += 1
    raise AssertionError("engine still busy")


def _same(a, b):
    assert sorted(a) == sorted(b)
    for rid in a:
        x, y = a[rid], b[rid]
        assert x.token_ids == y.token_ids, rid
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason), rid
        for lx, ly in [(x.logprobs, y.logprobs), (x.prompt_logprobs, y.prompt_logprobs)]:
            assert (lx is None) == (ly is None), rid
            for dx, dy in zip(lx or [], ly or []):   # batches differ, so fp32 sums may round apart
                assert (dx is None) == (dy is None) and (dx is None or dx.keys() == dy.keys()), rid
                assert dx is None or all(abs(dx[t] - dy[t]) < 1e-4 for t in dx), rid


def _spy_launches(engine):
    """Record, per runner call, whether it took tokens from the step in flight."""
    calls, execute = [], engine.runner.execute
    engine.runner.execute = lambda chunks, prev=None: calls.append(prev is not None) or execute(chunks, prev)
    return calls


def test_async_equals_sync_on_a_mixed_workload(tiny, h):
    prompts = [tiny.ids(n, seed=n) for n in (5, 40, 130, 17, 66, 9)]
    arrivals = [0, 0, 2, 3, 3, 6]
    sync = _drive(tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16,
                              async_scheduling="off"), prompts, None, arrivals)
    stop = sync["2"].token_ids[5]            # request 2 then stops on a token mid-way
    sync = _drive(tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16,
                              async_scheduling="off"), prompts, stop, arrivals)
    assert sync["2"].finish_reason == "stop" and len(sync["2"].token_ids) <= 6
    eng = tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16, async_scheduling="on")
    calls = _spy_launches(eng)
    _same(sync, _drive(eng, prompts, stop, arrivals, h=h))
    assert sum(calls) >= len(calls) - 12, f"decode steps took their tokens from the step in flight: {calls}"
    assert eng.cache.available_pages() == eng.plan.num_pages and eng._inflight is None


def test_async_equals_sync_through_preemption(tiny, h):
    prompts = [tiny.ids(n, seed=100 + n) for n in (200, 180, 150)]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=1)
    results = []
    for mode in ("off", "on"):
        eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=3, num_pages=3, async_scheduling=mode)
        reqs = [eng.add_request(str(i), p, greedy) for i, p in enumerate(prompts)]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
            h.assert_cache_accounting(eng)
        assert sum(r.num_preemptions for r in reqs) > 0, "the cache is small enough to preempt"
        results.append((done, eng))
    (sync, _), (asy, eng) = results
    _same(sync, asy)
    assert eng.cache.available_pages() == eng.plan.num_pages


def test_abort_while_a_step_is_in_flight(tiny, h):
    prompts = [tiny.ids(n, seed=200 + n) for n in (12, 30, 7)]
    sync = _drive(tiny.engine(max_num_batched_tokens=64, max_num_seqs=4, num_pages=8, async_scheduling="off"),
                  prompts, abort_at=(1, 4))
    eng = tiny.engine(max_num_batched_tokens=64, max_num_seqs=4, num_pages=8, async_scheduling="on")
    asy = _drive(eng, prompts, abort_at=(1, 4), h=h)
    assert "1" not in asy and "1" not in sync
    _same(sync, asy)
    assert eng.cache.available_pages() == eng.plan.num_pages and len(eng.cache.free_slots) == 4
