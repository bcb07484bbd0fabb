"""A step's addressing (dsv4/cache/addressing.py) against the page math written out token by
token, its padding for CUDA graphs, its O(tokens + pages) size, and the page-major storage
that its row ids address (docs/architecture.md, "Cache")."""
from __future__ import annotations

import random

import pytest
import torch

from dsv4.cache.addressing import (Scratch, SeqChunk, StepShape, build_step, build_swa_step, step_widths,
                                  swa_batch, swa_step_rows)
from dsv4.cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout, CachePlan
from dsv4.cache.storage import KVStorage
from dsv4.engine.upload import tensor_leaves
from dsv4.model.random_init import preset_config

LAYOUT = CacheLayout(preset_config("tiny", sliding_window=32), spec_slots=2)
RING_SLOTS = 9


def _chunks(spans: list[tuple[int, int]], seed: int, logits=1) -> list[SeqChunk]:
    """One chunk per (start, num_tokens), physical pages shuffled, SWA pages below the window freed."""
    rng = random.Random(seed)
    free = list(range(20000))
    rng.shuffle(free)
    out = []
    for slot, (start, n) in enumerate(spans):
        end = start + n
        pages = [free.pop() for _ in range(-(-end // PAGE_TOKENS))]
        swa = [free.pop() for _ in range((end - 1) // SWA_PAGE_TOKENS + 1)]
        for i in range(max(0, start - LAYOUT.swa_keep) // SWA_PAGE_TOKENS):
            swa[i] = -1
        out.append(SeqChunk(slot=slot, start=start, token_ids=[rng.randrange(100) for _ in range(n)],
                            page_table=pages, swa_table=swa, logits=min(logits, n)))
    return out


def _expected_rows(c: SeqChunk, p: int) -> dict[str, list[int]]:
    """The rows token p of chunk c reads, one position / entry at a time."""
    W = LAYOUT.cfg.sliding_window
    swa = [c.swa_table[q // SWA_PAGE_TOKENS] * LAYOUT.swa_pitch + q % SWA_PAGE_TOKENS
           for q in range(max(p - W + 1, 0), p + 1)]
    c4 = [c.page_table[e // 64] * LAYOUT.c4_pitch + e % 64 for e in range((p + 1) // 4)]
    c128 = [c.page_table[e // 2] * LAYOUT.c128_pitch + e % 2 for e in range((p + 1) // 128)]
    return {"swa": swa, "c4": c4, "c128": c128}


SPANS = [[(0, 300)], [(3, 1)], [(127, 1), (128, 1), (255, 1), (256, 1)], [(7, 40), (511, 1), (1023, 3), (40, 257)],
         [(130, 2)] * 3]


@pytest.mark.parametrize("spans", SPANS)
def test_rows_follow_the_page_math(spans):
    chunks = _chunks(spans, seed=len(spans))
    fb = build_step(chunks, LAYOUT, RING_SLOTS)
    t = 0
    for c in chunks:
        for p in range(c.start, c.start + len(c.token_ids)):
            want = _expected_rows(c, p)
            for name in ("swa", "c4", "c128"):
                got = getattr(fb, name).dense(t, t + 1)[0]
                assert got[:len(want[name])].tolist() == want[name], (name, p)
                assert (got[len(want[name]):] == -1).all(), (name, p)
            assert int(fb.swa_write[t]) == c.swa_table[p // SWA_PAGE_TOKENS] * LAYOUT.swa_pitch + p % SWA_PAGE_TOKENS
            t += 1
    closing = [(c, p) for c in chunks for p in range(c.start, c.start + len(c.token_ids)) if (p + 1) % 4 == 0]
    assert fb.csa.entry_slot.tolist() == [c.page_table[((p + 1) // 4 - 1) // 64] * LAYOUT.c4_pitch
                                          + ((p + 1) // 4 - 1) % 64 for c, p in closing]


@pytest.mark.parametrize("spans", [s for s in SPANS if len({n for _, n in s}) == 1])   # uniform steps
def test_padding_rows_write_scratch_and_read_nothing(spans):
    q = spans[0][1]
    chunks = _chunks(spans, seed=7, logits=q)
    exact = build_step(chunks, LAYOUT, RING_SLOTS)
    R, (e4, e128, swa_cols) = len(chunks), step_widths(chunks, LAYOUT.cfg.sliding_window)
    shape = StepShape(seqs=R + 3, tokens=q, e4=e4 + 5, e128=e128 + 2, swa_pages=swa_cols + 1)
    s = Scratch(page=50, swa_page=60, slot=8)
    fb = build_step(chunks, LAYOUT, RING_SLOTS, shape, s)
    T, real = shape.seqs * q, R * q
    assert fb.num_tokens == T and fb.c4.width == shape.e4 and fb.c4.pages.shape[0] == shape.seqs
    for name in ("swa", "c4", "c128"):
        assert torch.equal(getattr(fb, name).dense(0, real)[:, :getattr(exact, name).width],
                           getattr(exact, name).dense())
        assert (getattr(fb, name).dense(real, T) == -1).all()
    assert (fb.swa_write[real:] == 60 * LAYOUT.swa_pitch).all() and fb.logits_rows.tolist() == list(range(T))
    for plan, exact_plan, pitch, ring_pitch in ((fb.csa, exact.csa, LAYOUT.c4_pitch, LAYOUT.csa_ring_pitch),
                                                (fb.hca, exact.hca, LAYOUT.c128_pitch, LAYOUT.hca_ring_pitch)):
        G, Wr = exact_plan.rows.shape[0], exact_plan.ring_dst.shape[0]
        assert torch.equal(plan.rows[:G], exact_plan.rows) and (plan.rows[G:] == -1).all()
        assert (plan.entry_slot[G:] == 50 * pitch).all() and (plan.ring_dst[Wr:] == 8 * ring_pitch).all()
        assert torch.equal(plan.ring_dst[:Wr], exact_plan.ring_dst) and plan.ring_rows == exact_plan.ring_rows


@pytest.mark.parametrize("spans", SPANS)
def test_swa_only_batch_equals_the_full_one_on_the_window(spans):
    """build_swa_step (what the MTP blocks read): the same tokens, positions, SWA writes and reads
    as build_step, exact and padded; no compressed entry read, no group closed."""
    chunks = _chunks(spans, seed=11, logits=spans[0][1])
    pairs = [(build_step(chunks, LAYOUT, RING_SLOTS), build_swa_step(chunks, LAYOUT))]
    if len({n for _, n in spans}) == 1:
        q, (e4, e128, swa_cols) = spans[0][1], step_widths(chunks, LAYOUT.cfg.sliding_window)
        shape = StepShape(seqs=len(chunks) + 3, tokens=q, e4=e4, e128=e128, swa_pages=swa_cols + 1)
        s = Scratch(50, 60, 8)
        pairs.append((build_step(chunks, LAYOUT, RING_SLOTS, shape, s), build_swa_step(chunks, LAYOUT, shape, s)))
    for full, swa in pairs:
        for name in ("token_ids", "positions", "swa_write", "logits_rows"):
            assert torch.equal(getattr(swa, name), getattr(full, name)), name
        assert torch.equal(swa.swa.dense(), full.swa.dense()) and swa.seq_lens == full.seq_lens
        assert (swa.c4.dense() == -1).all() and (swa.c128.dense() == -1).all()
        assert swa.csa.rows.shape[0] == swa.hca.rows.shape[0] == swa.csa.ring_dst.shape[0] == 0
    chunks[0].swa_table[-1] = -1
    with pytest.raises(RuntimeError, match="SWA page missing"):
        build_swa_step(chunks, LAYOUT)


def test_swa_batches_built_together_equal_those_built_apart():
    """swa_step_rows (the draft graph's catch-up and chain steps in one pass) against one
    build_swa_step per group, padded; a group whose window needs more SWA columns than its
    shape has is refused."""
    groups = [_chunks([(130, 3), (7, 3), (400, 3)], seed=5, logits=3), _chunks([(133, 1), (10, 1), (403, 1)], seed=6),
              _chunks([(255, 1), (2, 1)], seed=8)]
    W = LAYOUT.cfg.sliding_window
    shapes = [StepShape(seqs=4, tokens=len(g[0].token_ids), e4=0, e128=0,
                        swa_pages=(W + len(g[0].token_ids) - 2) // SWA_PAGE_TOKENS + 2) for g in groups]
    s = Scratch(50, 60, 8)
    for rows, g, shape in zip(swa_step_rows(groups, LAYOUT, shapes, s), groups, shapes):
        together = swa_batch(rows, shape, LAYOUT)
        apart = build_swa_step(g, LAYOUT, shape, s)
        assert [p for p, _ in tensor_leaves(together)] == [p for p, _ in tensor_leaves(apart)]
        for (path, a), (_, b) in zip(tensor_leaves(together), tensor_leaves(apart)):
            assert torch.equal(a, b), path
        assert together.seq_lens == apart.seq_lens
    narrow = [StepShape(4, 1, 0, 0, 1)]
    with pytest.raises(RuntimeError, match="SWA page missing"):
        swa_step_rows([_chunks([(127, 1), (130, 1)], seed=9)], LAYOUT, narrow, s)


def test_size_is_tokens_plus_pages_not_tokens_times_entries():
    """A 2-token decode at position 1M and a 2048-token chunk at 64k: every tensor of the batch
    is bounded by a few times (tokens + pages + window), far below tokens x entries."""
    for spans in ([(1 << 20, 2), (5000, 2)], [(1 << 16, 2048)]):
        chunks = _chunks(spans, seed=3)
        fb = build_step(chunks, LAYOUT, RING_SLOTS)
        T = fb.num_tokens
        pages = sum(len(c.page_table) + len(c.swa_table) for c in chunks)
        bound = 4 * (T * (2 * 4 + 2 * LAYOUT.cfg.sliding_window) + pages)
        biggest = max(t.numel() for _, t in tensor_leaves(fb))
        assert biggest <= bound, biggest
        assert T * fb.c4.width > 10 * bound          # what a dense [T, E4] table would have cost


def test_a_missing_page_is_an_error():
    chunks = _chunks([(300, 1)], seed=1)
    chunks[0].page_table[1] = -1
    with pytest.raises(RuntimeError, match="history page missing"):
        build_step(chunks, LAYOUT, RING_SLOTS)
    chunks = _chunks([(300, 1)], seed=1)
    chunks[0].swa_table[2] = -1
    with pytest.raises(RuntimeError, match="SWA page missing"):
        build_step(chunks, LAYOUT, RING_SLOTS)


def test_a_page_is_one_contiguous_block_of_every_layer():
    """Row p * pitch + j of layer i's view is slot j of layer i in page p's block, for every
    kind: what a tier or a transfer copies as a unit."""
    storage = KVStorage(LAYOUT, CachePlan(num_pages=3, num_swa_pages=4, max_num_seqs=2), torch.float32, "cpu")
    for i, layer in enumerate(storage.layers):
        layer.swa[2 * LAYOUT.swa_pitch + 5] = 1000 + i
        if layer.c4 is not None:
            k = LAYOUT.csa_layers.index(i)
            layer.c4[1 * LAYOUT.c4_pitch + 63] = 2000 + i
            layer.idx[1 * LAYOUT.c4_pitch + 1] = 3000 + i
            assert storage.page("c4", 1)[k, 63].eq(2000 + i).all() and storage.page("idx", 1)[k, 1].eq(3000 + i).all()
            layer.ring_kv[1 * LAYOUT.csa_ring_pitch + 3] = 4000 + i
            assert storage.page("ring_kv", 1)[k, 3].eq(4000 + i).all()
        if layer.c128 is not None:
            k = LAYOUT.hca_layers.index(i)
            layer.c128[2 * LAYOUT.c128_pitch + 1] = 5000 + i
            assert storage.page("c128", 2)[k, 1].eq(5000 + i).all()
        assert storage.page("swa", 2)[i, 5].eq(1000 + i).all()
    assert storage.page("swa", 2).is_contiguous() and storage.page("c4", 1).is_contiguous()
    written = sum(int(t.ne(0).any(dim=-1).sum()) for t in storage.kinds.values())
    n_csa, n_hca = len(LAYOUT.csa_layers), len(LAYOUT.hca_layers)
    assert written == len(storage.layers) + 3 * n_csa + n_hca       # each write landed once, nowhere else
