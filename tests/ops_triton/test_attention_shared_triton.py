"""The shared-tile attention kernel (dsv4/ops/triton/attention_shared.py: BLOCK_T tokens x
H_BLOCK heads a program over the union of their paged ranges, the output channels split across
D_PARTS programs) against the torch reference (dsv4.ops.attention), the definition: tokens of
several requests in one block, windows, prefixes, empty ranges and -1 pages; a prefill chunk
deep in a prompt (the C128-like history closing entries inside the chunk, the window ring);
sinks, RoPE-scaled channels, partial token and head blocks; the dispatch behind LONG_KERNEL."""
import pathlib
import sys

import pytest
import torch

from dsv4.ops.triton import attention as triton_attention
from dsv4.ops.triton import attention_shared as shared

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from shared_inputs import D, TOL, check_kernel, chunk_inputs, first_tokens, random_inputs, reference  # noqa: E402


def check(q, sources, sinks, **knobs):
    return check_kernel(shared.shared_attention, q, sources, sinks, **knobs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_t, h_block, d_parts, q_regs, lazy", [
    (1, 16, 1, False, True), (2, 8, 2, True, False), (4, 8, 1, True, True), (4, 4, 2, False, False)])
def test_mixed_requests(device, dtype, block_t, h_block, d_parts, q_regs, lazy):
    """Tokens of 3 requests in any order: every block's groups walk their own page rows; a
    partial last token block (13 tokens); rows with no valid key get 0 (all weight on the sink);
    q's own channels in registers or shared memory; lazy or eager rescaling."""
    q, sources, sinks = random_inputs(device, 13, 8, dtype)
    check(q, sources, sinks, block_t=block_t, h_block=h_block, block_k=16, d_parts=d_parts, q_regs=q_regs,
          lazy=lazy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 150])
@pytest.mark.parametrize("d_parts", [1, 2])
def test_prefill_chunk(device, dtype, start, d_parts):
    """A chunk at position `start` (0: the history fills from empty): the shared prefix and the
    entries closing inside the chunk, the window over pages of 8, history pages of 2 (a block
    of 16 keys spans 8 of them), then one-item pages (as the engine hands the history over), 6
    heads (a partial head block of 8)."""
    q, sources, sinks = chunk_inputs(device, 14, 6, dtype, start)
    check(q, sources, sinks, block_t=2, h_block=8, block_k=16, d_parts=d_parts)
    one_item = [sources[0], (sources[1][0], sources[1][1].one_item_pages())]
    check(q, one_item, sinks, block_t=4, h_block=4, block_k=32, d_parts=d_parts)


def test_one_source_and_empty(device):
    """One source; zero tokens; zero-width ranges (every row on the sink alone: 0)."""
    q, sources, sinks = random_inputs(device, 9, 4, torch.float32)
    check(q, sources[1:], sinks, block_t=4, h_block=4)
    assert shared.shared_attention(q[:0], first_tokens(sources, 0), sinks, 0.125).shape == (0, 4, D)
    q, sources, sinks = random_inputs(device, 9, 4, torch.float32, widths=(0, 0))
    assert check(q, sources, sinks, block_t=2, h_block=8).abs().max() == 0


def test_large_logits_and_sinks(device):
    """Large scores and sinks (one far above every score, one far below): exp2 never overflows."""
    q, sources, sinks = chunk_inputs(device, 8, 4, torch.float32, 50)
    sinks = torch.tensor([40.0, -40.0, 0.0, 5.0], device=q.device)
    check(30 * q, sources, sinks, block_t=2, h_block=8, d_parts=2)


@pytest.mark.parametrize("lazy", [True, False])
def test_rising_scores(device, lazy):
    """Scores rising along the history walk, ~0.33 (log2 units) an entry over ~600 entries (~5 a
    16-key block, 200 in all: past exp2's range without rescaling): the lazy walk keeps m behind
    the max by less than SLACK = 8 for a block, then rescales; both give the reference's result."""
    q, sources, sinks = chunk_inputs(device, 6, 4, torch.float32, 2400)
    kv, idx = sources[1]
    rows = idx.dense()[-1]                                      # the last token's entries, in item order
    rows = rows[rows >= 0]
    direction = torch.randn(D, generator=torch.Generator().manual_seed(1)).to(device)
    kv = kv.clone()
    kv[rows] = direction * torch.linspace(0.0, 1.0, len(rows), device=device)[:, None]
    # q.k x scale x log2(e) from 0 to 200 along the entries
    q = (direction * 200 / (direction @ direction) ** 0.5 / (D ** -0.5 * 1.4427)).expand_as(q).contiguous()
    check(q, [sources[0], (kv, idx)], sinks, block_t=2, h_block=4, block_k=16, lazy=lazy)


def test_supports():
    """Only PagedRows sources over pools of q's dtype and width."""
    q, sources, sinks = random_inputs("cpu", 5, 4, torch.float32)
    assert shared.supports_shared(q, sources, sinks)
    assert not shared.supports_shared(q, [(sources[0][0], sources[0][1].dense())], sinks)
    assert not shared.supports_shared(q, [(sources[0][0].to(torch.bfloat16), sources[0][1])], sinks)
    assert not shared.supports_shared(q, [(sources[0][0][:, :32], sources[0][1])], sinks)


def test_dispatch_behind_switch(device, monkeypatch):
    """triton.attention.sparse_attention takes LONG_KERNEL's kernel for a long prefill only when
    it is set ("wgmma" by default, this kernel where that one does not apply), for PagedRows
    sources, and gives the reference's result."""
    assert triton_attention.LONG_KERNEL == "wgmma"
    monkeypatch.setattr(triton_attention, "LONG_KERNEL", None)
    calls = []
    kernel = shared.shared_attention
    monkeypatch.setattr(shared, "shared_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    monkeypatch.setattr(triton_attention, "PREFILL_FROM", 4)
    monkeypatch.setattr(triton_attention, "LONG_FROM", 8)
    monkeypatch.setattr(triton_attention, "LONG_MIN_TOKENS", 4)
    monkeypatch.setattr(shared, "SHARED_TILES", shared.SharedTiles(2, 4, 16, 2, 4, 1, q_regs=True, lazy=False))
    q, sources, sinks = chunk_inputs(device, 12, 4, torch.bfloat16, 100)
    scale = D ** -0.5
    triton_attention.sparse_attention(q, sources, sinks, scale)
    assert not calls                                            # off
    monkeypatch.setattr(triton_attention, "LONG_KERNEL", "shared")
    out = triton_attention.sparse_attention(q, sources, sinks, scale)
    assert len(calls) == 1
    torch.testing.assert_close(out.float(), reference(q, sources, sinks, scale).float(), **TOL[torch.bfloat16])
    triton_attention.sparse_attention(q, [(sources[0][0], sources[0][1].dense()), sources[1]], sinks, scale)
    triton_attention.sparse_attention(q, sources, sinks, scale, block_k=16)     # knobs: the per-token kernel
    triton_attention.sparse_attention(q[:3], first_tokens(sources, 3), sinks, scale)
    assert len(calls) == 1                                      # dense source, knobs, a short step: not taken
