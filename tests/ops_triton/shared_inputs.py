"""Inputs of the shared-tile and two-pass attention tests (tests/ops_triton): paged sources of
random ranges over several requests, and a prefill chunk of one request deep in a prompt."""
import pathlib
import sys

import torch

import dsv4.ops.attention as attention_ops
from dsv4.ops import backend
from dsv4.ops.paged import PagedRows

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "ops"))
from paged_inputs import random_paged  # noqa: E402

TOL = {torch.float32: dict(rtol=5e-5, atol=5e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-2, atol=2e-2)}
D, ROPE = 64, 16          # fp32 tolerance: scores up to ~100 (q x3, RoPE channels x4), summed in another order


def reference(q, sources, sinks, scale):
    with backend.forced("reference"):
        return attention_ops.sparse_attention(q, sources, sinks, scale, ROPE)


def check_kernel(kernel, q, sources, sinks, **knobs):
    """kernel(q, sources, sinks, scale, **knobs) against the reference -> its output."""
    scale = q.shape[-1] ** -0.5
    out = kernel(q, sources, sinks, scale, **knobs)
    want = reference(q, sources, sinks, scale)
    assert out.shape == want.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), want.float(), **TOL[q.dtype])
    return out


def rows(g, n, device, dtype, dim=D):
    """n pool rows; the last ROPE channels (RoPE'd in the model) 4x larger: a kernel mixing up
    the channel halves of a split would score them wrongly."""
    kv = torch.randn(n, dim, generator=g)
    kv[:, -ROPE:] *= 4
    return kv.to(device, dtype)


def random_inputs(device, T, H, dtype, widths=(16, 24), per_pages=(16, 4), seed=0, dim=D):
    """q [T, H, D], two (pool, PagedRows) sources of random_paged ranges (3 requests mixed in any
    block; windows, prefixes, full and empty ranges; -1 pages; pitch 3x), sinks [H]."""
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(T, H, dim, generator=g)).to(device, dtype)
    sources = []
    for i, (width, per_page) in enumerate(zip(widths, per_pages)):
        paged, n = random_paged(T, width, per_page=per_page, pitch=3 * per_page, seed=seed + i, device=device)
        sources.append((rows(g, n, device, dtype, dim), paged))
    return q, sources, (2 * torch.randn(H, generator=g)).to(device)


def chunk_inputs(device, T, H, dtype, start, window=16, ratio=4, per_pages=(8, 2), seed=0, dim=D):
    """A prefill chunk of one request at positions start + t: the window (pos - window, pos] on
    per_pages[0]-item pages and the history of entries e < (pos + 1) // ratio from 0 on
    per_pages[1]-item pages (entries close inside the chunk), shuffled pages interleaved with
    another layer's (pitch 2x), -1 pages below the window and past the last entry."""
    g = torch.Generator().manual_seed(seed)
    pos = start + torch.arange(T)
    q = (3 * torch.randn(T, H, dim, generator=g)).to(device, dtype)
    sources = []
    for lo, hi, width, per_page in ((pos - window + 1).clamp(min=0), pos + 1, window, per_pages[0]), \
                                   (torch.zeros(T, dtype=torch.long), (pos + 1) // ratio,
                                    int((start + T) // ratio), per_pages[1]):
        first, count = int(lo.min()) // per_page, int(hi.max() - 1) // per_page + 1
        pages = torch.full((1, count + 1), -1, dtype=torch.long)
        pages[0, first:count] = torch.randperm(count - first, generator=g)
        paged = PagedRows(pages.to(device), torch.zeros(T, dtype=torch.long, device=device), lo.to(device),
                          hi.to(device), per_page, 2 * per_page, max(width, 1))
        sources.append((rows(g, (count - first) * 2 * per_page, device, dtype, dim), paged))
    return q, sources, (2 * torch.randn(H, generator=g)).to(device)


def first_tokens(sources, n):
    """The sources of a step's first n tokens."""
    return [(kv, PagedRows(idx.pages, idx.req[:n], idx.lo[:n], idx.hi[:n], idx.per_page, idx.pitch, idx.width))
            for kv, idx in sources]
