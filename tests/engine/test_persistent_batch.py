"""The persistent batch (cache/batch_tables.py): page tables kept by slot between steps and
synced incrementally give the same ForwardBatch as a fresh build from the chunks' lists, over
random sequences of requests joining, leaving, growing, trimming and swapping pages, plain and
padded to a CUDA-graph shape; an unchanged table is never rewritten."""
import dataclasses
import random

import torch

from dsv4.cache.addressing import Scratch, SeqChunk, StepShape, build_step, step_widths
from dsv4.cache.batch_tables import PersistentTables
from dsv4.cache.layout import CacheLayout
from dsv4.engine.cuda_graphs import batch_bucket, width_bucket
from dsv4.model.random_init import preset_config

SLOTS = 9


def assert_same(a, b, path="fb"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, path


class FakeRequest:
    """A request's record as the cache manager keeps it: n positions written, its tables."""

    def __init__(self, rng, slot):
        self.slot, self.n = slot, rng.randint(0, 900)
        self.pages = [rng.randrange(0, 500) for _ in range(self.n // 256 + 2)]
        self.swa = [rng.randrange(0, 300) for _ in range(self.n // 128 + 2)]

    def chunk(self, rng, tokens):
        return SeqChunk(slot=self.slot, start=self.n, token_ids=[rng.randrange(100) for _ in range(tokens)],
                        page_table=self.pages, swa_table=self.swa, logits=tokens)

    def advance(self, rng, tokens, window):
        self.n += tokens
        while len(self.pages) < self.n // 256 + 2:
            self.pages.append(rng.randrange(0, 500))
        while len(self.swa) < self.n // 128 + 2:
            self.swa.append(rng.randrange(0, 300))
        keep_from = max(self.n - window - 8, 0) // 128          # trimmed SWA pages, in place
        self.swa[:keep_from] = [-1] * keep_from
        if rng.random() < 0.2 and self.n >= 256:                 # the prefix cache swaps in a shared page
            self.pages[rng.randrange(self.n // 256)] = rng.randrange(500, 600)


def test_random_joins_and_leaves_build_the_same_batch():
    cfg = preset_config("tiny")
    layout, rng = CacheLayout(cfg), random.Random(0)
    W = cfg.sliding_window
    tables, running, free = PersistentTables(SLOTS, columns=2), {}, list(range(SLOTS - 1))
    for step in range(300):
        for slot in [s for s in running if rng.random() < 0.15]:           # leave
            del running[slot]
            free.append(slot)
        while free and rng.random() < 0.5:                                 # join (a fresh record in a used slot)
            slot = free.pop(rng.randrange(len(free)))
            running[slot] = FakeRequest(rng, slot)
        if not running:
            continue
        uniform = rng.random() < 0.5
        reqs = rng.sample(list(running.values()), rng.randint(1, len(running)))
        chunks = [r.chunk(rng, 1 if uniform else rng.randint(1, 40)) for r in reqs]
        for c in chunks:
            tables.sync(c.slot, c.page_table, c.swa_table)
        assert_same(build_step(chunks, layout, SLOTS), build_step(chunks, layout, SLOTS, tables=tables))
        if uniform:
            e4, e128, _ = step_widths(chunks, W)
            shape = StepShape(batch_bucket(len(chunks), 16), 1, width_bucket(e4), width_bucket(e128), (W - 1) // 128 + 2)
            scratch = Scratch(600, 300, SLOTS - 1)
            assert_same(build_step(chunks, layout, SLOTS, shape, scratch),
                        build_step(chunks, layout, SLOTS, shape, scratch, tables))
        for r, c in zip(reqs, chunks):
            r.advance(rng, len(c.token_ids), W)


def test_unchanged_tables_are_not_rewritten():
    tables = PersistentTables(4)
    pages, swa = [3, 4], [-1, 7, 8]
    tables.sync(1, pages, swa)
    writes = tables.writes
    for _ in range(5):
        tables.sync(1, pages, swa)
    assert tables.writes == writes == 2
    pages.append(9)                          # the same list object, changed in place
    tables.sync(1, pages, swa)
    assert tables.writes == 3 and tables.history[1, :3].tolist() == [3, 4, 9]
