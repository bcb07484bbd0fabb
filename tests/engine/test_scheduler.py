"""Scheduler (docs/architecture.md, "Engine"): continuous batching under a token budget, decodes first, then
running prefills, then waiting requests in arrival order; pages reserved up front for the
whole step; preemption by recompute frees everything and takes the newest request first.
No model here: steps are simulated (num_computed advances, a token is appended on completion).
"""
from __future__ import annotations

from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.cache.manager import CacheManager
from dsv4.engine.request import Request, Status
from dsv4.sampling_params import SamplingParams
from dsv4.engine.scheduler import Scheduler
from dsv4.model.random_init import preset_config


def make(budget=32, max_seqs=4, num_pages=8, num_swa_pages=32) -> Scheduler:
    layout = CacheLayout(preset_config("tiny"))
    return Scheduler(CacheManager(layout, CachePlan(num_pages, num_swa_pages, max_seqs)), budget, max_seqs)


_arrivals = iter(range(10**6))


def add(sched: Scheduler, rid: str, prompt_len: int, arrival: int | None = None) -> Request:
    req = Request(rid, [3] * prompt_len, SamplingParams(),
                  arrival=next(_arrivals) if arrival is None else arrival)
    sched.add(req)
    return req


def step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule, check the reservations, then do what LLMEngine.step does to the requests."""
    chunks = sched.schedule()
    assert sum(c.num_tokens for c in chunks) <= sched.max_tokens
    assert len(chunks) <= sched.max_seqs
    assert len({c.request.request_id for c in chunks}) == len(chunks)
    for c in chunks:
        req = c.request
        assert req.status is Status.RUNNING and sched.cache.seq(req).slot is not None
        assert len(sched.cache.seq(req).pages) * 256 >= req.num_computed + c.num_tokens, "history pages not reserved"
    out = [(c.request.request_id, c.num_tokens) for c in chunks]
    for c in chunks:
        completes = c.completes
        c.request.num_computed += c.num_tokens
        sched.cache.trim(c.request)
        if completes:
            c.request.output_token_ids.append(7)
    return out


def holds_nothing(sched: Scheduler, req: Request) -> bool:
    return sched.cache.seq(req).holds_nothing


def test_decodes_first_then_prefills_then_waiting_under_the_budget():
    sched = make(budget=32)
    add(sched, "a", 10)
    add(sched, "b", 100)
    add(sched, "c", 5)
    assert step(sched) == [("a", 10), ("b", 22)]           # c does not fit the budget yet
    assert step(sched) == [("a", 1), ("b", 31)]            # a decodes first
    assert step(sched) == [("a", 1), ("b", 31)]
    assert step(sched) == [("a", 1), ("b", 16), ("c", 5)]  # b's last chunk; c admitted behind it
    assert step(sched) == [("a", 1), ("b", 1), ("c", 1)]   # all decoding


def test_chunked_prefill_covers_the_prompt_exactly():
    sched = make(budget=37)
    req = add(sched, "long", 300)
    chunks = []
    while req.num_computed < 300:
        chunks += [n for _, n in step(sched)]
    assert chunks == [37] * 8 + [4] and req.output_token_ids == [7]


def test_max_num_seqs_limits_running_requests():
    sched = make(budget=64, max_seqs=2)
    a, _, c = add(sched, "a", 4), add(sched, "b", 4), add(sched, "c", 4)
    assert step(sched) == [("a", 4), ("b", 4)]
    assert step(sched) == [("a", 1), ("b", 1)] and c.status is Status.WAITING and holds_nothing(sched, c)
    sched.finish(a)
    assert a.status is Status.FINISHED and holds_nothing(sched, a)
    assert step(sched) == [("b", 1), ("c", 4)]


def test_admission_reserves_pages_up_front():
    """A waiting request is admitted only when all its chunk's pages are free; until then it
    holds nothing, and the requests behind it wait too (arrival order)."""
    sched = make(budget=512, num_pages=2)
    a = add(sched, "a", 400)                                # 2 pages
    b, c = add(sched, "b", 100), add(sched, "c", 10)
    assert step(sched) == [("a", 400)]
    assert holds_nothing(sched, b) and holds_nothing(sched, c) and list(sched.waiting) == [b, c]
    assert sched.cache.pages.num_free == 0
    sched.finish(a)
    assert step(sched) == [("b", 100), ("c", 10)]


def test_preemption_takes_the_newest_and_frees_everything():
    sched = make(budget=64, num_pages=2)
    a, b = add(sched, "a", 250), add(sched, "b", 200)
    step(sched)
    while a.num_computed < 250 or b.num_computed < 200:
        step(sched)
    free_before = sched.cache.pages.num_free
    assert free_before == 0 and b.output_token_ids
    outputs = list(b.output_token_ids)
    while a.num_computed <= 256:                              # a needs its second page at 256
        step(sched)
    assert b.status is Status.WAITING and b.num_preemptions == 1 and b.num_computed == 0
    assert holds_nothing(sched, b) and sched.waiting[0] is b
    assert b.output_token_ids[:len(outputs)] == outputs       # generated tokens survive (recompute)
    assert a.num_preemptions == 0 and len(sched.cache.seq(a).pages) == 2
    sched.finish(a)
    assert holds_nothing(sched, a)
    chunks = step(sched)
    assert chunks == [("b", 64)]                              # recompute of prompt + outputs, chunked
    assert b.num_tokens == 200 + len(b.output_token_ids)


def test_a_request_preempts_itself_rather_than_an_older_one():
    """When the request that needs a page is newer than every unscheduled running request, it
    is the one preempted; the older one (here: re-admitted after the newer one, as after a
    preemption, and still prefilling) keeps its pages."""
    sched = make(budget=8, num_pages=2)
    new = add(sched, "new", 250, arrival=1)
    while new.num_computed < 250:
        step(sched)
    old = add(sched, "old", 250, arrival=0)
    while True:
        chunks = step(sched)
        if new.status is not Status.RUNNING:
            break
        assert chunks[0] == ("new", 1)                        # decodes go first
    assert chunks == [("old", 8)]                             # preempted in this step: old gets the budget
    assert new.num_computed == 0 and new.num_preemptions == 1 and holds_nothing(sched, new)
    assert sched.waiting[0] is new
    assert old.status is Status.RUNNING and old.num_preemptions == 0 and len(sched.cache.seq(old).pages) == 1
    assert 0 < old.num_computed < 250                         # it was prefilling, not scheduled yet


def test_finish_frees_waiting_and_running_requests():
    sched = make(budget=16)
    a, b = add(sched, "a", 40), add(sched, "b", 40)
    step(sched)
    assert sched.cache.seq(a).pages and holds_nothing(sched, b)
    sched.finish(a, Status.ABORTED)
    sched.finish(b, Status.ABORTED)
    assert holds_nothing(sched, a) and holds_nothing(sched, b) and not sched.has_work()
    assert sched.cache.pages.num_free == 8 and len(sched.cache.free_slots) == 4


def test_an_older_prefill_preempts_a_newer_decode_already_scheduled_in_the_step():
    # 3 history pages in all. "new" (arrival 100) is queued before "old" (arrival 1), so it is
    # admitted first and is decoding when "old", still prefilling, needs a page that only
    # "new" holds. Decodes are scheduled first, yet the newest request must be the one to go:
    # its chunk is withdrawn, and "old" keeps its progress.
    sched = make(budget=266, max_seqs=2, num_pages=3)
    new = add(sched, "new", 10, arrival=100)
    old = add(sched, "old", 600, arrival=1)
    assert step(sched) == [("new", 10), ("old", 256)]       # new: page 0; old: page 1
    sched.max_tokens = 300
    assert step(sched) == [("old", 299)]                     # old needs 2 more pages: new goes
    assert new.status is Status.WAITING and holds_nothing(sched, new) and new.num_computed == 0
    assert old.num_computed == 555 and len(sched.cache.seq(old).pages) == 3


def test_only_shows_one_request_and_puts_the_others_back():
    """`only(req)` (the engine core's one-request retry): inside, the scheduler schedules `req`
    alone; after, the others are back in order and `req` is where the step left it."""
    sched = make(budget=64)
    a, b = add(sched, "a", 10), add(sched, "b", 10)
    step(sched)                                              # a and b run
    c, d = add(sched, "c", 10), add(sched, "d", 10)
    with sched.only(b):
        assert sched.counts() == (1, 0) and step(sched) == [("b", 1)]
    assert sched.running == [a, b] and list(sched.waiting) == [c, d]
    with sched.only(d):                                      # a waiting request is admitted alone
        assert step(sched) == [("d", 10)]
    assert sched.running == [a, b, d] and list(sched.waiting) == [c] and sched.counts() == (3, 1)
