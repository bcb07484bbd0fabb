"""A 64k-token prompt prefills in chunks of 2048 in memory bounded by the cache, not by
tokens x entries (docs/architecture.md, "Cache": addressing is O(tokens + pages), the indexer
streams its scores in tiles), and its last-position logits equal a whole-prompt prefill's
(invariant 5: chunks keep what they read; `last_row_of_whole_prefill`).

The model is the tiny preset cut to one CSA layer (the one whose indexer scores every causal
C4 entry) with one small indexer head: the indexer's O(T * E) work, which is its nature (2^29
token-entry pairs here, chunked), is most of the test's time. Peak process memory is the
kernel's high-water mark of the resident set (VmHWM, reset through /proc/self/clear_refs),
measured around the engine's whole life: cache allocation, every chunk, the result."""
from __future__ import annotations

import ctypes
import dataclasses
import os

import pytest
import torch

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.oneshot import full_logits
from dsv4.model import compressor
from dsv4.model.random_model import build_random_model
from dsv4.ops.indexer import TILE_ELEMS, indexer_topk

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = 65536
CHUNK = 2048
MIB = 2**20
ONE_CSA_LAYER = dict(num_hidden_layers=1, compress_ratios=[4, 0], num_hash_layers=0, index_n_heads=1,
                     index_head_dim=16, vocab_size=256, max_position_embeddings=2 * PROMPT)
# What a step may hold beside the cache, independent of the context: eight fp32 intermediates
# of the indexer's tile size (TILE_ELEMS: a tile's gathered keys, scores and int64 top-k keys;
# the attention block's gathered rows; a 2048-token chunk's activations are far smaller).
# Measured on x86-64 Linux: about 110 MiB with a 5.7 MiB cache.
STEP_WORKSPACE = 8 * TILE_ELEMS * 4


def high_water_mark() -> int:
    """The process's peak resident set since the last reset, in bytes."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024


def reset_high_water_mark() -> int:
    """Return freed heap to the system, reset the peak to the current resident set; -> it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return high_water_mark()


def last_row_of_whole_prefill(model, ids: list[int]) -> torch.Tensor:
    """The last position's logits of one whole-prompt prefill (dsv4/engine/oneshot.py) [vocab],
    the indexer choosing for the last token only (-1, nothing, for the others): in a one-layer
    model tokens meet only in that layer's attention, whose keys, values and indexer keys come
    from the layer's input, so no other token's choice reaches the last row. The indexer's
    O(T x E) work for the 64k - 1 other rows (2^30 token-entry pairs, most of the test's time)
    thus changes nothing the test compares."""
    assert model.cfg.num_hidden_layers == 1
    calls = []

    def last_token_only(q, weights, keys, cand, topk, weight_scale=1.0):
        last = dataclasses.replace(cand, req=cand.req[-1:], lo=cand.lo[-1:], hi=cand.hi[-1:])
        row = indexer_topk(q[-1:], weights[-1:], keys, last, topk, weight_scale)
        calls.append(row.shape)
        return torch.cat([torch.full((q.shape[0] - 1, row.shape[1]), -1, dtype=row.dtype), row])

    with pytest.MonkeyPatch.context() as m:
        m.setattr(compressor, "indexer_topk", last_token_only)
        logits = full_logits(model, ids)[-1]
    assert len(calls) == 1 and calls[0][1] == model.cfg.index_topk      # the one CSA layer chose
    return logits


@pytest.fixture(scope="module")
def model():
    return build_random_model("random:tiny", overrides=ONE_CSA_LAYER, seed=7)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_64k_prompt_prefills_in_chunks_in_bounded_memory(model, forcer, h):
    cfg = model.cfg
    assert cfg.compress_ratios[:cfg.num_hidden_layers] == (4,)
    ids = torch.randint(2, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(64)).tolist()
    entries = PROMPT // 4                                   # C4 entries causal to the last token

    def engine():
        return LLMEngine("random:tiny", EngineConfig(device="cpu", dtype="float32", max_num_seqs=1,
                                                     max_num_batched_tokens=CHUNK, num_pages=PROMPT // 256 + 1,
                                                     enable_prefix_caching=False, async_scheduling="off"), model=model)

    # first, a chunk and a bit on an engine of its own: what a process pays once (modules imported on
    # first use, the allocator's arenas) is not the step's and stays out of the peak
    forcer.run(engine(), [h.Forced("warm-up", ids[:CHUNK + 64], all_logits=False)])
    base = reset_high_water_mark()
    eng = engine()
    run = forcer.run(eng, [h.Forced("long", ids, all_logits=False)])
    peak = high_water_mark() - base
    cache = eng.runner.storage.nbytes()

    chunks = [n for step in run.steps for (_, _, n) in step]
    assert len(chunks) == PROMPT // CHUNK and set(chunks) == {CHUNK}
    whole_table = PROMPT * entries * 4                      # one fp32 [T, E] score table: 4 GiB
    chunk_table = CHUNK * entries * 8                       # one chunk's int64 [T, E] table: 256 MiB
    bound = 2 * cache + STEP_WORKSPACE
    assert bound < chunk_table < whole_table
    assert peak <= bound, (f"peak {peak / MIB:.0f} MiB above the bound {bound / MIB:.0f} MiB (cache "
                           f"{cache / MIB:.1f} MiB); an O(T x E) table is {whole_table / MIB:.0f} MiB")

    last = run.logits["long"][PROMPT - 1]
    want = last_row_of_whole_prefill(model, ids)
    h.assert_rows_close(last[None], want[None], [PROMPT - 1], "64k chunked vs whole prompt")
