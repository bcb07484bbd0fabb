"""Known foreign checkpoint layouts: for a tensor the loader cannot place, a hint that names
what the checkpoint looks like and, where `dsv4 convert` fixes it, the command."""
from __future__ import annotations

import re

# (what the key looks like, what to say); the first match wins
_HINTS = [
    (re.compile(r"^mtp\.\d+\."),
     "MTP or draft (DSpark) weights this config does not describe (num_nextn_predict_layers, or a "
     "draft module dsv4 does not serve): `dsv4 convert SRC OUT --drop-mtp` writes the main model "
     "without them, `dsv4 convert SRC --extract-mtp DRAFT` keeps them as a draft checkpoint"),
    (re.compile(r"\.lora_[AB]\.|\.lora_(embedding|magnitude)"),
     "a LoRA/PEFT adapter, not a full checkpoint: merge it into its base model and save that "
     "(peft's merge_and_unload, then save_pretrained), which dsv4 loads"),
    (re.compile(r"kv_a_proj_with_mqa|kv_b_proj|q_a_layernorm|kv_a_layernorm|mlp\.experts\.\d+\.gate_proj"),
     "DeepSeek-V3-family (MLA) names: this is not a DeepSeek-V4 checkpoint"),
    (re.compile(r"^(model\.)?(language_model|text_model)\."),
     "a multimodal wrapper's prefix: dsv4 serves the V4 text model only; save the language "
     "model alone (its `model.language_model` weights) to load it"),
]


def foreign_layout_hint(key: str, name: str) -> str:
    """'; <what this is>' for checkpoint key `key` (canonical `name`), or '' if unknown."""
    for pattern, hint in _HINTS:
        if pattern.search(key) or pattern.search(name):
            return f"; {hint}"
    return ""
