"""Tensor names: DeepSeek's released names are canonical (and the model's own parameter
names, except routed experts, which the model stacks as `...experts.w1` [E, I, H]).
transformers' names map to them and back."""
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

HF_GATE_UP = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.gate_up_proj$")
HF_DOWN = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.down_proj$")
DS_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


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
