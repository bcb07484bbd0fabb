"""Rank 0's scheduling over DP ranks (dsv4/engine/data_parallel.py), without processes: new
requests go to the least loaded rank, each rank schedules its own budget, a request's cache
calls go to its rank's records, and `only` (the engine core's one-by-one retry) shows one
request on every rank; a rank short of pages preempts its own requests only. With prefix
caching a new request goes to the rank whose tree resumes the most of it (within a load slack,
`assign_rank`), and the checkpoint copies of rank r are recorded for rank r to replay."""
from __future__ import annotations

from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.engine.data_parallel import DPCaches, DPScheduler, RankStorage, assign_rank, default_hit_slack
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


def test_assign_rank_prefers_the_longest_hit_within_the_slack():
    # no hit anywhere: the least loaded rank, then the lowest
    assert assign_rank([2, 1, 1], [0, 0, 0], hit_slack=1) == 1
    # a hit on a rank within the slack of the least load wins over the idler ranks
    assert assign_rank([1, 0, 0], [0, 0, 512], hit_slack=1) == 2
    assert assign_rank([2, 1, 2], [0, 0, 512], hit_slack=1) == 2
    # the longest hit among the ranks within the slack; a longer one on a busier rank is passed over
    assert assign_rank([0, 1, 3], [256, 512, 768], hit_slack=1) == 1
    # past the slack: the least loaded rank, which then caches the prefix too
    assert assign_rank([3, 1], [768, 0], hit_slack=1) == 1
    assert assign_rank([3, 1], [768, 0], hit_slack=2) == 0
    # equal hits: the lower load, then the lower rank
    assert assign_rank([1, 0, 0], [256, 256, 256], hit_slack=1) == 1
    assert default_hit_slack(2) == 1 and default_hit_slack(16) == 4


def _run_to_the_end(caches, sched):
    """Schedule and advance until nothing is left (the runner's staging call included), then finish."""
    while sched.has_work():
        for ch in sched.schedule():
            req = ch.request
            caches.stage(req, req.num_computed, ch.num_tokens)
            sched.advance(req, ch.num_tokens)
            if req.num_computed >= req.num_tokens:
                sched.finish(req)


def test_a_request_goes_to_the_rank_whose_prefix_tree_holds_its_prompt():
    plan = CachePlan(num_pages=8, num_swa_pages=16, max_num_seqs=2, num_checkpoints=4)
    caches = DPCaches(CacheLayout(preset_config("tiny")), plan, 2, prefix_caching=True)
    caches.bind(RankStorage(plan.num_checkpoints))              # (rank 0's own storage in the engine)
    sched = DPScheduler(caches, 512, plan.max_num_seqs)
    first, other = _request(0, 300), Request("r1", list(range(1000, 1300)), SamplingParams(max_tokens=4), arrival=1)
    for r in (first, other):
        sched.add(r)
    assert (caches.rank_of["r0"], caches.rank_of["r1"]) == (0, 1)
    _run_to_the_end(caches, sched)
    assert [c.prefix.num_pages for c in caches.ranks] == [1, 1]
    packs = caches.take_checkpoint_ops(1)
    assert [op[0] for op in packs] == ["pack"] and packs[0][3] == 256      # rank 1's checkpoint at 256

    resend = Request("r2", list(range(1000, 1300)), SamplingParams(max_tokens=4), arrival=2)
    refs = [c.pages.refcount(p) for c in caches.ranks for p in c.prefix.pages()]
    assert caches.peek(resend) == [0, 256]
    assert [c.pages.refcount(p) for c in caches.ranks for p in c.prefix.pages()] == refs   # a pure lookup
    sched.add(resend)
    assert caches.rank_of["r2"] == 1, "the least loaded rank is 0, but rank 1 holds the prefix"
    fresh = Request("r3", list(range(2000, 2300)), SamplingParams(max_tokens=4), arrival=3)
    sched.add(fresh)
    assert caches.rank_of["r3"] == 0, "no hit anywhere: the least loaded rank"
    sched.schedule()
    assert (resend.num_cached_tokens, fresh.num_cached_tokens) == (256, 0)
    assert [op[0] for op in caches.take_checkpoint_ops(1)] == ["unpack"]     # restored on rank 1's storage
    assert (sched.prefix_queries, sched.prefix_hits) == (4 * 300, 256)

    for r in (resend, fresh):
        sched.finish(r)
    assert caches.reset_prefix() == 2 and [c.prefix.num_pages for c in caches.ranks] == [0, 0]
    assert [c.usage()["pages_used"] for c in caches.ranks] == [0, 0] and caches.available_pages() == 16
