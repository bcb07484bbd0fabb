"""Tensor names: DeepSeek's released names are canonical (and the model's own parameter
names, except routed experts, which the model stacks as `...experts.w1` [E, I, H]).
transformers' names map to them and back.

Every naming transformers produces for V4 reads back through `canonical_name`:
  * its module names (`model.layers.N.self_attn.q_a_proj.weight`, `lm_head.weight`, stacked
    `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]), with or without `model.`;
  * what its `save_pretrained` writes: the module names renamed back by its conversion rules
    (DeepSeek-like `model.layers.N.attn.wq_a.weight`, per-expert `ffn.experts.E.w1.weight`,
    `attn.norm` for the attention's `kv_norm`, `head.weight`; no `model.` when a bare
    `DeepseekV4Model` is saved), or any mix of the two.
`canonical_name` applies transformers' own load-time renames (the `deepseek_v4` entry of its
conversion mapping, transcribed in `_TRANSFORMERS_RENAMES`), adds the `model.` prefix, then
maps module names to DeepSeek's (`hf_to_ds`)."""
from __future__ import annotations

import re

# (transformers pattern, deepseek replacement), applied in order to a transformers name
_HF_TO_DS = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.", ".ffn."),
]

_DS_TO_HF = [
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.compressor(\.indexer)?\.wkv\.", r".compressor\1.kv_proj."),
    (r"\.compressor(\.indexer)?\.wgate\.", r".compressor\1.gate_proj."),
    (r"\.compressor(\.indexer)?\.ape$", r".compressor\1.position_bias"),
    (r"\.compressor(\.indexer)?\.norm\.", r".compressor\1.kv_norm."),
    (r"\.attn\.wq_a\.", ".attn.q_a_proj."),
    (r"\.attn\.q_norm\.", ".attn.q_a_norm."),
    (r"\.attn\.wq_b\.", ".attn.q_b_proj."),
    (r"\.attn\.wkv\.", ".attn.kv_proj."),
    (r"\.attn\.wo_a\.", ".attn.o_a_proj."),
    (r"\.attn\.wo_b\.", ".attn.o_b_proj."),
    (r"\.attn\.attn_sink$", ".attn.sinks"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias"),
    (r"\.ffn\.shared_experts\.w1\.", ".ffn.shared_experts.gate_proj."),
    (r"\.ffn\.shared_experts\.w2\.", ".ffn.shared_experts.down_proj."),
    (r"\.ffn\.shared_experts\.w3\.", ".ffn.shared_experts.up_proj."),
    (r"\.ffn\.", ".mlp."),
]

# transformers' `deepseek_v4` checkpoint renames, in its order (transformers >= 5.23;
# tests/model/test_transformers_names.py checks them key by key against the installed one).
# Each replaces its first match; sources ending in a letter or digit end on a name boundary
# `(?!\w)`, as transformers compiles them.
_TRANSFORMERS_RENAMES = [(re.compile(p), r) for p, r in [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight(?!\w)", "embed_tokens.weight"),
    (r"^head\.weight(?!\w)", "lm_head.weight"),
    (r"^hc_head_fn(?!\w)", "hc_head.hc_fn"),
    (r"^hc_head_base(?!\w)", "hc_head.hc_base"),
    (r"^hc_head_scale(?!\w)", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn(?!\w)", ".attn_hc.fn"),
    (r"\.hc_attn_base(?!\w)", ".attn_hc.base"),
    (r"\.hc_attn_scale(?!\w)", ".attn_hc.scale"),
    (r"\.hc_ffn_fn(?!\w)", ".ffn_hc.fn"),
    (r"\.hc_ffn_base(?!\w)", ".ffn_hc.base"),
    (r"\.hc_ffn_scale(?!\w)", ".ffn_hc.scale"),
    (r"\.attn_sink(?!\w)", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape(?!\w)", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias(?!\w)", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]]
MODEL_PREFIX = "model."
# module names the renames above would move (`\.norm\.`): transformers keeps a key as written
# when the renamed one names no parameter and the key itself does
_KEPT_MODULE_NAMES = {"model.norm.weight"}

HF_GATE_UP = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.gate_up_proj$")
HF_DOWN = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.down_proj$")
DS_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


# routed experts in canonical names: stacked as transformers holds them, or one per key
DS_GATE_UP = re.compile(r"^(layers\.\d+\.ffn\.experts)\.gate_up_proj$")   # [E, 2I, H]: w1 then w3
DS_DOWN = re.compile(r"^(layers\.\d+\.ffn\.experts)\.down_proj$")         # [E, H, I]: w2


def transformers_load_name(key: str) -> str:
    """The module name transformers loads checkpoint key `key` into (its renames, then the
    `model.` prefix it adds to keys of the base model); per-expert keys stay per expert."""
    if key in _KEPT_MODULE_NAMES:
        return key
    for pattern, repl in _TRANSFORMERS_RENAMES:
        key = pattern.sub(repl, key, count=1)
    if key.startswith(MODEL_PREFIX) or key.startswith("lm_head."):
        return key
    return MODEL_PREFIX + key


VISION_PREFIXES = ("vision.", "aligner.", "image_")   # the vision tower's released names (docs/vision.md)


def canonical_name(key: str) -> str:
    """DeepSeek's name for checkpoint key `key` in any naming dsv4 reads (module docstring).
    `mtp.*` (DeepSeek's MTP and draft blocks, which transformers does not model) is kept as
    is. Stacked transformers experts come out as `layers.N.ffn.experts.gate_up_proj` /
    `.down_proj` (`DS_GATE_UP`, `DS_DOWN`)."""
    if key.startswith(("mtp.", *VISION_PREFIXES)):
        return key
    return hf_to_ds(transformers_load_name(key))


def is_transformers_name(name: str) -> bool:
    return name.startswith("model.") or name == "lm_head.weight"


def hf_to_ds(name: str) -> str:
    for pattern, repl in _HF_TO_DS:
        name = re.sub(pattern, repl, name)
    return name


def ds_to_hf(name: str) -> str:
    if name.startswith("mtp."):
        raise KeyError(f"{name}: transformers' DeepseekV4ForCausalLM has no MTP weights")
    for pattern, repl in _DS_TO_HF:
        name = re.sub(pattern, repl, name)
    return name


def transformers_name(name: str) -> str:
    """The transformers key that carries canonical tensor `name` (for error messages)."""
    m = re.match(r"^(layers\.\d+)\.ffn\.experts\.(w[123])$", name)
    if m:
        return f"model.{m.group(1)}.mlp.experts." + ("down_proj" if m.group(2) == "w2" else "gate_up_proj")
    return ds_to_hf(name)


def fp8_scale_name(name: str) -> str:
    """The model's name for the scales of kept quantised (FP8 or MXFP4) canonical weight `name`:
    `X.scale` for `X.weight` (shared expert), `experts.w1_scale` for the stacked `experts.w1`."""
    return name[:-len(".weight")] + ".scale" if name.endswith(".weight") else name + "_scale"
