"""Cutting parameters into equal parts (the sharding transforms' one primitive).

`part i of n` along a dim is rows [i*s/n, (i+1)*s/n) of a dim of size s. A quantised weight's
scale is cut the same way (part i of n of its own dim): FP8 128x128 blocks and MXFP4 groups of
32 stay whole exactly when the dim divides, which `take` checks."""
from __future__ import annotations

import torch
from torch import nn


def take(t: torch.Tensor, dim: int, i: int, n: int, what: str) -> torch.Tensor:
    size = t.shape[dim]
    if size % n:
        raise ValueError(f"{what}: dim {dim} of size {size} does not split into {n} equal parts")
    return t.narrow(dim, i * size // n, size // n)


def shard_param(module: nn.Module, name: str, cuts: list[tuple[int, int, int]], what: str) -> None:
    """Replace module.<name> (and its scale: `scale` beside a Linear's `weight`, `<name>_scale`
    beside a stacked expert weight) by the given cuts [(dim, i, n), ...], applied in order, as a
    fresh contiguous parameter (the full tensor is freed)."""
    names = [name]
    if name == "weight" and hasattr(module, "scale"):
        names.append("scale")
    elif hasattr(module, f"{name}_scale"):
        names.append(f"{name}_scale")
    for n in names:
        t = getattr(module, n)
        for dim, i, parts in cuts:
            t = take(t, dim, i, parts, f"{what}.{n}")
        setattr(module, n, nn.Parameter(t.contiguous().clone(), requires_grad=False))
