"""Page accounting of the prefix cache under random workloads: thousands of requests with random
shared prefixes, aborts and preemptions under a small cache, through the real scheduler, cache
manager and storage (checkpoints packed and restored), without a model (steps are simulated as
in tests/engine/test_scheduler.py). After every step each page's refcount is exactly its number
of holders, no free page is held, a request's shared pages are the tree's path; at the end every
page, SWA page and slot is back."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.cache.manager import CacheManager
from dsv4.cache.storage import KVStorage
from dsv4.engine.request import Request, Status
from dsv4.engine.scheduler import Scheduler
from dsv4.model.random_init import preset_config
from dsv4.sampling_params import SamplingParams


def make(num_pages: int, max_seqs: int, budget: int, checkpoints: int, spec_slots: int = 0) -> Scheduler:
    layout = CacheLayout(preset_config("tiny"), spec_slots=spec_slots)
    plan = CachePlan(num_pages, layout.swa_pages_needed(max_seqs, budget), max_seqs, checkpoints)
    cache = CacheManager(layout, plan, prefix_caching=True)
    cache.bind(KVStorage(layout, plan, torch.float32, "cpu"))
    return Scheduler(cache, budget, max_seqs)


def check(sched: Scheduler) -> None:
    cache, alloc = sched.cache, sched.cache.pages
    live = list(sched.running) + list(sched.waiting)
    held = [cache.seq(r) for r in live]
    tree = cache.prefix.pages()
    holders = Counter(p for h in held for p in h.pages) + Counter(tree)
    assert all(len(set(h.pages)) == len(h.pages) for h in held)
    for page in range(alloc.num_pages):
        assert alloc.refcount(page) == holders[page], f"page {page}: refcount {alloc.refcount(page)}, " \
                                                      f"{holders[page]} holders"
    assert not set(alloc._free_list) & set(holders), "a held page is on the free list"
    assert alloc.num_reclaimable == sum(holders[p] == 1 for p in tree)
    for h in held:                        # a request holding a tree page holds the path above it
        if h.node is not None and h.node.attached:
            assert h.pages[:h.node.depth] == [n.page for n in reversed(h.node.path())]
    swa = [p for h in held for p in h.swa_pages if p >= 0]
    assert len(set(swa)) == len(swa) == cache.swa.num_used
    slots = [h.slot for h in held if h.slot is not None]
    assert len(set(slots)) == len(slots) == cache.plan.max_num_seqs - len(cache.free_slots)
    ckpts = [n.checkpoint for n in cache.prefix._lru if n.checkpoint is not None]
    assert len(set(ckpts)) == len(ckpts) <= cache.plan.num_checkpoints
    assert all(n.checkpoint is not None or n.children for n in cache.prefix._lru), "a useless leaf"
    for r in sched.waiting:
        assert cache.seq(r).holds_nothing


def run_workload(h, sched: Scheduler, num_requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    bases = [[rng.randrange(2, 500) for _ in range(rng.randint(256, 1300))] for _ in range(6)]
    pending, finished, counts = list(range(num_requests)), 0, Counter()
    live: dict[str, Request] = {}
    outputs: dict[str, int] = {}
    for step in range(200_000):
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):          # arrivals
            if not pending or len(live) >= 12:                    # a bounded queue
                break
            i = pending.pop(0)
            prompt = h.random_prompt(rng, bases, 300)
            params = SamplingParams(max_tokens=rng.randint(1, 400 if rng.random() < 0.1 else 24),
                                    prompt_logprobs=0 if rng.random() < 0.05 else None)
            req = Request(f"r{i}", prompt, params, arrival=i)
            live[req.request_id], outputs[req.request_id] = req, params.max_tokens
            sched.add(req)
        if live and rng.random() < 0.03:                           # an abort, anywhere
            victim = live.pop(rng.choice(sorted(live)))
            sched.finish(victim, Status.ABORTED)
            counts["aborted"] += 1
        for req in h.simulated_step(sched, rng, outputs):
            live.pop(req.request_id)
            counts["finished"] += 1
        check(sched)
        if not pending and not live:
            return counts
    raise AssertionError("the workload did not finish")


@pytest.mark.parametrize("spec_slots", [0, 2])
def test_random_workload_returns_every_page(h, spec_slots):
    sched = make(num_pages=14, max_seqs=6, budget=300, checkpoints=10, spec_slots=spec_slots)
    cache = sched.cache
    initial = (cache.pages.num_free, cache.swa.num_free, len(cache.free_slots))
    reqs: list[Request] = []
    original_add = sched.add
    sched.add = lambda r: (reqs.append(r), original_add(r))[1]
    counts = run_workload(h, sched, num_requests=2000, seed=spec_slots)
    assert counts["finished"] + counts["aborted"] == 2000
    assert sum(r.num_preemptions for r in reqs) >= 20, "the workload did not exercise preemption"
    assert counts["aborted"] >= 20
    hits = [r.num_cached_tokens for r in reqs if r.num_cached_tokens]
    assert len(hits) >= 300 and sched.prefix_hits >= 256 * len(hits), "the workload did not exercise hits"
    assert all(h % 256 == 0 for h in hits)
    assert cache.available_pages() == initial[0]
    assert (cache.swa.num_free, len(cache.free_slots)) == initial[1:]
    cache.reset_prefix()
    assert (cache.pages.num_free, cache.swa.num_free, len(cache.free_slots)) == initial
    assert cache.prefix.num_pages == 0 and cache.prefix.num_checkpoints_used == 0
