"""ModelConfig: both schemas (DeepSeek's released config.json and transformers') are
accepted and agree; every invalid or contradictory field raises a ConfigError naming the
field and the values it expects (docs/architecture.md, "Model")."""
from __future__ import annotations

import copy
import json

import pytest

from dsv4.config import ConfigError, EngineConfig, ModelConfig, YarnScaling
from dsv4.model.random_init import FLASH_RATIOS, preset_config

TINY = preset_config("tiny", layers=4)          # compress_ratios (0, 4, 128, 4), MTP entry 0


def released() -> dict:
    return TINY.to_released_dict()


def hf() -> dict:
    return TINY.to_transformers_dict()


# V4-Flash's config.json as released (unknown extras are kept aside)
FLASH_RELEASED = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "compress_ratios": FLASH_RATIOS + [0], "num_hash_layers": 3, "sliding_window": 128, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "compress_rope_theta": 160000, "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "expert_dtype": "fp4", "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}


def test_released_v4_flash_config():
    c = ModelConfig.from_dict(FLASH_RELEASED)
    assert len(FLASH_RELEASED["compress_ratios"]) == c.num_hidden_layers + 1   # trailing MTP entry
    assert c.compress_ratios == tuple(FLASH_RATIOS) and c.mtp_compress_ratio == 0
    assert c.layer_types[:4] == ("sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention")
    assert c.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 40 and c.num_hash_layers == 3
    assert c.yarn == YarnScaling(16.0, 65536, 32.0, 1.0) and c.compress_rope_theta == 160000.0
    assert (c.quant_method, c.quant_block, c.expert_dtype) == ("fp8", (128, 128), "fp4")
    assert c.extra["topk_method"] == "noaux_tc"


def test_both_schemas_parse_to_the_same_config():
    assert ModelConfig.from_dict(released()) == TINY
    assert ModelConfig.from_dict(hf()) == TINY
    assert ModelConfig.from_dict(ModelConfig.from_dict(FLASH_RELEASED).to_transformers_dict()) == \
        ModelConfig.from_dict(FLASH_RELEASED).replace(quant_method=None, expert_dtype=None)


def test_transformers_own_serialisation_is_accepted():
    from transformers import DeepseekV4Config

    d = DeepseekV4Config(**hf()).to_dict()
    assert "layer_types" in d and "compress_ratios" not in d
    assert ModelConfig.from_dict(json.loads(json.dumps(d))) == TINY


@pytest.mark.parametrize("ratios,mtp", [([0, 4, 128, 4], 0), ([0, 4, 128, 4, 0], 0), ([0, 4, 128, 4, 128], 128)])
def test_compress_ratios_with_or_without_the_mtp_entry(ratios, mtp):
    c = ModelConfig.from_dict({**released(), "compress_ratios": ratios})
    assert c.compress_ratios == (0, 4, 128, 4) and c.mtp_compress_ratio == mtp


def test_rope_variants():
    flat_rope_type = {**released(), "rope_scaling": {**released()["rope_scaling"], "rope_type": "yarn"}}
    del flat_rope_type["rope_scaling"]["type"]
    assert ModelConfig.from_dict(flat_rope_type) == TINY
    legacy_flat = {**released(), "rope_parameters": released()["rope_scaling"]}
    del legacy_flat["rope_scaling"]
    assert ModelConfig.from_dict(legacy_flat) == TINY
    no_yarn = {**released(), "rope_scaling": {"type": "default"}}
    assert ModelConfig.from_dict(no_yarn).yarn is None
    assert ModelConfig.from_dict({**released(), "partial_rotary_factor": 0.25}) == TINY


def test_from_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(hf()))
    assert ModelConfig.from_dir(str(tmp_path)) == TINY


def setter(path, value):
    """Set d[a][b]... = value (value `DEL` deletes) on a copy."""
    def edit(d):
        d = copy.deepcopy(d)
        *parents, last = path.split("/")
        target = d
        for p in parents:
            target = target[p]
        if value is DEL:
            del target[last]
        else:
            target[last] = value
        return d
    return edit


DEL = object()
R, H = released, hf

# id -> (base schema, edit, field named, text of the expected values)
BAD = {
    "missing-vocab": (R, setter("vocab_size", DEL), "vocab_size", "is required"),
    "zero-hidden": (R, setter("hidden_size", 0), "hidden_size", "expected a positive integer, got 0"),
    "bool-heads": (R, setter("num_attention_heads", True), "num_attention_heads", "expected a positive integer"),
    "float-topk": (R, setter("index_topk", 8.5), "index_topk", "expected a positive integer, got 8.5"),
    "negative-mtp": (R, setter("num_nextn_predict_layers", -1), "num_nextn_predict_layers", "got -1"),
    "str-eps": (R, setter("rms_norm_eps", "1e-6"), "rms_norm_eps", "expected a number"),
    "kv-heads": (R, setter("num_key_value_heads", 8), "num_key_value_heads", "expected 1, got 8"),
    "compress-rates": (H, setter("compress_rates/compressed_sparse_attention", 8), "compress_rates",
                       "expected {'compressed_sparse_attention': 4, 'heavily_compressed_attention': 128}"),
    "legacy-rate": (R, setter("compress_rate_csa", 8), "compress_rate_csa", "expected 4, got 8"),
    "ratio-value": (R, setter("compress_ratios", [0, 4, 64, 4, 0]), "compress_ratios",
                    "expected a list of values in [0, 4, 128]"),
    "ratio-length": (R, setter("compress_ratios", [0, 4, 128, 4, 0, 0]), "compress_ratios",
                     "expected 4 entries (num_hidden_layers) or 5 (+ num_nextn_predict_layers), got 6"),
    "ratio-length-no-mtp": (R, lambda d: {**d, "num_nextn_predict_layers": 0}, "compress_ratios",
                            "expected 4 entries (num_hidden_layers)"),
    "no-ratios": (R, setter("compress_ratios", DEL), "compress_ratios", "is required (or layer_types"),
    "layer-type-value": (H, setter("layer_types", ["sliding_attention"] * 3 + ["full_attention"]), "layer_types",
                         "expected a list of values in ['sliding_attention', 'compressed_sparse_attention', "
                         "'heavily_compressed_attention']"),
    "layer-type-length": (H, setter("layer_types", ["sliding_attention"] * 5), "layer_types",
                          "expected 4 entries (num_hidden_layers), got 5"),
    "layer-types-vs-ratios": (H, lambda d: {**d, "compress_ratios": [0, 0, 128, 4, 0]}, "layer_types",
                              "contradicts compress_ratios [0, 0, 128, 4]: expected ['sliding_attention', "
                              "'sliding_attention', 'heavily_compressed_attention', 'compressed_sparse_attention']"),
    "hash-layers-range": (R, setter("num_hash_layers", 5), "num_hash_layers", "expected an integer in [0, 4], got 5"),
    "mlp-type-value": (H, setter("mlp_layer_types", ["hash_moe", "dense", "moe", "moe"]), "mlp_layer_types",
                       "expected 4 entries from ('hash_moe', 'moe')"),
    "mlp-types-vs-hash": (H, lambda d: {**d, "num_hash_layers": 2}, "mlp_layer_types",
                          "contradicts num_hash_layers=2: expected the first 2 to be 'hash_moe' and the rest 'moe'"),
    "rotary-factor": (R, setter("partial_rotary_factor", 0.5), "partial_rotary_factor",
                      "contradicts qk_rope_head_dim=16: expected 0.25"),
    "rope-dim-odd": (R, setter("qk_rope_head_dim", 15), "qk_rope_head_dim",
                     "expected an even integer in (0, head_dim=64], got 15"),
    "rope-dim-large": (R, setter("qk_rope_head_dim", 128), "qk_rope_head_dim", "(0, head_dim=64], got 128"),
    "rope-theta": (H, setter("rope_theta", 5000.0), "rope_theta", "contradicts rope_parameters: 10000.0 vs 5000.0"),
    "compress-theta": (H, setter("compress_rope_theta", 1.0), "compress_rope_theta",
                       "contradicts rope_parameters: 160000.0 vs 1.0"),
    "main-rope-type": (H, setter("rope_parameters/main/rope_type", "yarn"), "rope_parameters.main.rope_type",
                       "expected 'default', got 'yarn'"),
    "yarn-vs-nested": (H, lambda d: {**d, "rope_scaling": {"type": "yarn", "factor": 4,
                                                           "original_max_position_embeddings": 65536}},
                       "rope_scaling", "contradicts rope_parameters.compress"),
    "rope-type": (R, setter("rope_scaling/type", "linear"), "rope_scaling.type", "expected 'yarn', got 'linear'"),
    "yarn-factor": (R, setter("rope_scaling/factor", DEL), "rope_scaling",
                    "YaRN needs numeric factor and original_max_position_embeddings"),
    "yarn-mscale": (R, setter("rope_scaling/mscale", 0.707), "rope_scaling", "expected attention_factor 1 / no mscale"),
    "yarn-attention-factor": (H, setter("rope_parameters/compress/attention_factor", 1.2), "rope_scaling",
                              "expected attention_factor 1"),
    "scoring": (R, setter("scoring_func", "softmax"), "scoring_func", "expected 'sqrtsoftplus', got 'softmax'"),
    "dtype": (R, setter("torch_dtype", "float64"), "torch_dtype", "expected bfloat16, float16 or float32"),
    "expert-dtype": (R, setter("expert_dtype", "int4"), "expert_dtype", "expected 'fp4', 'fp8' or 'bf16', got 'int4'"),
    "quant-method": (R, setter("quantization_config", {"quant_method": "awq"}), "quantization_config.quant_method",
                     "expected 'fp8'"),
    "quant-fmt": (R, setter("quantization_config", {"quant_method": "fp8", "fmt": "e5m2"}),
                  "quantization_config.fmt", "expected 'e4m3', got 'e5m2'"),
    "quant-block": (R, setter("quantization_config", {"quant_method": "fp8", "weight_block_size": [128]}),
                    "quantization_config.weight_block_size", "expected [rows, cols], got [128]"),
    "o-groups": (R, setter("o_groups", 3), "o_groups", "must divide num_attention_heads=4, got 3"),
    "experts-per-tok": (R, setter("num_experts_per_tok", 9), "num_experts_per_tok",
                        "expected at most n_routed_experts=8, got 9"),
    "shared-experts": (R, setter("n_shared_experts", 2), "n_shared_experts", "expected 1, got 2"),
    "head-dim-odd": (R, setter("head_dim", 63), "head_dim", "expected an even number, got 63"),
    "index-head-dim": (R, setter("index_head_dim", 8), "index_head_dim", "expected at least qk_rope_head_dim=16, got 8"),
    "bool-ratio": (R, setter("compress_ratios", [False, 4, 128, 4, 0]), "compress_ratios",
                   "expected a list of values in [0, 4, 128]"),
    "nested-rotary-factor": (H, setter("rope_parameters/main/partial_rotary_factor", 0.5),
                             "rope_parameters.partial_rotary_factor", "contradicts partial_rotary_factor=0.25"),
    "flat-yarn-vs-nested-default": (H, lambda d: {**setter("rope_parameters/compress", {
        "rope_type": "default", "rope_theta": 160000.0})(d), "rope_scaling": {
        "type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}},
        "rope_scaling", "contradicts rope_parameters.compress: expected the same type ('default')"),
    "dtype-vs-torch-dtype": (R, lambda d: {**d, "torch_dtype": "float32", "dtype": "bfloat16"}, "torch_dtype",
                             "contradicts dtype: 'float32' vs 'bfloat16'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_field_is_named_with_expected_values(case):
    base, edit, field, expected = BAD[case]
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(edit(base()))
    assert info.value.field == field
    assert f"config field `{field}`" in str(info.value)
    assert expected in str(info.value)


def test_presets_parse_with_and_without_a_layer_count():
    flash = preset_config("flash-slice")
    assert flash.num_hidden_layers == 6 and flash.compress_ratios == tuple(FLASH_RATIOS[:6])
    assert preset_config("flash-slice", layers=43).compress_ratios == tuple(FLASH_RATIOS)
    assert preset_config("tiny").layer_types[:3] == ("sliding_attention", "compressed_sparse_attention",
                                                     "heavily_compressed_attention")


class _Props:
    def __init__(self, gib, name):
        self.total_memory, self.name = gib << 30, name


@pytest.mark.parametrize("gib,name,serving,want", [
    (141, "NVIDIA H200", True, 8192), (141, "NVIDIA H200", False, 16384),
    (80, "NVIDIA A100-SXM4-80GB", True, 2048), (80, "NVIDIA A100-SXM4-80GB", False, 8192),
    (24, "NVIDIA L4", True, 2048), (24, "NVIDIA L4", False, 8192)])
def test_default_batched_tokens_by_gpu_and_use(monkeypatch, gib, name, serving, want):
    import torch
    from dsv4.config import default_batched_tokens
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props(gib, name))
    assert default_batched_tokens("cuda:0", serving) == want


def test_default_batched_tokens_cpu_and_explicit():
    from dsv4.config import default_batched_tokens
    assert default_batched_tokens("cpu", True) == default_batched_tokens("cpu", False) == 2048
    assert EngineConfig().max_num_batched_tokens == 2048            # None resolves (offline, CPU)
    assert EngineConfig(max_num_batched_tokens=512).max_num_batched_tokens == 512
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


def test_serve_flags_take_the_server_default(monkeypatch):
    import argparse
    from dsv4.cli import engine_args
    p = argparse.ArgumentParser()
    engine_args.add_engine_args(p)
    monkeypatch.setattr(engine_args, "default_batched_tokens", lambda device, serving: 8192 if serving else 16384)
    assert engine_args.engine_config(p.parse_args([]), serving=True).max_num_batched_tokens == 8192
    assert engine_args.engine_config(p.parse_args([])).max_num_batched_tokens == 16384
    given = p.parse_args(["--max-num-batched-tokens", "1024"])
    assert engine_args.engine_config(given, serving=True).max_num_batched_tokens == 1024
