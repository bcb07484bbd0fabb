"""The numpy decode-step builder equals the general builder, and pads as DESIGN §5 says."""
import random

import pytest
import torch

from dsv4.cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout
from dsv4.engine.batch import SeqChunk, build_forward_batch
from dsv4.engine.decode_batch import Scratch, build_decode_batch, decode_widths
from dsv4.engine.upload import tensor_leaves
from dsv4.model.random_init import preset_config

LAYOUT = CacheLayout(preset_config("tiny"), spec_slots=2)


def _chunks(positions, seed):
    rng = random.Random(seed)
    free = list(range(200))
    rng.shuffle(free)
    out = []
    for slot, p in enumerate(positions):
        pages = [free.pop() for _ in range(p // PAGE_TOKENS + 1)]
        swa = [free.pop() for _ in range(p // SWA_PAGE_TOKENS + 1)]
        for i in range(max(0, (p - LAYOUT.cfg.sliding_window - 2) // SWA_PAGE_TOKENS)):
            swa[i] = -1                                  # trimmed pages below the window
        out.append(SeqChunk(slot=slot, start=p, token_ids=[rng.randrange(100)], page_table=pages, swa_table=swa))
    return out


CASES = [[0], [3], [127, 128, 255, 256], [7, 511, 3, 1023, 4], [130] * 3]


@pytest.mark.parametrize("positions", CASES)
def test_equals_the_general_builder(positions):
    chunks = _chunks(positions, seed=len(positions))
    want = build_forward_batch(chunks, LAYOUT, 9, "cpu")
    got = build_decode_batch(chunks, LAYOUT, 9)
    a, b = tensor_leaves(want), tensor_leaves(got)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        assert x.shape == y.shape and torch.equal(x, y), path
    assert want.seq_lens == got.seq_lens and want.csa.ring_rows == got.csa.ring_rows


@pytest.mark.parametrize("positions", CASES)
def test_padding_rows_write_scratch_and_read_nothing(positions):
    chunks = _chunks(positions, seed=7)
    exact = build_decode_batch(chunks, LAYOUT, 9)
    R, (e4, e128) = len(chunks), decode_widths(chunks)
    B, E4, E128 = R + 3, e4 + 5, e128 + 2
    s = Scratch(page=50, swa_page=60, slot=9)
    fb = build_decode_batch(chunks, LAYOUT, 9, (B, E4, E128), s)
    assert fb.c4_cand.shape == (B, E4) and fb.c128_idx.shape == (B, E128) and fb.num_tokens == B
    assert torch.equal(fb.c4_cand[:R, :e4], exact.c4_cand) and (fb.c4_cand[:, e4:] == -1).all()
    assert torch.equal(fb.c128_idx[:R, :e128], exact.c128_idx) and (fb.c128_idx[R:] == -1).all()
    assert (fb.swa_idx[R:] == -1).all() and (fb.swa_write[R:] == 60 * SWA_PAGE_TOKENS).all()
    for plan, exact_plan, per_page, cap in ((fb.csa, exact.csa, 64, LAYOUT.csa_ring),
                                            (fb.hca, exact.hca, 2, LAYOUT.hca_ring)):
        G = exact_plan.rows.shape[0]
        assert torch.equal(plan.rows[:G], exact_plan.rows) and (plan.rows[G:] == -1).all()
        assert (plan.entry_slot[G:] == 50 * per_page).all() and (plan.ring_dst[R:] == 9 * cap).all()
        assert torch.equal(plan.ring_dst[:R], exact_plan.ring_dst)


def test_a_missing_page_is_an_error():
    chunks = _chunks([300], seed=1)
    chunks[0].page_table[1] = -1
    with pytest.raises(RuntimeError, match="history page missing|page missing"):
        build_decode_batch(chunks, LAYOUT, 9)
