"""Rank 0's scheduling over DP ranks (dsv4/engine/data_parallel.py), without processes: new
requests go to the least loaded rank, each rank schedules its own budget, a request's cache
calls go to its rank's records, and `only` (the engine core's one-by-one retry) shows one
request on every rank; a rank short of pages preempts its own requests only."""
from __future__ import annotations

from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.engine.data_parallel import DPCaches, DPScheduler
from dsv4.engine.request import Request, Status
from dsv4.model.random_init import preset_config
from dsv4.sampling_params import SamplingParams

PLAN = CachePlan(num_pages=8, num_swa_pages=16, max_num_seqs=2, num_checkpoints=0)


def _scheduler(ranks=2, budget=48):
    caches = DPCaches(CacheLayout(preset_config("tiny")), PLAN, ranks)
    return caches, DPScheduler(caches, budget, PLAN.max_num_seqs)


def _request(i: int, n: int) -> Request:
    return Request(f"r{i}", list(range(n)), SamplingParams(max_tokens=4), arrival=i)


def test_new_requests_go_to_the_least_loaded_rank():
    caches, sched = _scheduler(ranks=3)
    reqs = [_request(i, 10) for i in range(4)]
    for r in reqs:
        sched.add(r)
    assert [caches.rank_of[r.request_id] for r in reqs] == [0, 1, 2, 0]
    sched.schedule()
    sched.finish(reqs[1])                       # rank 1 is now the emptiest
    assert "r1" not in caches.rank_of
    late = _request(9, 10)
    sched.add(late)
    assert caches.rank_of["r9"] == 1
    assert sched.counts() == (3, 1) and sched.has_work()


def test_each_rank_schedules_its_own_budget_on_its_own_pages():
    caches, sched = _scheduler(budget=48)
    a, b, c = _request(0, 40), _request(1, 40), _request(2, 40)
    for r in (a, b, c):
        sched.add(r)
    chunks = sched.schedule()                   # rank 0: a and 8 tokens of c (48 in all), rank 1: b
    assert [(ch.request.request_id, ch.num_tokens) for ch in chunks] == [("r0", 40), ("r2", 8), ("r1", 40)]
    assert (caches.ranks[0].usage()["pages_used"], caches.ranks[1].usage()["pages_used"]) == (2, 1)
    assert caches.usage()["pages_used"] == 3 and caches.available_pages() == 2 * PLAN.num_pages - 3
    assert caches.seq(b).pages == caches.ranks[1].seq(b).pages and not caches.ranks[0].seq(b).pages
    for ch in chunks:
        sched.advance(ch.request, ch.num_tokens)
    assert c.num_computed == 8 and not sched.waiting and {r.request_id for r in sched.running} == {"r0", "r1", "r2"}


def test_only_shows_one_request_on_every_rank():
    caches, sched = _scheduler()
    a, b, c = _request(0, 10), _request(1, 10), _request(2, 10)
    for r in (a, b, c):
        sched.add(r)
    sched.schedule()                            # a and c run on rank 0, b on rank 1
    with sched.only(b):
        assert [ch.request.request_id for ch in sched.schedule()] == ["r1"]
        sched.finish(b)
    assert b.status is Status.FINISHED
    assert {r.request_id for r in sched.running} == {"r0", "r2"} and not sched.waiting


def test_a_rank_short_of_pages_preempts_its_own_requests_only():
    plan = CachePlan(num_pages=2, num_swa_pages=16, max_num_seqs=4, num_checkpoints=0)
    caches = DPCaches(CacheLayout(preset_config("tiny")), plan, 2)
    sched = DPScheduler(caches, 1024, plan.max_num_seqs)
    a, b, c = _request(0, 250), _request(1, 250), _request(2, 250)
    for r in (a, b, c):                         # a, c on rank 0 (one page each: its two pages), b on rank 1
        sched.add(r)
    for ch in sched.schedule():
        sched.advance(ch.request, ch.num_tokens)
    for r in (a, b, c):                         # each grows past its first page
        r.output_token_ids += [1] * 10
    chunks = sched.schedule()
    assert {ch.request.request_id for ch in chunks} == {"r0", "r1"}
    assert c.status is Status.WAITING and c.num_preemptions == 1 and caches.rank_of["r2"] == 0
    assert [r.request_id for r in sched.ranks[0].waiting] == ["r2"] and b.num_preemptions == 0
