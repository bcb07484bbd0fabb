"""The Gluon attention kernel for Hopper (dsv4/ops/triton/attention_wgmma.py: one token x 64 heads
a program, the two warp groups splitting S's keys and O's channels) against the torch reference
(dsv4.ops.attention), the definition, at its own shapes (D = 512, heads a multiple of 64): tokens
of several requests, windows, prefixes, empty ranges and -1 pages; a prefill chunk deep in a
prompt with one-item history pages (as the engine hands HCA ranges over); sinks far above and
below the scores; one source. Gluon does not run in Triton's interpreter: the kernel's checks run
on an sm_90 GPU (`DSV4_TRITON_DEVICE=cuda`); on the CPU, what `supports_wgmma` takes and the
dispatch's fallback to attention_shared.py's kernel."""
import pathlib
import sys

import pytest
import torch

from dsv4.ops.triton import attention as triton_attention
from dsv4.ops.triton import attention_shared as shared
from dsv4.ops.triton import attention_wgmma as wgmma

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from shared_inputs import TOL, check_kernel, chunk_inputs, first_tokens, random_inputs  # noqa: E402

DIM = wgmma.DIM


def on_sm90(device) -> bool:
    return device == "cuda" and wgmma.HAVE_GLUON and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def sm90(device):
    if not on_sm90(device):
        pytest.skip("the Gluon kernel runs on an sm_90 GPU only (DSV4_TRITON_DEVICE=cuda)")
    return device


def check(q, sources, sinks, **knobs):
    return check_kernel(wgmma.wgmma_attention, q, sources, sinks, **knobs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_k, stages, sums_at_end, copy_at", [
    (64, 2, False, 1), (64, 2, True, 2), (32, 3, True, 0), (32, 2, False, 2), (64, 2, False, 0)])
def test_mixed_requests(sm90, dtype, block_k, stages, sums_at_end, copy_at):
    """Tokens of 3 requests in any order, windows, prefixes, full and empty ranges, -1 pages
    (random_paged), 128 heads (two programs a token); the row sums a block or at the end; the
    next block's copy before q k^T, after it or after P's fence."""
    q, sources, sinks = random_inputs(sm90, 13, 128, torch.bfloat16, widths=(70, 150), dim=DIM)
    q, sources = q.to(dtype), [(kv.to(dtype), idx) for kv, idx in sources]
    check(q, sources, sinks, block_k=block_k, stages=stages, sums_at_end=sums_at_end, copy_at=copy_at)


@pytest.mark.parametrize("start", [0, 150, 1000])
def test_prefill_chunk(sm90, start):
    """A chunk at position `start`: the window over pages of 8 and the history's entries closing
    inside the chunk, on 2-item pages and then one-item pages."""
    q, sources, sinks = chunk_inputs(sm90, 40, 64, torch.bfloat16, start, window=128, dim=DIM)
    check(q, sources, sinks)
    one_item = [sources[0], (sources[1][0], sources[1][1].one_item_pages())]
    check(q, one_item, sinks, block_k=32, stages=3, sums_at_end=True)


def test_one_source_empty_and_large(sm90):
    """One source; zero tokens; zero-width ranges (every row on the sink alone: 0); scores and
    sinks far apart (exp2 never overflows)."""
    q, sources, sinks = random_inputs(sm90, 9, 64, torch.bfloat16, widths=(40, 90), dim=DIM)
    check(q, sources[1:], sinks)
    assert wgmma.wgmma_attention(q[:0], first_tokens(sources, 0), sinks, 0.125).shape == (0, 64, DIM)
    q0, empty, sinks0 = random_inputs(sm90, 9, 64, torch.bfloat16, widths=(0, 0), dim=DIM)
    assert check(q0, empty, sinks0).abs().max() == 0
    sinks = torch.linspace(-40.0, 40.0, 64, device=sm90)
    check(8 * q, sources, sinks)


def test_supports(device):
    """Only CUDA sm_90 with Gluon, 512 channels, heads a multiple of 64, PagedRows sources over
    pools of q's dtype: on the CPU nothing."""
    q, sources, sinks = random_inputs(device, 5, 64, torch.bfloat16, dim=DIM)
    assert wgmma.supports_wgmma(q, sources, sinks) == on_sm90(device)
    assert not wgmma.supports_wgmma(q[:, :48], sources, sinks[:48])
    assert not wgmma.supports_wgmma(q.float(), [(kv.float(), idx) for kv, idx in sources], sinks)
    assert not wgmma.supports_wgmma(q, [(sources[0][0], sources[0][1].dense())], sinks)
    q64, sources64, sinks64 = random_inputs(device, 5, 64, torch.bfloat16)
    assert not wgmma.supports_wgmma(q64, sources64, sinks64)


def test_dispatch(device, monkeypatch):
    """LONG_KERNEL = "wgmma" takes this kernel for a long prefill where it takes the inputs, else
    attention_shared.py's; both give the reference's result."""
    monkeypatch.setattr(triton_attention, "LONG_KERNEL", "wgmma")
    monkeypatch.setattr(triton_attention, "PREFILL_FROM", 4)
    monkeypatch.setattr(triton_attention, "LONG_FROM", 8)
    monkeypatch.setattr(triton_attention, "LONG_MIN_TOKENS", 4)
    monkeypatch.setattr(shared, "SHARED_TILES", shared.SharedTiles(2, 4, 16, 2, 4, 1, q_regs=True, lazy=False))
    calls = []
    for module, name in ((wgmma, "wgmma_attention"), (shared, "shared_attention")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, k=kernel, n=name, **kw: calls.append(n) or k(*a, **kw))
    heads = 64 if device == "cuda" else 4
    q, sources, sinks = chunk_inputs(device, 12, heads, torch.bfloat16, 100, dim=DIM)
    scale = DIM ** -0.5
    out = triton_attention.sparse_attention(q, sources, sinks, scale)
    assert calls == ["wgmma_attention" if on_sm90(device) else "shared_attention"]
    want = check_kernel(shared.shared_attention, q, sources, sinks)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])
