"""The packed FP8 KV rows (dsv4/ops/kv_fp8.py): sizes of the released layout, pack/unpack
bit-exact against a per-element decoder, the quantisation error bound, and the readers
(attention, indexer) given a packed pool equal to the same readers given its dequantised rows."""
import math

import pytest
import torch

from dsv4.ops import backend
from dsv4.ops import attention as attention_ops
from dsv4.ops import indexer as indexer_ops
from dsv4.ops.kv_fp8 import (entry_bytes, index_key_bytes, pack_entries, pack_index_keys, unpack_entries,
                             unpack_index_keys)
from paged_inputs import random_paged


def e4m3(byte: int) -> float:
    """One float8 e4m3fn byte by its definition: sign, 4-bit exponent (bias 7), 3-bit mantissa."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    assert not (exp == 15 and man == 7), "NaN is never written"
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def bf16(lo: int, hi: int) -> float:
    bits = (hi << 8 | lo) << 16
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def decode_entry(row: list[int], dim: int, rope: int) -> list[float]:
    nope = dim - rope
    scales = row[nope + 2 * rope:]
    out = [e4m3(row[i]) * 2.0 ** (scales[i // 64] - 127) for i in range(nope)]
    return out + [bf16(row[nope + 2 * j], row[nope + 2 * j + 1]) for j in range(rope)]


def test_released_sizes():
    assert entry_bytes(512, 64) == 584 and index_key_bytes(128) == 132     # 448 + 128 + 7 + 1; 128 + 4
    assert entry_bytes(64, 16) == 88                                       # the tiny config: 48 + 32 + 1, padded


@pytest.mark.parametrize("dim, rope", [(512, 64), (64, 16)])
def test_entries_decode_by_definition(dim, rope):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(5, dim, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 1e4])[:, None]
    packed = pack_entries(x, rope)
    assert packed.shape == (5, entry_bytes(dim, rope)) and packed.dtype == torch.uint8
    got = unpack_entries(packed, dim, rope)
    for n in range(5):
        assert got[n].tolist() == decode_entry(packed[n].tolist(), dim, rope)
    nope = dim - rope
    assert torch.equal(got[:, nope:], x[:, nope:].to(torch.bfloat16).float())      # RoPE part: bf16
    blocks = x[:, :nope].unflatten(1, (-1, 64)) if nope % 64 == 0 else x[:, :nope].unsqueeze(1)
    bound = blocks.abs().amax(-1, keepdim=True).expand_as(blocks).flatten(1) * 2.0 ** -3
    assert ((got[:, :nope] - x[:, :nope]).abs() <= bound + 1e-30).all()            # 3 mantissa bits, pow2 scale
    assert torch.equal(unpack_entries(pack_entries(got, rope), dim, rope), got)     # re-packing is exact
    assert packed[:, nope + 2 * rope + math.ceil(nope / 64):].eq(0).all()          # the padding


def test_index_keys_decode_by_definition():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)) * 5
    packed = pack_index_keys(x)
    assert packed.shape == (4, 132)
    got = unpack_index_keys(packed)
    for n in range(4):
        scale = packed[n, 128:].view(torch.float32)
        assert torch.equal(got[n], torch.tensor([e4m3(b) for b in packed[n, :128].tolist()]) * scale)
        assert scale.item() == pytest.approx(x[n].abs().max().item() / 448)
    assert ((got - x).abs() <= x.abs().amax(1, keepdim=True) * 2.0 ** -4).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_packed_rows(dtype):
    """A packed pool attends as its dequantised pool does, bit for bit, through paged and
    dense sources."""
    window, n0 = random_paged(21, 16, per_page=8, pitch=24, seed=3)
    history, n1 = random_paged(21, 12, per_page=4, pitch=12, seed=4)
    g = torch.Generator().manual_seed(0)
    q = (3 * torch.randn(21, 2, 64, generator=g)).to(dtype)
    pools = [pack_entries(torch.randn(n, 64, generator=g), 16) for n in (n0, n1)]
    dense_topk = history.dense()
    sinks = torch.randn(2, generator=g)
    with backend.forced("reference"):
        got = attention_ops.sparse_attention(q, [(pools[0], window), (pools[1], dense_topk)], sinks, 0.2, 16)
        plain = [unpack_entries(p, 64, 16).to(dtype) for p in pools]
        want = attention_ops.sparse_attention(q, [(plain[0], window), (plain[1], dense_topk)], sinks, 0.2)
    assert torch.equal(got, want)


def test_indexer_reads_packed_keys():
    cand, n = random_paged(19, 40, per_page=4, pitch=12, seed=2)
    g = torch.Generator().manual_seed(2)
    q, weights = torch.randn(19, 4, 32, generator=g), torch.randn(19, 4, generator=g)
    packed = pack_index_keys(torch.randn(n, 32, generator=g))
    with backend.forced("reference"):
        got = indexer_ops.indexer_topk_offsets(q, weights, packed, cand, 9)
        want = indexer_ops.indexer_topk_offsets(q, weights, unpack_index_keys(packed), cand, 9)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
