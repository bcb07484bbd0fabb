"""dsv4/ops/triton/quant_tiles.py's MXFP4 decoding against dsv4.ops.quant.dequant_fp4 (the
format's definition): every byte (both nibbles: all 16 e2m1 codes, -0 included) under E8M0 bytes
at the edges of the exponent range (0: subnormal scale, 1/2: subnormal results, 126..128 around
1, 253/254: fp32 overflow, 255: NaN in E8M0, inf here as in e8m0_to_float). Tiles packed along
columns (`_mxfp4_tile` AXIS 1) and along rows (AXIS 0, the grouped GEMMs) bit for bit, stored as
fp32 (the interpreter's fp32 -> bf16 cast drops subnormals; the GPU's does not). The decode
GEMVs' word decoding (`_e2m1_f16_pair`: fp16 pairs, every byte in every nibble position of a
word) bit for bit, and `_mxfp4_dot` (int32 words, no tile) against the float64 dot of the
dequantised rows (E8M0 bytes up to 200), over several tiles with partial rows and columns."""
import pytest
import torch
import triton
import triton.language as tl

from dsv4.ops.quant import dequant_fp4
from dsv4.ops.triton.quant_tiles import _e2m1_word_f32, _mxfp4_dot, _mxfp4_tile, word_major

EXPONENTS = (0, 1, 2, 3, 64, 125, 126, 127, 128, 129, 130, 200, 252, 253, 254, 255)   # one per row
R, C = len(EXPONENTS), 512                                     # C / 2 = 256: every byte once a row
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rows_kernel(q_ptr, s_ptr, out_ptr, DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # q [R, C/2], s [R, C/32] (packed along columns) -> out [R, C] fp32: the values of the DTYPE tile
    q = tl.load(q_ptr + tl.arange(0, BLOCK_R)[:, None] * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)[None, :])
    sb = tl.load(s_ptr + tl.arange(0, BLOCK_R)[:, None] * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)[None, :])
    w = _mxfp4_tile(q, sb, DTYPE, 1, BLOCK_R, BLOCK_C)
    tl.store(out_ptr + tl.arange(0, BLOCK_R)[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :], w.to(tl.float32))


@triton.jit
def _words_kernel(w_ptr, out_ptr, N: tl.constexpr, ASM: tl.constexpr):
    # w [N] int32 words -> out [N, 8] fp32: nibble j of word n (input 8n + j) at [n, j], times 2^14
    n = tl.arange(0, N)
    v = _e2m1_word_f32(tl.load(w_ptr + n), ASM)
    for j in tl.static_range(8):
        tl.store(out_ptr + n * 8 + j, v[j] * 2.0 ** 14)


@triton.jit
def _dot_kernel(q_ptr, s_ptr, v_ptr, out_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # q int32 words [R, C/8], s [R, C/32], v [8, C/8] (word_major) -> out [R] fp32 = W @ v, BLOCK_R rows
    # a program
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R, BLOCK_C // 32), dtype=tl.float32)                  # per 32-column group
    for c0 in range(0, C, BLOCK_C):
        acc += _mxfp4_dot(q_ptr, C // 8, s_ptr, C // 32, rows, rows < R, c0, C, v_ptr, BLOCK_R, BLOCK_C)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=rows < R)


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])     # bf16: see the module docstring
def test_mxfp4_tile_packed_along_columns_exact(device, dtype):
    """The tile in dtype: the fp32 dequantisation rounded to it."""
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


def word_codes() -> torch.Tensor:
    """int32 words [1024]: every byte in each of a word's 4 positions (so every e2m1 code in all 8
    nibble positions, -0 included), random bytes around it."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (4, 256, 4), generator=g, dtype=torch.uint8)
    for i in range(4):
        q[i, :, i] = torch.arange(256, dtype=torch.uint8)
    return q.reshape(-1, 4).contiguous().view(torch.int32).reshape(-1)


def test_e2m1_word_exact(device):
    """The decode GEMVs' word decoding (pure Triton: the interpreter's, and the compiled twin of
    the PTX), scaled back by 2^14: the e2m1 values bit for bit."""
    w = word_codes()
    got = torch.empty(w.numel(), 8, device=device)
    _words_kernel[(1,)](w.to(device), got, N=w.numel(), ASM=False)
    q = w.view(torch.uint8).reshape(-1, 16)                                         # 32 inputs a row
    want = dequant_fp4(q, torch.full((q.shape[0], 1), 127, dtype=torch.uint8)).reshape(-1, 8)
    assert (bits(want) == -2**31).any() and set(want.abs().unique().tolist()) == {0, .5, 1, 1.5, 2, 3, 4, 6}
    assert torch.equal(bits(got.cpu()), bits(want))


def test_e2m1_word_ptx_equals_twin(device):
    """The PTX word decode (_E2M1_WORD_PTX) == its pure-Triton twin, bit for bit, on every byte in
    every position and on random words. Compiled only (DSV4_TRITON_DEVICE=cuda)."""
    if device == "cpu":
        pytest.skip("inline PTX: compiled for an NVIDIA GPU only (the interpreter runs the twin)")
    w = torch.cat([word_codes(), torch.randint(-2**31, 2**31 - 1, (3072,), dtype=torch.int32)]).to(device)
    got, twin = (torch.empty(w.numel(), 8, device=device) for _ in range(2))
    _words_kernel[(1,)](w, got, N=w.numel(), ASM=True)
    _words_kernel[(1,)](w, twin, N=w.numel(), ASM=False)
    assert torch.equal(bits(got), bits(twin))


# (R, C, BLOCK_R, BLOCK_C, dtype of v): one tile of every byte; several tiles, partial rows and a
# partial last tile of columns (C = 160: 2.5 tiles of 64)
@pytest.mark.parametrize("rows,cols,block_r,block_c,dtype", [
    (R, C, R, C, torch.float32), (5, 160, 4, 64, torch.bfloat16)])
def test_mxfp4_dot(device, rows, cols, block_r, block_c, dtype):
    """_mxfp4_dot == the float64 dot of the dequantised rows, up to fp32 rounding of the sum, for
    E8M0 bytes 0..200 (subnormal scales and results included; 252..255 overflow fp32, as the
    dequantised weights do)."""
    g = torch.Generator().manual_seed(rows)
    q = torch.arange(256, dtype=torch.uint8).repeat(rows, cols // 512 + 1)[:, :cols // 2].contiguous()
    q = q[torch.randperm(rows, generator=g)] ^ torch.randint(0, 256, q.shape, generator=g, dtype=torch.uint8)
    exps = torch.tensor([e for e in EXPONENTS if e <= 200])
    s = exps[torch.randint(0, len(exps), (rows, cols // 32), generator=g)].to(torch.uint8)
    v = torch.randn(cols, generator=g).to(dtype)
    want = dequant_fp4(q, s).double() @ v.double()
    bound = (dequant_fp4(q, s).double().abs() @ v.double().abs()) * 2.0 ** -20
    vw = word_major(v, torch.empty(8, cols // 8))
    assert torch.equal(vw[3, 5], v[5 * 8 + 3].float())
    got = torch.empty(rows, device=device)
    _dot_kernel[(triton.cdiv(rows, block_r),)](q.view(torch.int32).to(device), s.to(device), vw.to(device), got,
                                               rows, cols, BLOCK_R=block_r, BLOCK_C=block_c)
    assert ((got.cpu().double() - want).abs() <= bound).all()
    assert (got != 0).all()
