"""CacheManager: which history pages, sliding-window pages and state slot a request holds
(docs/architecture.md, "Cache": history pages for every position written, SWA keys for [n - W - S, n), one slot)."""
from __future__ import annotations

import random

import pytest

from dsv4.cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout, CachePlan
from dsv4.cache.manager import CacheManager
from dsv4.engine.request import Request
from dsv4.sampling_params import SamplingParams
from dsv4.model.random_init import preset_config


def make(num_pages=8, num_swa_pages=16, max_num_seqs=4, spec_slots=0, window=32):
    layout = CacheLayout(preset_config("tiny", sliding_window=window), spec_slots=spec_slots)
    return CacheManager(layout, CachePlan(num_pages, num_swa_pages, max_num_seqs))


def request(n_tokens=1000, rid="r") -> Request:
    return Request(rid, [3] * n_tokens, SamplingParams(), arrival=0)


def state(cache: CacheManager, req: Request):
    held = cache.seq(req)
    return (list(held.pages), list(held.swa_pages), held.slot, cache.pages.num_free, cache.swa.num_free,
            list(cache.free_slots))


def assert_holds_what_a_step_needs(cache: CacheManager, req: Request, n: int) -> None:
    """After reserve(req, n): history pages for [0, c + n), SWA pages for [c - W - S, c + n)."""
    c, keep = req.num_computed, cache.layout.swa_keep
    assert len(cache.seq(req).pages) == -(-(c + n) // PAGE_TOKENS)
    for logical in range(max(0, c - keep) // SWA_PAGE_TOKENS, (c + n - 1) // SWA_PAGE_TOKENS + 1):
        assert cache.seq(req).swa_pages[logical] >= 0, f"SWA page {logical} missing at c={c}, n={n}"
    assert cache.seq(req).slot is not None


def advance(cache: CacheManager, req: Request, n: int) -> None:
    req.num_computed += n
    cache.trim(req)
    keep_from = max(0, req.num_computed - cache.layout.swa_keep) // SWA_PAGE_TOKENS
    assert all(p < 0 for p in cache.seq(req).swa_pages[:keep_from]), "trim kept a page wholly behind the window"
    assert all(p >= 0 for p in cache.seq(req).swa_pages[keep_from:]), "trim freed a page the window still reads"


@pytest.mark.parametrize("spec_slots", [0, 3])
@pytest.mark.parametrize("window", [32, 128])
def test_reserve_and_trim_follow_the_window(spec_slots, window):
    """Random chunk sizes over 2000 positions: each reserve covers the step, each trim frees
    exactly the SWA pages wholly below n - W - S, and the allocators count what is held."""
    cache = make(num_pages=8, num_swa_pages=8, spec_slots=spec_slots, window=window)
    req, rng = request(2000), random.Random(spec_slots * 1000 + window)
    while req.num_computed < 2000:
        n = min(rng.choice([1, 1, 1, 3, 37, 129, 200]), 2000 - req.num_computed)
        assert cache.reserve(req, n)
        assert_holds_what_a_step_needs(cache, req, n)
        advance(cache, req, n)
        assert cache.pages.num_used == len(cache.seq(req).pages)
        assert cache.swa.num_used == sum(p >= 0 for p in cache.seq(req).swa_pages)
    assert cache.swa.num_used <= -(-(window + spec_slots) // SWA_PAGE_TOKENS) + 1
    cache.release(req)
    assert (cache.pages.num_free, cache.swa.num_free, len(cache.free_slots)) == (8, 8, 4)


def test_reserve_is_all_or_nothing():
    cache = make(num_pages=1, num_swa_pages=3)
    req = request()
    before = state(cache, req)
    assert not cache.reserve(req, 300)                # needs 2 history pages, 1 exists
    assert state(cache, req) == before
    assert not cache.can_reserve(req, 257)
    assert cache.reserve(req, 256)
    advance(cache, req, 256)
    other = request(rid="o")
    before = state(cache, other)
    assert not cache.reserve(other, 10)                # no history page left: no slot, no SWA page taken
    assert state(cache, other) == before

    few_swa = make(num_pages=8, num_swa_pages=2)
    req = request()
    before = state(few_swa, req)
    assert not few_swa.reserve(req, 300)               # 3 SWA pages needed, 2 exist
    assert state(few_swa, req) == before


def test_release_frees_everything_once():
    cache = make()
    initial = (cache.pages.num_free, cache.swa.num_free, len(cache.free_slots))
    reqs = [request(rid=str(i)) for i in range(3)]
    for i, r in enumerate(reqs):
        assert cache.reserve(r, 100 * (i + 1))
        advance(cache, r, 100 * (i + 1))
    for r in reqs:
        cache.release(r)
        assert cache.seq(r).pages == [] and cache.seq(r).swa_pages == [] and cache.seq(r).slot is None
        cache.release(r)                                # a second release is a no-op
    assert (cache.pages.num_free, cache.swa.num_free, len(cache.free_slots)) == initial


def test_state_slots_are_limited_and_reused():
    cache = make(max_num_seqs=2)
    a, b, c = request(rid="a"), request(rid="b"), request(rid="c")
    assert cache.reserve(a, 5) and cache.reserve(b, 5)
    assert cache.seq(a).slot != cache.seq(b).slot
    assert not cache.reserve(c, 5) and cache.seq(c).slot is None and not cache.seq(c).pages
    slot = cache.seq(a).slot
    cache.release(a)
    assert cache.reserve(c, 5) and cache.seq(c).slot == slot
    assert cache.reserve(b, 5) and cache.usage()["slots_used"] == 2   # a holder keeps its slot


def test_fits_ever_is_exact():
    cache = make(num_pages=2, num_swa_pages=16)
    assert cache.fits_ever(2 * PAGE_TOKENS, 64)
    assert not cache.fits_ever(2 * PAGE_TOKENS + 1, 64)
    small = make(num_pages=8, num_swa_pages=2)
    assert not small.fits_ever(100, 64), "SWA pages for one step of 64 tokens do not exist"


@pytest.mark.parametrize("spec_slots", [0, 4])
@pytest.mark.parametrize("window", [32, 128])
def test_planned_swa_pages_suffice_for_any_step(spec_slots, window):
    """With the SWA pages the layout plans for `max_num_seqs` and the step budget, random steps
    (any alignments, any split of the budget, requests joining, idling and leaving) never run
    out of SWA pages."""
    seqs, budget = 6, 200
    layout = CacheLayout(preset_config("tiny", sliding_window=window), spec_slots=spec_slots)
    plan = CachePlan(num_pages=64, num_swa_pages=layout.swa_pages_needed(seqs, budget), max_num_seqs=seqs)
    cache, rng = CacheManager(layout, plan), random.Random(7)
    live: list[Request] = []
    for step in range(400):
        while len(live) < seqs:
            live.append(request(4000, rid=f"{step}-{len(live)}"))
        left, chunks = budget, []
        for req in rng.sample(live, rng.randint(1, len(live))):
            if left == 0:
                break
            n = min(rng.randint(1, left), req.num_tokens - req.num_computed)
            assert cache.reserve(req, n), f"step {step}: out of SWA pages ({cache.usage()})"
            chunks.append((req, n))
            left -= n
        for req, n in chunks:        # pages are trimmed after the step's forward, not between reserves
            advance(cache, req, n)
        for req in [r for r in live if r.num_computed > rng.randint(300, 3000)]:
            cache.release(req)
            live.remove(req)
