"""FP8 (e4m3, E8M0 scale per block) and MXFP4 (e2m1 nibbles, E8M0 scale per 32 inputs):
dequantisation against a straightforward per-element decoder on random bytes (negative
values, subnormals, scales 2^-20 .. 2^20), quantiser round-trip bounds, and an
`init-random --quant fp8` checkpoint as written and as loaded."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from dsv4.ops.quant import dequant_fp4, dequant_fp8, quant_fp4, quant_fp8
from dsv4.model.weights import load_model

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E8M0_LO, E8M0_HI = 127 - 20, 127 + 20   # scale bytes for 2^-20 .. 2^20


def e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6                       # subnormal
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def e8m0(byte: int) -> float:
    return 2.0 ** (byte - 127)


def e2m1(nibble: int) -> float:
    return -E2M1[nibble & 7] if nibble & 8 else E2M1[nibble & 7]


def random_bytes(shape, gen, lo=0, hi=256, exclude=()) -> torch.Tensor:
    b = torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32)
    for x in exclude:
        b[b == x] = 0x38                                         # 1.0, never NaN
    return b.to(torch.uint8)


def scale_bytes(shape, gen) -> torch.Tensor:
    s = random_bytes(shape, gen, E8M0_LO, E8M0_HI + 1)
    s.view(-1)[0], s.view(-1)[-1] = E8M0_LO, E8M0_HI          # both ends of the range
    return s


def test_decoders_agree_with_known_values():
    assert [e4m3(b) for b in (0x00, 0x01, 0x38, 0x7E, 0xB8, 0xFE)] == [0.0, 2.0 ** -9, 1.0, 448.0, -1.0, -448.0]
    assert [e2m1(n) for n in (0, 1, 7, 9, 15)] == [0.0, 0.5, 6.0, -0.5, -6.0]


@pytest.mark.parametrize("shape,block", [((150, 260), (128, 128)), ((40, 70), (16, 32))])
@pytest.mark.parametrize("scale_kind", ["e8m0", "uint8"])
def test_dequant_fp8_matches_per_element_decoding(shape, block, scale_kind):
    gen = torch.Generator().manual_seed(sum(shape))
    w = random_bytes(shape, gen, exclude=(0x7F, 0xFF))         # every e4m3 value except NaN
    s = scale_bytes((-(-shape[0] // block[0]), -(-shape[1] // block[1])), gen)
    assert (w >= 0x80).any() and (w.bitwise_and(0x78) == 0).any()  # negatives and subnormals present
    scale = s.view(torch.float8_e8m0fnu) if scale_kind == "e8m0" else s
    got = dequant_fp8(w.view(torch.float8_e4m3fn), scale, block)
    want = torch.tensor([[e4m3(int(w[r, c])) * e8m0(int(s[r // block[0], c // block[1]]))
                          for c in range(shape[1])] for r in range(shape[0])])
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_dequant_fp8_with_float_scales():
    """Flash-Base ships FP8 weights with fp32 scales."""
    gen = torch.Generator().manual_seed(1)
    w = random_bytes((130, 10), gen, exclude=(0x7F, 0xFF))
    scale = torch.tensor([[0.37], [-2.5]])
    got = dequant_fp8(w.view(torch.float8_e4m3fn), scale, (128, 128))
    want = torch.tensor([[e4m3(int(w[r, c])) * float(scale[r // 128, 0]) for c in range(10)] for r in range(130)])
    assert torch.allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scale_kind", ["e8m0", "uint8"])
def test_dequant_fp4_matches_per_nibble_decoding(scale_kind):
    gen = torch.Generator().manual_seed(2)
    out, inp = 6, 128
    packed = random_bytes((out, inp // 2), gen)
    s = scale_bytes((out, inp // 32), gen)
    scale = s.view(torch.float8_e8m0fnu) if scale_kind == "e8m0" else s
    got = dequant_fp4(packed.view(torch.int8), scale)
    want = [[0.0] * inp for _ in range(out)]
    for r in range(out):
        for c in range(inp):
            byte = int(packed[r, c // 2])
            nibble = byte & 0xF if c % 2 == 0 else byte >> 4      # low nibble first
            want[r][c] = e2m1(nibble) * e8m0(int(s[r, c // 32]))
    assert torch.equal(got, torch.tensor(want))
    assert (got < 0).any()


def block_scaled(shape, blocks, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Random normal data times a power of two in [2^-20, 2^20] per block."""
    exps = torch.randint(-20, 21, blocks, generator=gen).float()
    exps.view(-1)[0], exps.view(-1)[-1] = -20, 20
    rep = exps.repeat_interleave(-(-shape[0] // blocks[0]), 0).repeat_interleave(-(-shape[1] // blocks[1]), 1)
    return torch.randn(shape, generator=gen) * torch.exp2(rep[:shape[0], :shape[1]]), exps


def test_quant_fp8_round_trip_bounds():
    gen = torch.Generator().manual_seed(3)
    w, _ = block_scaled((296, 391), (3, 4), gen)
    q, scale = quant_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 4)
    s = scale.float()
    amax = torch.stack([torch.stack([w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
                                     for j in range(4)]) for i in range(3)])
    assert torch.equal(torch.log2(s), torch.log2(s).round())               # powers of two (E8M0)
    assert (amax / s <= 448).all() and (amax / s > 224).all()              # the smallest such
    back = dequant_fp8(q, scale)
    s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:296, :391]
    bound = torch.maximum(w.abs() * 2.0 ** -4, s_full * 2.0 ** -10)       # half ulp, normal / subnormal
    assert ((back - w).abs() <= bound).all()
    assert torch.equal(torch.sign(back[back != 0]), torch.sign(w[back != 0]))


def test_quant_fp8_is_exact_on_representable_values():
    gen = torch.Generator().manual_seed(4)
    codes = random_bytes((256, 256), gen, exclude=(0x7F, 0xFF))
    codes[::128, ::128] = 0x7E                                             # 448 pins each block's scale
    exps = torch.tensor([[-20.0, 7.0], [-3.0, 20.0]])
    w = codes.view(torch.float8_e4m3fn).float() * torch.exp2(exps.repeat_interleave(128, 0).repeat_interleave(128, 1))
    q, scale = quant_fp8(w)
    assert torch.equal(scale.float(), torch.exp2(exps))
    assert torch.equal(dequant_fp8(q, scale), w)


def test_quant_fp4_picks_the_nearest_value():
    gen = torch.Generator().manual_seed(5)
    w, _ = block_scaled((8, 256), (8, 8), gen)
    packed, scale = quant_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (8, 128) and scale.shape == (8, 8)
    s = scale.float()
    amax = w.view(8, 8, 32).abs().amax(-1)
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    assert (amax / s <= 6).all() and (amax / s > 3).all()
    s_full = s.repeat_interleave(32, 1)
    back = dequant_fp4(packed, scale)
    grid = torch.tensor(E2M1 + [-v for v in E2M1[1:]])
    nearest = ((w / s_full)[..., None] - grid).abs().min(-1).values * s_full
    assert torch.allclose((back - w).abs(), nearest, rtol=1e-6, atol=0)
    x = (w / s_full).abs()
    half_step = torch.where(x <= 2, 0.25, torch.where(x <= 4, 0.5, 1.0)) * s_full
    assert ((back - w).abs() <= half_step).all()


def test_quant_fp4_is_exact_on_representable_values():
    gen = torch.Generator().manual_seed(6)
    grid = torch.tensor(E2M1 + [-v for v in E2M1])
    x = grid[torch.randint(0, len(grid), (4, 128), generator=gen)]
    x[:, ::32] = 6.0
    exps = torch.randint(-20, 21, (4, 4), generator=gen).float()
    w = x * torch.exp2(exps).repeat_interleave(32, 1)
    packed, scale = quant_fp4(w)
    assert torch.equal(scale.float(), torch.exp2(exps))
    assert torch.equal(dequant_fp4(packed, scale), w)


# ---- an `init-random --quant fp8` checkpoint --------------------------------------------
# released FP8 tensors (docs/architecture.md, Weights and checkpoints): attention projections, indexer wq_b, shared experts, MTP e/h_proj
FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|[eh]_proj)\.weight$")
EXPERTS = re.compile(r"\.ffn\.experts\.w[123]$")


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint):
    return tiny_checkpoint(4, quant="fp8", seed=5)


def test_fp8_checkpoint_as_written(fp8_checkpoint):
    path = fp8_checkpoint.path
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["expert_dtype"] == "fp4"
    H, I = fp8_checkpoint.cfg.hidden_size, fp8_checkpoint.cfg.moe_intermediate_size
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert f.get_tensor("layers.1.attn.indexer.wq_b.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("mtp.0.e_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("layers.0.attn.wkv.scale").dtype == torch.float8_e8m0fnu
        expert = f.get_tensor("layers.2.ffn.experts.5.w1.weight")
        assert expert.dtype == torch.int8 and expert.shape == (I, H // 2)
        assert f.get_tensor("layers.2.ffn.experts.5.w1.scale").shape == (I, H // 32)
        assert f.get_tensor("embed.weight").dtype == torch.float32


def test_fp8_checkpoint_loads_dequantised_weights(fp8_checkpoint):
    """Every parameter, MTP included, equals the written value after its quant round trip."""
    model, cfg = load_model(fp8_checkpoint.path), fp8_checkpoint.cfg
    n_fp8 = n_fp4 = 0
    for name, p in model.named_parameters():
        value = fp8_checkpoint.state[name]
        if FP8.search(name):
            want, n_fp8 = dequant_fp8(*quant_fp8(value)), n_fp8 + 1
        elif EXPERTS.search(name):
            want, n_fp4 = torch.stack([dequant_fp4(*quant_fp4(e)) for e in value]), n_fp4 + 1
        else:
            want = value
        assert torch.equal(p, want), name
        if want is not value:
            assert not torch.equal(p, value), f"{name} was not quantised"
    blocks = cfg.num_hidden_layers + 1                                    # + the MTP block
    assert n_fp8 == 8 * blocks + cfg.compress_ratios.count(4) + 2          # + indexer wq_b, e/h_proj
    assert n_fp4 == 3 * blocks
