"""The tiers' mover (dsv4/cache/tiers/movers.py): stores and loads through its one staging
buffer in rounds when a copy is larger than it, host copies in pieces of at most COPY_BYTES,
and every page, row and tail lands where it should."""
from __future__ import annotations

import pytest
import torch

from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.cache.storage import KVStorage
from dsv4.cache.tiers import movers
from dsv4.cache.tiers.codec import KINDS, PageCodec
from dsv4.cache.tiers.executors import make_executor
from dsv4.cache.tiers.streams import InlineStreams
from dsv4.model.random_init import preset_config


def page_row(st: KVStorage, p: int) -> torch.Tensor:
    return torch.cat([st.page(kind, p).reshape(-1) for kind in KINDS])


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("staging_pages, piece_pages", [(64, 64), (3, 2), (1, 1)])
def test_store_then_load_round_trips_in_rounds_and_pieces(monkeypatch, staging_pages, piece_pages, threaded):
    """`threaded`: the copies are issued by the mover's own thread (the tickets' waits see them)."""
    st = KVStorage(CacheLayout(preset_config("tiny")), CachePlan(num_pages=12, num_swa_pages=4, max_num_seqs=1,
                                                                 num_checkpoints=2), torch.float32, "cpu")
    for t in [*st.kinds.values(), st.checkpoints]:
        t.copy_(torch.randn(t.shape))
    codec = PageCodec(st)
    row_bytes = codec.numel * 4
    monkeypatch.setattr(movers, "STAGING_BYTES", staging_pages * row_bytes)
    monkeypatch.setattr(movers, "COPY_BYTES", piece_pages * row_bytes)
    mover = movers.Mover(InlineStreams("cpu"), codec, make_executor(threaded, "test-mover"))
    assert mover.staging.shape == (staging_pages, codec.numel)
    staging = mover.staging.data_ptr()

    rows, tails = torch.zeros(9, codec.numel), torch.zeros(2, st.checkpoints.shape[1])
    pages, slots = [7, 2, 5, 0, 9, 4, 1], [3, 4, 5, 6, 0, 1, 8]
    t = mover.store(pages, rows, slots, st.checkpoints[1], tails[0])
    t.wait()
    assert t.packed() and t.done()
    for p, slot in zip(pages, slots):
        assert torch.equal(rows[slot], page_row(st, p))
    assert torch.equal(tails[0], st.checkpoints[1]) and not rows[[2, 7]].any()

    before = {k: v.clone() for k, v in st.kinds.items()}
    targets = [10, 11, 3, 6, 8, 2, 0]
    t = mover.load(rows, slots, targets, tails[0])
    t.wait()
    t.finish()
    for p, q in zip(pages, targets):
        for kind in KINDS:
            assert torch.equal(st.page(kind, q), before[kind][p])
    assert torch.equal(st.page("c4", 1), before["c4"][1])              # a page not loaded into
    assert torch.equal(t.tail, st.checkpoints[1])
    assert mover.staging.data_ptr() == staging                          # allocated once
    mover.close()
