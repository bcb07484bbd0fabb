"""Load errors name the checkpoint key as written, its file, the name it was read as, and,
for a known foreign layout, what it is and the conversion that fixes it
(dsv4/model/layouts.py)."""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.model.weights import CheckpointError, load_model


@pytest.fixture(scope="module")
def sources(tiny_checkpoint):
    return {"deepseek": tiny_checkpoint(4, seed=5), "fp8": tiny_checkpoint(4, quant="fp8", seed=5)}


def edited(src: str, dst, edit) -> tuple[str, str]:
    """A copy of single-shard checkpoint `src` with its tensors edited; (folder, shard file)."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    file = os.path.join(str(dst), "model.safetensors")
    save_file(tensors, file)
    return str(dst), file


def add(key, shape=(4, 4)):
    return lambda t: t.__setitem__(key, torch.zeros(shape))


def drop(key):
    return lambda t: t.pop(key)


CASES = {
    "unexpected-saved-name": ("deepseek", add("model.layers.1.attn.extra.weight"),
                              "unexpected tensor 'model.layers.1.attn.extra.weight' in '{file}', read as "
                              "'layers.1.attn.extra.weight' (not part of this model config)"),
    "lora": ("deepseek", add("base_model.model.layers.0.attn.wq_a.lora_A.weight"),
             "a LoRA/PEFT adapter, not a full checkpoint"),
    "deepseek-v3": ("deepseek", add("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
                    "DeepSeek-V3-family (MLA) names: this is not a DeepSeek-V4 checkpoint"),
    "extra-mtp-layer": ("deepseek", add("mtp.1.e_proj.weight"), "dsv4 convert SRC OUT --drop-mtp"),
    "misshaped": ("deepseek", lambda t: t.__setitem__("layers.2.attn.wq_a.weight",
                                                      t["layers.2.attn.wq_a.weight"].T.contiguous()),
                  "shape (64, 32), expected (32, 64) (key 'layers.2.attn.wq_a.weight' in '{file}')"),
    "no-scale": ("fp8", drop("layers.1.attn.wq_b.scale"),
                 "quantised tensor 'layers.1.attn.wq_b.weight' has no scale tensor (key "
                 "'layers.1.attn.wq_b.weight' in '{file}')"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_names_key_file_and_layout(case, sources, tmp_path):
    source, edit, message = CASES[case]
    path, file = edited(sources[source].path, tmp_path / case, edit)
    with pytest.raises(CheckpointError, match=re.escape(message.format(file=file))):
        load_model(path)
