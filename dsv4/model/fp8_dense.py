"""Kept-FP8 dense and attention projections (`load_model(keep_fp8_dense=True)`, the engine's
`--keep-fp8-dense`): the linears the released checkpoints store FP8 (128x128 block scales) stay
float8_e4m3fn + fp32 scales on the device and run the FP8 GEMMs of dsv4/ops/quant_gemm.py
(docs/architecture.md, "Model"). The shared expert's FP8 weights follow `keep_fp8` (they run in
the MoE kernels, dsv4/model/moe.py)."""
from __future__ import annotations

import re

import torch
from safetensors import safe_open

from .checkpoint_reader import shard_files
from .layers import Linear
from .names import canonical_name

# module names of the dense linears the released checkpoints hold FP8
FP8_DENSE = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|e_proj|h_proj)$")


def fp8_dense_linears(model: torch.nn.Module) -> dict[str, Linear]:
    """The model's linears (by module name) that the released format stores FP8."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear) and FP8_DENSE.search(n)}


def keep_fp8_dense(model: torch.nn.Module, weights: set[str] | None = None) -> list[str]:
    """Make the FP8-format linears of `model` (those whose `name.weight` is in `weights`, default
    all) hold float8_e4m3fn weights + fp32 block scales; returns their module names."""
    kept = [n for n, lin in fp8_dense_linears(model).items() if weights is None or f"{n}.weight" in weights]
    linears = fp8_dense_linears(model)
    for name in kept:
        linears[name].keep_fp8()
    return kept


def fp8_dense_weights(path: str, block: tuple[int, int]) -> set[str]:
    """Canonical names of the checkpoint's dense weights stored float8_e4m3fn in 128x128 blocks
    (what `keep_fp8_dense` may keep)."""
    if tuple(block) != (128, 128):
        return set()
    found = set()
    for file in shard_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                name = canonical_name(key)
                if FP8_DENSE.search(name.removesuffix(".weight")) and f.get_slice(key).get_dtype() == "F8_E4M3":
                    found.add(name)
    return found
