"""The packed FP8 row writers in Triton (dsv4/ops/triton/kv_pack.py) against the torch
definition (dsv4/ops/kv_fp8.py pack_entries / pack_index_keys): the written pool rows bit for
bit (bf16 rows, whose amax / 448 is exact in fp32), rows scattered in any order, the other rows
untouched; and the dispatch of kv_fp8.write_* to the kernel."""
import pytest
import torch

from dsv4.ops import kv_fp8
from dsv4.ops.triton import kv_pack


def rows_of(n_rows: int, width: int, seed: int, dtype) -> torch.Tensor:
    """[n_rows, width]: every 64-channel block its own magnitude (2^-12 .. 2^10), one row all
    zero (the amax floor), one with a block at exactly 448 * 2^k (a scale boundary)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, width, generator=g)
    x = x * torch.exp2(torch.randint(-12, 11, (n_rows, -(-width // 64)), generator=g).float()
                       ).repeat_interleave(64, dim=1)[:, :width]
    x[1] = 0
    x[2, :8] = 448.0 * 2.0 ** -5
    return x.to(dtype)


def scattered(n_pool: int, n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n_pool, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("dim, rope", [(512, 64), (64, 16), (200, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_entries_bit_for_bit(device, dim, rope, dtype):
    x, rows = rows_of(9, dim, dim, dtype), scattered(23, 9, dim)
    width = kv_fp8.entry_bytes(dim, rope)
    want = torch.full((23, width), 7, dtype=torch.uint8)
    want[rows] = kv_fp8.pack_entries(x, rope)
    got = torch.full((23, width), 7, dtype=torch.uint8, device=device)
    kv_pack.write_entries(got, rows.to(device), x.to(device), rope)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("di", [128, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_keys_bit_for_bit(device, di, dtype):
    x, rows = rows_of(9, di, di, dtype), scattered(17, 9, di)
    want = torch.full((17, di + 4), 7, dtype=torch.uint8)
    want[rows] = kv_fp8.pack_index_keys(x)
    got = torch.full((17, di + 4), 7, dtype=torch.uint8, device=device)
    kv_pack.write_index_keys(got, rows.to(device), x.to(device))
    assert torch.equal(got.cpu(), want)


def test_dispatch_and_fallback(device, monkeypatch):
    """kv_fp8.write_* take the kernel where Triton runs and the inputs suit it, the torch
    definition otherwise (a pool that is not packed, an index-key pool of odd alignment)."""
    calls = []
    monkeypatch.setattr(kv_fp8, "use_triton", lambda t: True)
    for name in ("write_entries", "write_index_keys"):
        kernel = getattr(kv_pack, name)
        monkeypatch.setattr(kv_pack, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    x, rows = rows_of(4, 64, 0, torch.bfloat16).to(device), torch.tensor([3, 0, 5, 1], device=device)
    pool = torch.zeros(6, kv_fp8.entry_bytes(64, 16), dtype=torch.uint8, device=device)
    kv_fp8.write_entries(pool, rows, x, 16)
    keys = torch.zeros(6, 68, dtype=torch.uint8, device=device)
    kv_fp8.write_index_keys(keys, rows, x)
    assert calls == ["write_entries", "write_index_keys"]
    plain = torch.zeros(6, 64, dtype=torch.bfloat16, device=device)
    kv_fp8.write_entries(plain, rows, x, 16)
    assert torch.equal(plain[rows], x)
    odd = torch.zeros(6 * 68 + 1, dtype=torch.uint8, device=device)[1:].view(6, 68)
    kv_fp8.write_index_keys(odd, rows, x)
    assert calls == ["write_entries", "write_index_keys"] and torch.equal(odd, keys)
