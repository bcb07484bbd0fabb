"""Triton sparse shared-KV attention against the torch reference (dsv4.ops.attention), the
definition: one/two sources, -1 holes, rows with no valid key, repeated rows, full lists,
head dims that are not a power of two, split slots (flash-decoding) and the dispatch; paged
sources (PagedRows) against their dense form, bit for bit."""
import pathlib
import sys

import pytest
import torch

import dsv4.ops.attention as attention_ops
from dsv4.ops import backend
from dsv4.ops.paged import PagedRows, dense_index
from dsv4.ops.triton import attention as triton_attention

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "ops"))
from paged_inputs import MIXES, mixed_sources, random_paged  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def reference(*args):
    """The torch reference, also on CUDA (where the op would dispatch to the kernel)."""
    with backend.forced("reference"):
        return attention_ops.sparse_attention(*args)


def make_inputs(device, T, H, D, lists, dtype=torch.float32, pool_rows=(37, 53), holes=0.3, seed=0):
    """q [T, H, D], sources [(kv [N, D], idx [T, K])] for K in `lists`, sinks [H]. Indices are
    random (so rows repeat), a fraction `holes` is -1, and token 1 (if any) has no valid key."""
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(T, H, D, generator=g)).to(device, dtype)     # x3: sharper softmax than N(0, 1)
    sources = []
    for K, N in zip(lists, pool_rows):
        kv = torch.randn(N, D, generator=g).to(device, dtype)
        idx = torch.randint(0, N, (T, K), generator=g)
        idx[torch.rand(T, K, generator=g) < holes] = -1
        if T > 1:
            idx[1] = -1
        sources.append((kv, idx.to(device)))
    sinks = torch.randn(H, generator=g).to(device)
    return q, sources, sinks


def check(q, sources, sinks, **knobs):
    scale = q.shape[-1] ** -0.5
    out = triton_attention.sparse_attention(q, sources, sinks, scale, **knobs)
    want = reference(q, sources, sinks, scale)
    assert out.shape == want.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), want.float(), **TOL[q.dtype])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 5])
@pytest.mark.parametrize("H", [4, 16])
@pytest.mark.parametrize("lists", [(24,), (20, 45)], ids=["one_source", "two_sources"])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_reference(device, dtype, T, H, lists, splits):
    q, sources, sinks = make_inputs(device, T, H, 64, lists, dtype)
    out = check(q, sources, sinks, num_splits=splits)
    if T > 1:
        assert out[1].abs().max() == 0          # no valid key: all weight on the sink


@pytest.mark.parametrize("D", [48, 80])
def test_head_dim_not_power_of_two(device, D):
    check(*make_inputs(device, 3, 4, D, (16, 24)))


@pytest.mark.parametrize("lists", [(32, 64), (20, 45)], ids=["block_multiple", "ragged"])
def test_full_lists(device, lists):
    """Maximum-length lists: every slot valid."""
    check(*make_inputs(device, 4, 16, 64, lists, holes=0.0), block_k=16, num_splits=2)


def test_repeated_rows(device):
    """Every slot of a token names the same row: the softmax must count each slot."""
    q, sources, sinks = make_inputs(device, 3, 4, 64, (8, 8), holes=0.0)
    for _, idx in sources:
        idx[:] = 5
    check(q, sources, sinks)


def test_empty_and_hollow_lists(device):
    """A zero-length second list and an all -1 list: output 0 only where nothing is valid."""
    q, sources, sinks = make_inputs(device, 3, 4, 64, (16, 1))
    kv1, idx1 = sources[1]
    check(q, [sources[0], (kv1, idx1[:, :0])], sinks)
    out = check(q, [(sources[0][0], torch.full_like(sources[0][1], -1))], sinks)
    assert out.abs().max() == 0


def test_partial_head_blocks_and_strides(device):
    """H = 40 over blocks of 16 (the last one masked); q and idx not contiguous; int32 indices."""
    q, sources, sinks = make_inputs(device, 3, 40, 64, (16, 24))
    q = torch.cat([q, q], dim=-1)[..., ::2]                   # stride(2) == 2
    kv1, idx1 = sources[1]
    idx1 = torch.cat([idx1, idx1], dim=-1)[:, ::2].to(torch.int32)
    check(q, [sources[0], (kv1, idx1)], sinks, h_block=16)


def test_large_logits_and_sinks(device):
    """Scores far above and far below the sink stay finite and exact."""
    q, sources, sinks = make_inputs(device, 3, 4, 64, (16, 24))
    check(q * 10, sources, sinks * 20)


def test_dispatch_and_fallback(device, monkeypatch):
    """ops.attention.sparse_attention runs the kernel where the Triton backend is chosen and the
    inputs are supported; anything else (three sources, a pool of another dtype) goes to the
    reference, which the kernel's own wrapper refuses."""
    calls = []
    kernel = triton_attention.sparse_attention
    monkeypatch.setattr(attention_ops, "use_triton", lambda t: True)
    monkeypatch.setattr(triton_attention, "sparse_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    q, sources, sinks = make_inputs(device, 3, 4, 64, (16, 24, 8), pool_rows=(37, 53, 11))
    scale = 0.125
    for srcs in (sources[:2], sources, [(sources[0][0].double(), sources[0][1])]):
        monkeypatch.setattr(attention_ops, "use_triton", lambda t: True)
        got = attention_ops.sparse_attention(q, srcs, sinks, scale)
        monkeypatch.setattr(attention_ops, "use_triton", lambda t: False)
        torch.testing.assert_close(got, attention_ops.sparse_attention(q, srcs, sinks, scale), **TOL[q.dtype])
    assert len(calls) == 1
    assert not triton_attention.supports(q, sources, sinks)
    with pytest.raises(AssertionError):
        kernel(q, sources, sinks, scale)


def paged_inputs(device, T, dtype, widths=(16, 24), seed=0, index_dtype=torch.long, per_pages=(16, 4)):
    """q, sources [(pool, PagedRows)] (a window-like source of 16-item pages and a history-like
    one of 4-item pages, pitch 3x: pages interleaved with other layers'), sinks. With blocks of
    16 slots the kernel reads the first source's pages two a block, the second's slot by slot."""
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(T, 4, 64, generator=g)).to(device, dtype)
    sources = []
    for i, (width, per_page) in enumerate(zip(widths, per_pages)):
        paged, rows = random_paged(T, width, per_page=per_page, pitch=3 * per_page, seed=seed + i, device=device)
        paged = PagedRows(*(v.to(index_dtype) for v in (paged.pages, paged.req, paged.lo, paged.hi)),
                          per_page=paged.per_page, pitch=paged.pitch, width=paged.width)
        sources.append((torch.randn(rows, 64, generator=g).to(device, dtype), paged))
    return q, sources, torch.randn(4, generator=g).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_is_dense(device, dtype, mix, splits):
    """A PagedRows source gives the kernel's own result for its dense form, bit for bit (tokens
    of several requests, windows with lo > 0, short and empty ranges, -1 pages), whether the
    slots are split or not, and the reference's within tolerance."""
    q, sources, sinks = paged_inputs(device, 13, dtype)
    sources, dense = mixed_sources(sources, mix)
    knobs = dict(num_splits=splits, block_k=16)
    out = check(q, sources, sinks, **knobs)
    assert torch.equal(out, triton_attention.sparse_attention(q, dense, sinks, q.shape[-1] ** -0.5, **knobs))


@pytest.mark.parametrize("widths", [(16, 0), (0, 24), (0, 0), (5, 37), (40, 9)])
def test_paged_widths_and_int32(device, widths):
    """Zero and ragged widths (no slot at all, splits over a ragged virtual list), int32 tables,
    pages smaller than, as large as and larger than a block."""
    q, sources, sinks = paged_inputs(device, 9, torch.float32, widths, seed=3, index_dtype=torch.int32,
                                     per_pages=(32, 16))
    dense = [(kv, dense_index(idx)) for kv, idx in sources]
    for splits, block_k in ((1, 16), (2, 16), (2, 32)):
        knobs = dict(num_splits=splits, block_k=block_k)
        out = check(q, sources, sinks, **knobs)
        assert torch.equal(out, triton_attention.sparse_attention(q, dense, sinks, q.shape[-1] ** -0.5, **knobs))
    if widths == (0, 0):
        assert out.abs().max() == 0


def test_paged_dispatch(device, monkeypatch):
    """ops.attention.sparse_attention sends PagedRows sources to the kernel."""
    calls = []
    kernel = triton_attention.sparse_attention
    monkeypatch.setattr(attention_ops, "use_triton", lambda t: True)
    monkeypatch.setattr(triton_attention, "sparse_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    q, sources, sinks = paged_inputs(device, 5, torch.float32)
    assert triton_attention.supports(q, sources, sinks)
    got = attention_ops.sparse_attention(q, sources, sinks, 0.125)
    assert len(calls) == 1
    torch.testing.assert_close(got, reference(q, sources, sinks, 0.125), **TOL[q.dtype])
    short = [(sources[0][0], PagedRows(*(v for v in (sources[0][1].pages, sources[0][1].req[:4],
                                                         sources[0][1].lo[:4], sources[0][1].hi[:4])),
                                       per_page=16, pitch=48, width=16))]
    assert not triton_attention.supports(q, short, sinks)           # a token count other than T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix, splits", [("both", 3), ("second", 1)])
def test_packed_fp8_pools(device, dtype, mix, splits, monkeypatch):
    """Packed FP8 pools (dsv4/ops/kv_fp8.py; D = 64 with 16 RoPE channels: one partial scale
    block) read in the kernel: the reference's result given the packed pools (which dequantises
    the addressed rows), paged and dense sources, mixed with a plain pool; the dispatch of
    ops.attention sends packed pools to the kernel."""
    from dsv4.ops.kv_fp8 import pack_entries
    q, sources, sinks = paged_inputs(device, 13, dtype)
    sources[1] = (sources[1][0], sources[1][1].dense())
    packed = [(pack_entries(kv.float(), 16), idx) if mix in ("both", name) else (kv, idx)
              for (kv, idx), name in zip(sources, ("first", "second"))]
    assert triton_attention.supports(q, packed, sinks, 16) and not triton_attention.supports(q, packed, sinks)
    out = triton_attention.sparse_attention(q, packed, sinks, 0.125, rope_dims=16, num_splits=splits, block_k=16)
    with backend.forced("reference"):
        want = attention_ops.sparse_attention(q, packed, sinks, 0.125, 16)
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    calls = []
    monkeypatch.setattr(attention_ops, "use_triton", lambda t: True)
    kernel = triton_attention.sparse_attention
    monkeypatch.setattr(triton_attention, "sparse_attention", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    attention_ops.sparse_attention(q, packed, sinks, 0.125, 16)
    assert calls == [{"rope_dims": 16}]


def v4_packed_inputs(device, T, dtype, window, history, seed=0):
    """V4's row layout (D = 512: 448 FP8 channels in 7 scale blocks + 64 bf16 RoPE channels,
    584-byte rows): q, [(SWA pool, window PagedRows), (C128-like pool, 2-entry pages)], sinks.
    Each 64-channel block has its own magnitude (2^-3 .. 2^3), so every block gets its own
    scale byte, and the RoPE channels another."""
    from dsv4.ops.kv_fp8 import entry_bytes, pack_entries
    g = torch.Generator().manual_seed(seed)
    D, rope = 512, 64
    magnitude = torch.cat([torch.full((64,), 2.0 ** (b - 3)) for b in range(7)] + [torch.full((rope,), 0.7)])
    q = (torch.randn(T, 16, D, generator=g) / magnitude).to(device, dtype)   # each block counts alike in q.k
    sources = []
    for i, (width, per_page) in enumerate(((window, 16), (history, 2))):
        paged, rows = random_paged(T, width, per_page=per_page, pitch=3 * per_page, seed=seed + i, device=device)
        kv = torch.randn(rows, D, generator=g) * magnitude
        packed = pack_entries(kv, rope).to(device)
        assert packed.shape[1] == entry_bytes(D, rope) == 584
        sources.append((packed, paged))
    return q, sources, torch.randn(16, generator=g).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_fp8_v4_rows_long_lists_split(device, dtype):
    """V4-shaped packed rows over a long history (HCA-like pages of 2 entries, read slot by slot)
    split over several programs, and not split: the reference's result given the packed pools,
    the split and unsplit results within the kernel's own float error of each other."""
    q, sources, sinks = v4_packed_inputs(device, 3, dtype, window=24, history=200)
    scale = 512 ** -0.5
    with backend.forced("reference"):
        want = attention_ops.sparse_attention(q, sources, sinks, scale, 64)
    outs = []
    for splits in (1, 5):
        out = triton_attention.sparse_attention(q, sources, sinks, scale, rope_dims=64, num_splits=splits, block_k=16)
        torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
        outs.append(out)
    assert want.abs().max() > 0.1                                  # the scores are not all in the sink
    torch.testing.assert_close(outs[0].float(), outs[1].float(), **TOL[dtype])


@pytest.mark.parametrize("T, slots, dtype, pool_dtype, expected", [
    (255, 4096, torch.bfloat16, torch.bfloat16, "DECODE_TILES"),    # too few tokens for the long tile
    (256, 4096, torch.bfloat16, torch.bfloat16, "LONG_TILES"),      # a short chunk deep in a prompt
    (256, 1024, torch.bfloat16, torch.bfloat16, "DECODE_TILES"),    # short slot list, below PREFILL_FROM
    (2048, 1024, torch.bfloat16, torch.bfloat16, "PREFILL_TILES"),
    (2048, 4096, torch.bfloat16, torch.bfloat16, "LONG_TILES"),
    (2048, 4096, torch.bfloat16, torch.uint8, "PREFILL_TILES"),     # packed FP8 rows keep the prefill tile
    (2048, 4096, torch.float32, torch.float32, "DECODE_TILES"),     # fp32 (checks) always the decode tile
])
def test_default_tiles_by_step_and_slot_list(T, slots, dtype, pool_dtype, expected):
    q = torch.empty(T, 1, 8, dtype=dtype)
    tiles = triton_attention._default_tiles(q, slots, [torch.empty(1, 8, dtype=pool_dtype)])
    assert tiles == getattr(triton_attention, expected)
