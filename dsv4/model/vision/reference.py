"""The vision tower and aligner written plainly, one image at a time (docs/vision.md): the
definition tests/model/test_vision.py holds dsv4/model/vision/tower.py to. Written from the
public sources docs/vision.md cites; explicit softmax, explicit 2D angles, explicit folding."""
from __future__ import annotations

import math

import torch


def _norm(x, w):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()


def _linear(x, lin):
    y = x @ lin.weight.double().T
    return y + lin.bias.double() if lin.bias is not None else y


def _rope(x, n_h, n_w, theta):
    """x [N, H, D]; patch t = (t // n_w, t % n_w); first D/4 angles from the row, next from the column."""
    N, H, D = x.shape
    quarter = D // 4
    out = torch.empty_like(x)
    for t in range(N):
        i, j = divmod(t, n_w)
        ang = [i / theta ** (2 * k / (D // 2)) for k in range(quarter)] + \
              [j / theta ** (2 * k / (D // 2)) for k in range(quarter)]
        c = torch.tensor([math.cos(a) for a in ang], dtype=x.dtype)
        s = torch.tensor([math.sin(a) for a in ang], dtype=x.dtype)
        x1, x2 = x[t, :, :D // 2], x[t, :, D // 2:]
        out[t] = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out


def reference_vit(vit, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    """One image: patches [N, 3, p, p] -> [N, dim] (float64)."""
    v = vit.cfg
    x = _linear(patches.double().reshape(patches.shape[0], -1), vit.patch_embed.proj)
    for blk in vit.blocks:
        h = _norm(x, blk.norm1.weight)
        q, k, val = _linear(h, blk.attn.wqkv).split(v.dim, dim=-1)
        q, k, val = (t.view(-1, v.n_heads, v.head_dim) for t in (q, k, val))
        q, k = _rope(q, n_h, n_w, v.rope_theta), _rope(k, n_h, n_w, v.rope_theta)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(v.head_dim)
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), val).reshape(-1, v.dim)
        x = x + _linear(o, blk.attn.wo)
        h = _norm(x, blk.norm2.weight)
        gate, up = _linear(h, blk.mlp.w1).split(v.inter_dim, dim=-1)
        x = x + _linear(torch.nn.functional.silu(gate) * up, blk.mlp.w2)
    return _norm(x, vit.norm.weight)


def reference_aligner(aligner, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    """[n_h * n_w, dim] -> [ceil(n_h / r) * ceil(n_w / r), hidden] (float64): each r x r block
    of the zero-padded grid, feature-major, through Linear -> GELU -> Linear."""
    r, dim = aligner.r, x.shape[-1]
    grid = x.double().view(n_h, n_w, dim)
    rows = []
    for bi in range(math.ceil(n_h / r)):
        for bj in range(math.ceil(n_w / r)):
            feat = torch.zeros(dim, r, r, dtype=torch.float64)
            for di in range(r):
                for dj in range(r):
                    i, j = bi * r + di, bj * r + dj
                    if i < n_h and j < n_w:
                        feat[:, di, dj] = grid[i, j]
            rows.append(feat.reshape(-1))
    h = _linear(torch.stack(rows), aligner.w1)
    return _linear(torch.nn.functional.gelu(h), aligner.w2)
