"""Closing compressor groups: the Triton kernel (dsv4/ops/triton/compress.py) against the
reference composition of dsv4/ops/compress.py (compress_pool over cat(ring, fresh) ->
rms_norm -> RoPE at the group's position -> pool[entry_slot])."""
import pytest
import torch

from dsv4.ops.compress import compress_pool
from dsv4.ops.norm import rms_norm
from dsv4.ops.rope import apply_rope, rope_cos_sin
from dsv4.ops.triton import compress as tri

EPS = 1e-6
# (name, overlap, m, D, R): a CSA geometry and an HCA-like one with m != 128
GEOMETRIES = [("csa", True, 4, 32, 8), ("hca", False, 8, 16, 4)]


def make_inputs(overlap, m, D, R, G, dtype, device, seed=0):
    """Ring and fresh sources, G groups whose rows mix both sources (and -1 holes in the first
    group), a pool with scattered entry slots."""
    g = torch.Generator().manual_seed(seed)
    C, span = (2 * D, 2 * m) if overlap else (D, m)
    ring_rows, T = 2 * span + 3, G * m + 2
    ring_kv, ring_gate = (torch.randn(ring_rows, C, generator=g).to(dtype) for _ in range(2))
    kv, gate = (torch.randn(T, C, generator=g).to(dtype) for _ in range(2))
    rows = torch.stack([torch.randperm(ring_rows + T, generator=g)[:span] for _ in range(G)] or
                       [torch.zeros(0, span, dtype=torch.long)]).reshape(G, span)
    if G:       # CSA's first group has no previous group; a hole in HCA's
        rows[0, : m if overlap else 1] = -1
    ape = torch.randn(m, C, generator=g)
    norm_w = 1 + 0.1 * torch.randn(D, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(R, dtype=torch.float32) / R))
    entry_pos = torch.randint(0, 5000, (G,), generator=g)
    pool = torch.randn(3 * G + 4, D, generator=g).to(dtype)
    entry_slot = torch.randperm(pool.shape[0], generator=g)[:G]
    cos, sin = rope_cos_sin(entry_pos, inv_freq)
    args = (ring_kv, ring_gate, kv, gate, rows, ring_rows, ape, overlap, norm_w, EPS, cos, sin, pool, entry_slot)
    return tuple(a.to(device) if torch.is_tensor(a) else a for a in args)


def reference(ring_kv, ring_gate, kv, gate, rows, ring_rows, ape, overlap, norm_w, eps, cos, sin,
              pool, entry_slot):
    """The pool after the reference composition (a copy; inputs untouched)."""
    pooled = compress_pool(torch.cat([ring_kv, kv.to(ring_kv.dtype)]),
                           torch.cat([ring_gate, gate.to(ring_gate.dtype)]), rows, ape, overlap)
    out = pool.clone()
    out[entry_slot] = apply_rope(rms_norm(pooled, norm_w, eps), cos, sin).to(pool.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [0, 1, 5])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[g[0] for g in GEOMETRIES])
def test_close_groups_matches_reference(geometry, G, dtype, device):
    _, overlap, m, D, R = geometry
    args = make_inputs(overlap, m, D, R, G, dtype, device, seed=G * 10 + m)
    want = reference(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    pool, slots = args[12], args[13].cpu()
    before = pool.cpu().clone()
    tri.close_groups(*args)
    got = pool.cpu()
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got[untouched], before[untouched])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:       # bf16: the same roundings; the fp32 sums' order (and exp) may flip a rare one
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert (got == want).float().mean() > 0.97


@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
def test_several_channel_blocks(overlap, device):
    """A small tile splits D = 48 into blocks of 32 channels (the last one half masked): the
    norm still spans all of them and the RoPE pairs stay aligned."""
    args = make_inputs(overlap, 4 if overlap else 8, 48, 8, 3, torch.float32, device, seed=5)
    want = reference(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    tri.close_groups(*args, tile=256)
    torch.testing.assert_close(args[12].cpu(), want, rtol=1e-5, atol=1e-5)


def test_fresh_rows_cast_to_ring_dtype(device):
    """Fresh projections in fp32 with a bf16 ring and pool: cast to the ring's dtype first."""
    args = list(make_inputs(True, 4, 32, 8, 3, torch.bfloat16, device, seed=3))
    args[2], args[3] = args[2].float() + 1e-3, args[3].float()
    want = reference(*(a.cpu() if torch.is_tensor(a) else a for a in args))
    tri.close_groups(*args)
    torch.testing.assert_close(args[12].cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


def test_model_logits_unchanged_through_triton(monkeypatch, device):
    """A tiny model's prefill logits are the same with the compressors routed through the
    kernels (every other op on its torch reference, so only the compressor differs)."""
    from dsv4.engine.oneshot import full_logits
    from dsv4.model.weights import load_model
    from dsv4.ops import compress
    from dsv4.ops import backend

    model = load_model("random:tiny", device)
    ids = [(7 * i + 3) % model.cfg.vocab_size for i in range(300)]
    calls = []
    real = tri.close_groups
    with backend.forced("reference"):
        want = full_logits(model, ids)
        monkeypatch.setattr(tri, "close_groups", lambda *a: calls.append(a[7]) or real(*a))
        monkeypatch.setattr(compress, "use_triton", lambda t: True)
        got = full_logits(model, ids)
    assert True in calls and False in calls          # CSA (and indexer) and HCA groups closed
    scale = want.abs().max()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_write_matches_reference(dtype, device):
    """Both rings get the fresh rows src at rows dst, from strided fp32 column slices."""
    from dsv4.ops.compress import ring_write
    from dsv4.ops.backend import forced
    g = torch.Generator().manual_seed(0)
    C = 40
    proj = torch.randn(6, 2 * C + 3, generator=g)
    kv, gate = proj[:, :C], proj[:, C:2 * C]
    rings = [torch.randn(9, C, generator=g).to(dtype) for _ in range(2)]
    dst, src = torch.tensor([7, 0, 3]), torch.tensor([5, 1, 2])
    want = [r.clone() for r in rings]
    with forced("reference"):
        ring_write(*want, kv, gate, dst, src)
    got = [r.to(device) for r in rings]
    tri.ring_write(*got, kv.to(device), gate.to(device), dst.to(device), src.to(device), block_c=16)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
