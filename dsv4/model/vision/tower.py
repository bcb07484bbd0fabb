"""The vision tower, the aligner and the sentinel embeddings of DeepSeek-V4-Flash-Vision
(docs/vision.md, "Tower"). `DeepseekV4` holds them under the released checkpoint's names:
`vision.*` (the ViT), `aligner.*`, `image_start` / `image_end` / `image_newline` / `image_pad`.

The ViT runs a batch of B images of one grid (n_h x n_w patches, N = n_h * n_w):
patches [B, N, 3, p, p] -> patch embedding -> blocks (RMSNorm -> attention with 2D RoPE,
full and bidirectional over the N patches of one image -> RMSNorm -> SiLU-gated MLP, both
residual) -> RMSNorm -> [B, N, dim]. The aligner folds r x r patches (the grid zero-padded
to multiples of r) into one row: Linear -> GELU -> Linear -> [B, n_llm_h * n_llm_w, hidden].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config_parse import VisionConfig
from .grid import IMAGE, block_layout


class VisionNorm(nn.Module):
    """RMSNorm in fp32 with an fp32 weight (eps 1e-6)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-6)
        return (self.weight * y).to(x.dtype)


def rope_2d(n_h: int, n_w: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [N, head_dim / 2]: patch (i, j) rotates with angles i * f then j * f,
    f = theta^(-2k / (head_dim / 2)) for k < head_dim / 4."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half)
    rows = torch.arange(n_h, device=device).repeat_interleave(n_w).float()
    cols = torch.arange(n_w, device=device).repeat(n_h).float()
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head: x [..., N, H, D], cos/sin [N, D / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, v: VisionConfig, dtype):
        super().__init__()
        self.n_heads, self.head_dim = v.n_heads, v.head_dim
        self.wqkv = nn.Linear(v.dim, 3 * v.dim, dtype=dtype)
        self.wo = nn.Linear(v.dim, v.dim, dtype=dtype)

    def forward(self, x, cos, sin):
        B, N, _ = x.shape
        q, k, v = (t.view(B, N, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(o.transpose(1, 2).reshape(B, N, -1))


class VisionMLP(nn.Module):
    def __init__(self, v: VisionConfig, dtype):
        super().__init__()
        self.w1 = nn.Linear(v.dim, 2 * v.inter_dim, bias=False, dtype=dtype)   # gate and up halves
        self.w2 = nn.Linear(v.inter_dim, v.dim, bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, v: VisionConfig, dtype):
        super().__init__()
        self.norm1, self.attn = VisionNorm(v.dim), VisionAttention(v, dtype)
        self.norm2, self.mlp = VisionNorm(v.dim), VisionMLP(v, dtype)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionConfig, dtype):
        super().__init__()
        self.proj = nn.Linear(3 * v.patch_size ** 2, v.dim, dtype=dtype)

    def forward(self, patches):                      # [B, N, 3, p, p] -> [B, N, dim]
        return self.proj(patches.flatten(2))


class ViT(nn.Module):
    def __init__(self, v: VisionConfig, dtype):
        super().__init__()
        self.cfg = v
        self.patch_embed = PatchEmbed(v, dtype)
        self.blocks = nn.ModuleList(VisionBlock(v, dtype) for _ in range(v.n_layers))
        self.norm = VisionNorm(v.dim)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        x = self.patch_embed(patches.to(self.patch_embed.proj.weight.dtype))
        cos, sin = rope_2d(n_h, n_w, self.cfg.head_dim, self.cfg.rope_theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    def __init__(self, v: VisionConfig, hidden: int, dtype):
        super().__init__()
        self.r = v.downsample_ratio
        self.w1 = nn.Linear(v.dim * self.r ** 2, hidden, dtype=dtype)
        self.w2 = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """[B, n_h * n_w, dim] -> [B, ceil(n_h / r) * ceil(n_w / r), hidden], row-major. A folded
        row is channel-major: feature c of patch (di, dj) of the r x r block at c * r^2 + di * r + dj."""
        B, r = x.shape[0], self.r
        grid = F.pad(x.view(B, n_h, n_w, -1).permute(0, 3, 1, 2), (0, -n_w % r, 0, -n_h % r))
        folded = F.unfold(grid, r, stride=r).transpose(1, 2)
        return self.w2(F.gelu(self.w1(folded)))


def encode_images(vit: ViT, aligner: Aligner, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    """Patches [B, n_h * n_w, 3, p, p] of B images of one grid -> aligner rows
    [B, n_llm_h * n_llm_w, hidden], row-major over the LLM grid."""
    return aligner(vit(patches, n_h, n_w), n_h, n_w)


def assemble_block(rows: torch.Tensor, sentinels: torch.Tensor, n_llm_h: int, n_llm_w: int,
                   start: int) -> torch.Tensor:
    """One image's block embeddings [block_length, hidden] at absolute position `start`:
    sentinels [5, hidden] (indexed by kind, dsv4/model/vision/grid.py; IMAGE's row unused)
    where the layout has them, the aligner rows [n_llm_h * n_llm_w, hidden] in N order."""
    types, perm = block_layout(n_llm_h, n_llm_w, start)
    types, perm = types.to(rows.device), perm.to(rows.device)
    block = sentinels[types].to(rows.dtype)
    block[types == IMAGE] = rows[perm]
    return block
