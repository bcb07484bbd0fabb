"""dsv4/ops/triton/quant_tiles.py's MXFP4 tile decoding against dsv4.ops.quant.dequant_fp4 (the
format's definition), bit for bit: every byte (both nibbles: all 16 e2m1 codes, -0 included)
under E8M0 bytes at the edges of the exponent range (0: subnormal scale, 1/2: subnormal
results, 126..128 around 1, 253/254: fp32 overflow, 255: NaN in E8M0, inf here as in
e8m0_to_float), packed along columns (`_mxfp4_rows`, the decode GEMVs) and along rows
(`_mxfp4_tile` AXIS 0, the grouped GEMMs). Tiles are stored as fp32 (the interpreter's
fp32 -> bf16 cast drops subnormals; the GPU's does not)."""
import pytest
import torch
import triton
import triton.language as tl

from dsv4.ops.quant import dequant_fp4
from dsv4.ops.triton.quant_tiles import _mxfp4_rows, _mxfp4_tile

EXPONENTS = (0, 1, 2, 3, 64, 125, 126, 127, 128, 129, 130, 200, 252, 253, 254, 255)   # one per row
R, C = len(EXPONENTS), 512                                     # C / 2 = 256: every byte once a row
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rows_kernel(q_ptr, s_ptr, out_ptr, DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # q [R, C/2], s [R, C/32] -> out [R, C] fp32: the values of the DTYPE tile
    rows = tl.arange(0, BLOCK_R)
    w = _mxfp4_rows(q_ptr, BLOCK_C // 2, rows, rows < BLOCK_R, 0, BLOCK_C, s_ptr, BLOCK_C // 32, DTYPE,
                    BLOCK_R, BLOCK_C)
    tl.store(out_ptr + rows[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :], w.to(tl.float32))


@triton.jit
def _packed_rows_kernel(q_ptr, s_ptr, out_ptr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # q [R/2, C], s [R/32, C] (packed along rows) -> out [R, C] fp32
    q = tl.load(q_ptr + tl.arange(0, BLOCK_R // 2)[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :])
    sb = tl.load(s_ptr + tl.arange(0, BLOCK_R // 32)[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :])
    w = _mxfp4_tile(q, sb, tl.float32, 0, BLOCK_R, BLOCK_C)
    tl.store(out_ptr + tl.arange(0, BLOCK_R)[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :], w)


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns (signed zeros told apart), every NaN as one."""
    t = t.float()
    return torch.where(t.isnan(), torch.nan, t).view(torch.int32)


def all_bytes() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed [R, C/2]: bytes 0..255 in every row, E8M0 bytes [R, C/32]: EXPONENTS[r] in row r,
    their fp32 dequantisation [R, C])."""
    q = torch.arange(256, dtype=torch.uint8).repeat(R, 1)
    s = torch.tensor(EXPONENTS, dtype=torch.uint8)[:, None].repeat(1, C // 32)
    want = dequant_fp4(q, s)
    assert want.isnan().any() and want.isinf().any() and (bits(want) == -2**31).any()           # -0 too
    assert ((want != 0) & (want.abs() < 2.0 ** -126)).any()                                     # subnormals
    return q, s, want


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # inf * 0 (b = 255), fp16 overflow: wanted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_rows_exact(device, dtype):
    """bf16 / fp32: the fp32 tile, equal to the dtype's rounding (the identity); fp16: rounded."""
    q, s, want = all_bytes()
    got = torch.empty(R, C, device=device)
    _rows_kernel[(1,)](q.to(device), s.to(device), got, DTYPE=TL_DTYPES[dtype], BLOCK_R=R, BLOCK_C=C)
    assert torch.equal(bits(got.cpu()), bits(want.to(dtype)))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_mxfp4_tile_packed_along_rows_exact(device):
    q, s, want = all_bytes()
    got = torch.empty(C, R, device=device)
    _packed_rows_kernel[(1,)](q.T.contiguous().to(device), s.T.contiguous().to(device), got, BLOCK_R=C, BLOCK_C=R)
    assert torch.equal(bits(got.cpu()), bits(want.T))
