"""Random weights in the released format, built in place on the target device without files or
fp32 copies of whole weights: full-size `random:flash` / `random:pro` (all layers and the MTP
block) for benchmarks.

Every value is a function of (seed, tensor name, element index) — a counter-based hash, no
generator state — so any slice of a tensor is drawn alone: a rank builds only its shard
(`Shard`), and the model is filled tensor by tensor, layer by layer, in chunks of at most
CHUNK elements. The released formats are drawn directly:
- FP8 projections (`FP8_NAMES` of dsv4/model/random_init.py): e4m3 codes of uniform values of
  the weight's std, one power-of-two scale for the tensor;
- routed experts: MXFP4 bytes (two uniform e2m1 codes each) with one E8M0 exponent for the
  tensor, chosen for the weight's std;
- everything else uniform with random_init's std (norms and hc scales 1 + noise, tid2eid k
  distinct experts per token).
A weight the model does not keep quantised holds the dequantised values of the same codes
(rounded to its dtype), so models built with and without the keep flags hold the same weights.
"""
from __future__ import annotations

import math
import re
import zlib

import torch

from ..config import ModelConfig
from ..ops.quant import E2M1_VALUES, FP8_MAX, dequant_fp4
from .random_init import FP8_NAMES

CHUNK = 1 << 24                        # elements drawn at once (int64 temporaries of 128 MiB)
E2M1_RMS = math.sqrt(float((E2M1_VALUES ** 2).mean()))   # rms of a uniform e2m1 code (2.93)
_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
ROUTED = re.compile(r"ffn\.experts\.w[123]$")


class Shard:
    """Which part of each tensor a rank holds: `index(name, shape)` -> one slice per dim of the
    full tensor `name` (as the unsharded model holds it; MXFP4 weights packed). The base class
    holds everything; FP8 weights must be cut at 128-row / 128-column blocks, MXFP4 ones at
    16-byte (32-input) groups."""

    def index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(0, n) for n in shape)


class ExpertShard(Shard):
    """Expert parallelism: rank `rank` of `world` holds routed experts [rank*E/world, (rank+1)*E/world)
    of every layer (and their scales); everything else whole."""

    def __init__(self, rank: int, world: int):
        if not 0 <= rank < world:
            raise ValueError(f"shard: rank {rank} outside [0, {world})")
        self.rank, self.world = rank, world

    def index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        full = super().index(name, shape)
        if not re.search(r"ffn\.experts\.w[123](_scale)?$", name):
            return full
        E = shape[0]
        if E % self.world:
            raise ValueError(f"shard: {E} experts do not split over {self.world} ranks")
        per = E // self.world
        return (slice(self.rank * per, (self.rank + 1) * per),) + full[1:]


def _key(seed: int, name: str) -> int:
    return (seed * 0x100000001 + zlib.crc32(name.encode())) & 0x7FFFFFFFFFFF


def _hash(counter: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 counters (wrapping products; logical shifts) -> int64 bits."""
    z = counter * _GOLDEN
    for shift, mult in ((30, _MIX1), (27, _MIX2)):
        z = (z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))) * mult
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _bits(key: int, full: tuple[int, ...], index: tuple[slice, ...], rows: slice, device) -> torch.Tensor:
    """Hash bits [rows of the slice, *inner slice shape] of the elements of `index` in a tensor of
    shape `full`, for the slice's leading rows `rows` (relative to the slice)."""
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    flat = torch.zeros((), dtype=torch.int64, device=device)
    for d, (sl, stride) in enumerate(zip(index, strides)):
        r = range(sl.start, sl.stop)[rows] if d == 0 else range(sl.start, sl.stop)
        ar = torch.arange(r.start, r.stop, dtype=torch.int64, device=device) * stride
        flat = flat.unsqueeze(-1) + ar
    return _hash(flat + key * (1 << 16))


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """Hash bits -> fp32 uniform in [-1, 1) (24 bits)."""
    return ((bits >> 40) & 0xFFFFFF).float() * 2.0 ** -23 - 1.0


def _chunks(index: tuple[slice, ...]):
    """Slices of the slice's leading dim covering it in chunks of about CHUNK elements."""
    if not index:
        yield slice(0, 1)
        return
    n = index[0].stop - index[0].start
    inner = max(1, math.prod(s.stop - s.start for s in index[1:]))
    step = max(1, CHUNK // inner)
    for r0 in range(0, n, step):
        yield slice(r0, min(n, r0 + step))


def std_of(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[float, float]:
    """(offset, std) of a tensor's values, as random_init's draws (shape unpacked)."""
    n, H = cfg.hc_mult, cfg.hidden_size
    if name == "embed.weight":
        return 0.0, 1.0
    if re.search(r"(norm\.weight|norm)$", name) or re.search(r"hc_\w*scale$", name):
        return 1.0, 0.1
    if re.search(r"hc_\w*fn$", name):
        return 0.0, 0.5 / (n * H) ** 0.5
    if re.search(r"hc_\w*base$", name) or name.endswith("gate.bias"):
        return 0.0, 0.1
    if name.endswith(("attn_sink", "ape")):
        return 0.0, 0.5
    if name.endswith(("experts.w1", "experts.w3")):
        return 0.0, 4.0 / shape[-1] ** 0.5
    return 0.0, 1.0 / shape[-1] ** 0.5


def fp8_scale(std: float) -> float:
    """The tensor's power-of-two FP8 scale: uniform values reach sqrt(3) std <= 448 scale."""
    return 2.0 ** math.ceil(math.log2(math.sqrt(3) * std / FP8_MAX))


def e8m0_byte(std: float) -> int:
    """The tensor's E8M0 exponent byte: uniform e2m1 codes times 2^(b - 127) have rms ~ std."""
    return 127 + round(math.log2(std / E2M1_RMS))


@torch.no_grad()
def fill(p: torch.Tensor, name: str, full: tuple[int, ...], index: tuple[slice, ...], cfg: ModelConfig,
         seed: int, released_fp8: bool, scale: torch.Tensor | None = None) -> None:
    """Fill p (the slice `index` of tensor `name`, full shape `full` as the model holds it) and,
    for a kept weight, its scale tensor `scale`. released_fp8: `name` is an FP8 projection of
    the released format (drawn as FP8 codes even when p holds them dequantised)."""
    key, dev = _key(seed, name), p.device
    if name.endswith("tid2eid"):
        E, k = cfg.n_routed_experts, full[1]
        for rows in _chunks(index[:1]):
            t = range(index[0].start, index[0].stop)[rows]
            noise = _uniform(_bits(key, (full[0], E), (slice(t.start, t.stop), slice(0, E)), slice(None), dev))
            p[rows] = noise.argsort(dim=-1)[:, :k][:, index[1]].to(p.dtype)
        return
    if ROUTED.search(name):
        return _fill_expert(p, name, full, index, cfg, key, scale)
    offset, std = std_of(name, full, cfg)
    s = fp8_scale(std) if released_fp8 else None
    for rows in _chunks(index):
        v = _uniform(_bits(key, full, index, rows, dev)) * (math.sqrt(3) * std)
        if s is None:
            p[rows] = (offset + v).to(p.dtype)
            continue
        codes = (v / s).to(torch.float8_e4m3fn)
        p[rows] = codes if p.dtype == torch.float8_e4m3fn else (codes.float() * s).to(p.dtype)
    if scale is not None:
        scale.fill_(s)


def _fill_expert(p, name, full, index, cfg, key, scale) -> None:
    """Routed experts as MXFP4: packed bytes drawn over the packed shape [E, R, C/2] (full when
    p is unquantised: the packed shape is then derived), one E8M0 byte for the tensor."""
    packed_full = full if p.dtype == torch.uint8 else (*full[:-1], full[-1] // 2)
    packed_index = index if p.dtype == torch.uint8 else (*index[:-1], _half(index[-1]))
    b = e8m0_byte(std_of(name, (*packed_full[:-1], packed_full[-1] * 2), cfg)[1])
    for rows in _chunks(packed_index):
        code = ((_bits(key, packed_full, packed_index, rows, p.device) >> 40) & 0xFF).to(torch.uint8)
        if p.dtype == torch.uint8:
            p[rows] = code
            continue
        sb = torch.full((*code.shape[:-1], code.shape[-1] * 2 // 32), b, dtype=torch.uint8, device=p.device)
        values = dequant_fp4(code.view(torch.int8), sb)
        if p.dtype == torch.float8_e4m3fn:             # FP8 experts: the same values, one scale
            p[rows] = (values * 2.0 ** (127 - b)).to(torch.float8_e4m3fn)
        else:
            p[rows] = values.to(p.dtype)
    if scale is not None:
        scale.fill_(b if scale.dtype == torch.uint8 else 2.0 ** (b - 127))


def _half(sl: slice) -> slice:
    assert sl.start % 32 == 0 and sl.stop % 2 == 0, "MXFP4 shards cut at 32-input groups"
    return slice(sl.start // 2, sl.stop // 2)


def is_released_fp8(name: str) -> bool:
    return FP8_NAMES.search(name) is not None
