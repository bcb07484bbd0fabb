"""Staging rows (dsv4/cache/layout.py, addressing.py, checkpoint.py): a chunk that crosses a page
boundary L also writes the CSA overlap rows [L - 4, L) to its slot's staging rows, so the
prefix cache can checkpoint L after the step although the ring keeps only the chunk's tail."""
from __future__ import annotations

import numpy as np
import torch

from dsv4.cache.addressing import Scratch, SeqChunk, StepShape, build_step
from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.cache.storage import KVStorage
from dsv4.model.random_init import preset_config

LAYOUT = CacheLayout(preset_config("tiny", sliding_window=32), spec_slots=2)


def chunk(slot: int, start: int, n: int, stage: int = 0) -> SeqChunk:
    end = start + n
    return SeqChunk(slot=slot, start=start, token_ids=[5] * n, page_table=list(range(slot * 8, slot * 8 + end // 256 + 1)),
                    swa_table=list(range(slot * 16, slot * 16 + (end - 1) // 128 + 1)), stage=stage)


def test_a_staged_chunk_writes_its_overlap_rows_after_the_positional_ones():
    cap, pitch = LAYOUT.csa_ring, LAYOUT.csa_ring_pitch
    assert LAYOUT.csa_ring_rows == cap + 4 and pitch == len(LAYOUT.csa_layers) * (cap + 4)
    chunks = [chunk(0, 100, 500, stage=512), chunk(3, 0, 40), chunk(1, 250, 10, stage=256)]
    fb = build_step(chunks, LAYOUT, ring_slots=5)
    dst, src = fb.csa.ring_dst.numpy(), fb.csa.ring_src.numpy()
    staged = dst % pitch >= cap
    assert staged.sum() == 8
    # chunk 0's tokens start at row 0: position p is token p - 100; chunk 2's start at 540
    assert list(dst[staged]) == [0 * pitch + cap + j for j in range(4)] + [1 * pitch + cap + j for j in range(4)]
    assert list(src[staged]) == [508 - 100 + j for j in range(4)] + [540 + 252 - 250 + j for j in range(4)]
    assert fb.csa.ring_rows == 4 * pitch + cap + 4, "fresh rows follow the whole ring view, staging rows too"
    hca_dst = fb.hca.ring_dst.numpy()
    assert (hca_dst % LAYOUT.hca_ring_pitch < LAYOUT.hca_ring).all(), "the HCA ring has no staging rows"
    positional = dst[~staged]
    assert ((positional % pitch) < cap).all()


def test_padded_steps_stage_nothing():
    shape = StepShape(seqs=2, tokens=5, e4=256, e128=16, swa_pages=3)
    chunks = [chunk(0, 507, 5, stage=512), chunk(1, 20, 5)]
    fb = build_step(chunks, LAYOUT, ring_slots=5, shape=shape, scratch=Scratch(30, 40, 4))
    assert not ((fb.csa.ring_dst.numpy() % LAYOUT.csa_ring_pitch) >= LAYOUT.csa_ring).any()


def test_checkpoint_reads_staged_rows_as_the_overlap_positions():
    st = KVStorage(LAYOUT, CachePlan(num_pages=4, num_swa_pages=12, max_num_seqs=3, num_checkpoints=1),
                   torch.float32, "cpu")
    fmt, cap = st.checkpoint_format, LAYOUT.csa_ring
    ring = st.kinds["ring_kv"]
    ring[2, :, cap:cap + 4] = torch.arange(4.0)[None, :, None] + 100       # staging rows of slot 2
    ring[2, :, [p % cap for p in range(508, 512)]] = -1.0                  # the positional rows: overwritten
    fmt.pack(st, [0, 1, 2, 3], 2, 512, st.checkpoints[0], staged=True)
    fmt.unpack(st, st.checkpoints[0], [4, 5, 6, 7], 0, 512)
    for j, p in enumerate(range(508, 512)):
        assert torch.all(ring[0, :, p % cap] == 100 + j), p
    assert np.isclose(float(ring[0, :, cap:].abs().sum()), 0.0), "unpack wrote staging rows"
