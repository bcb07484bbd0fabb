"""Checkpoint loading: missing, unexpected or mis-shaped tensors raise an error naming the
tensor; shards are streamed one at a time; a quantised weight and its scale may sit in
different shards, in either order."""
from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv4.model.checkpoint_reader as checkpoint_reader
from dsv4.model.weights import CheckpointError, iter_checkpoint, load_model, shard_files


def read_all(path: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in shard_files(path):
        tensors.update(load_file(file))
    return tensors


def write_copy(src: str, dst: str, shards: list[dict[str, torch.Tensor]]) -> str:
    """config.json of `src` + the given shards (with an index when more than one)."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(dst, "model.safetensors"))
        return dst
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(dst, name))
        weight_map.update(dict.fromkeys(shard, name))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def assert_same_weights(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {"deepseek": tiny_checkpoint(4, seed=5),
            "fp8": tiny_checkpoint(4, quant="fp8", seed=5),
            "transformers": tiny_checkpoint(4, names="transformers", seed=5)}


def drop(key):
    return lambda t: t.pop(key)


def add(key, shape):
    return lambda t: t.__setitem__(key, torch.zeros(shape))


def reshape(key, fn):
    return lambda t: t.__setitem__(key, fn(t[key]).contiguous())


# (checkpoint, edit of its tensors, text the error must contain)
CASES = {
    "missing": ("deepseek", drop("layers.1.attn.wkv.weight"), "missing tensor 'layers.1.attn.wkv.weight'"),
    "missing-mtp": ("deepseek", drop("mtp.0.e_proj.weight"), "missing tensor 'mtp.0.e_proj.weight'"),
    "missing-expert": ("deepseek", drop("layers.0.ffn.experts.3.w2.weight"),
                       "tensor 'layers.0.ffn.experts.w2' appears 7 times (expected 1 stacked or 8 per-expert)"),
    "unexpected": ("deepseek", add("layers.1.attn.extra.weight", (4, 4)),
                   "unexpected tensor 'layers.1.attn.extra.weight'"),
    "unexpected-expert": ("deepseek", add("layers.0.ffn.experts.8.w1.weight", (32, 64)),
                          "tensor 'layers.0.ffn.experts.w1': expert 8 out of range [0, 8)"),
    "misshaped": ("deepseek", reshape("layers.2.attn.wq_a.weight", lambda w: w.T),
                  "tensor 'layers.2.attn.wq_a.weight': shape (64, 32), expected (32, 64)"),
    "misshaped-expert": ("deepseek", reshape("layers.0.ffn.experts.2.w1.weight", lambda w: w[:16]),
                         "tensor 'layers.0.ffn.experts.w1' expert 2: shape (16, 64), expected (32, 64)"),
    "fp8-no-scale": ("fp8", drop("layers.1.attn.wq_b.scale"),
                     "quantised tensor 'layers.1.attn.wq_b.weight' has no scale tensor"),
    "fp8-no-weight": ("fp8", drop("layers.1.attn.wq_b.weight"),
                      "scale for 'layers.1.attn.wq_b.weight' has no quantised weight"),
    "fp8-scale-shape": ("fp8", reshape("layers.1.attn.wq_b.scale", lambda s: torch.cat([s, s])),
                        "layers.1.attn.wq_b.weight: FP8 scale shape (4, 1), expected [2, 1]"),
    "mxfp4-scale-shape": ("fp8", reshape("layers.0.ffn.experts.1.w3.scale", lambda s: s[:, :1]),
                          "layers.0.ffn.experts.1.w3.weight: MXFP4 scale shape (32, 1)"),
    "hf-missing": ("transformers", drop("model.layers.0.self_attn.sinks"),
                   "missing tensor 'layers.0.attn.attn_sink' in checkpoint (transformers name "
                   "'model.layers.0.self_attn.sinks')"),
    "hf-missing-experts": ("transformers", drop("model.layers.1.mlp.experts.gate_up_proj"),
                           "(transformers name 'model.layers.1.mlp.experts.gate_up_proj')"),
    "hf-misshaped": ("transformers", reshape("model.layers.3.mlp.experts.down_proj", lambda w: w[:, :, :16]),
                     "tensor 'layers.3.ffn.experts.w2': shape (8, 64, 16), expected (8, 64, 32)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_tensor_is_named(case, checkpoints, tmp_path):
    source, edit, message = CASES[case]
    tensors = read_all(checkpoints[source].path)
    edit(tensors)
    path = write_copy(checkpoints[source].path, str(tmp_path / case), [tensors])
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(path)


def test_folder_without_config_or_weights(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    shutil.copy(os.path.join(checkpoints["deepseek"].path, "config.json"), tmp_path)
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        load_model(str(tmp_path))


# ---- shards ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sharded_fp8(tiny_checkpoint):
    """The "fp8" checkpoint again, written with 4 KiB shards by save_checkpoint."""
    return tiny_checkpoint(4, quant="fp8", seed=5, max_shard_bytes=4096)


def test_small_shards_split_weights_from_scales_and_still_load(sharded_fp8, checkpoints):
    with open(os.path.join(sharded_fp8.path, "model.safetensors.index.json")) as f:
        where = json.load(f)["weight_map"]
    split = [k for k in where if k.endswith(".scale") and where[k] != where[k[:-len("scale")] + "weight"]]
    assert len(set(where.values())) > 10 and split, "precondition: some weight and scale in different shards"
    assert_same_weights(load_model(sharded_fp8.path), load_model(checkpoints["fp8"].path))


@pytest.mark.parametrize("first", ["weights", "scales"])
def test_hand_built_two_shards_with_scales_apart(first, checkpoints, tmp_path):
    """Every `.scale` in the other shard from its weight, read before or after it."""
    tensors = read_all(checkpoints["fp8"].path)
    scales = {k: v for k, v in tensors.items() if k.endswith(".scale")}
    rest = {k: v for k, v in tensors.items() if k not in scales}
    assert "layers.1.attn.wq_b.scale" in scales and "layers.1.attn.wq_b.weight" in rest
    shards = [rest, scales] if first == "weights" else [scales, rest]
    path = write_copy(checkpoints["fp8"].path, str(tmp_path / first), shards)
    assert_same_weights(load_model(path), load_model(checkpoints["fp8"].path))


def test_loading_streams_one_shard_at_a_time(sharded_fp8, monkeypatch):
    opened, open_now, most_open = [], [0], [0]
    real_safe_open = checkpoint_reader.safe_open

    @contextmanager
    def counting_safe_open(file, *args, **kwargs):
        opened.append(file)
        open_now[0] += 1
        most_open[0] = max(most_open[0], open_now[0])
        try:
            with real_safe_open(file, *args, **kwargs) as f:
                yield f
        finally:
            open_now[0] -= 1

    monkeypatch.setattr(checkpoint_reader, "safe_open", counting_safe_open)
    files = shard_files(sharded_fp8.path)
    stream = iter_checkpoint(sharded_fp8.path)
    next(stream)
    assert opened == files[:1], "the first tensor must come before the other shards are read"
    stream.close()
    assert open_now[0] == 0
    opened.clear()
    load_model(sharded_fp8.path)
    assert most_open[0] == 1 and set(opened) == set(files)
