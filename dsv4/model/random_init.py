"""Random V4 checkpoints: presets, random weights, and a writer for both naming schemes
with optional FP8 / MXFP4 quantisation (what `dsv4 init-random` and the tests use)."""
from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from .names import DS_EXPERT, ds_to_hf
from ..ops.quant import quant_fp4, quant_fp8

FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]
PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4]

PRESETS = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
                 qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, moe_intermediate_size=32,
                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5,
                 compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1, index_n_heads=16, index_head_dim=32,
                 index_topk=16, sliding_window=32, hc_mult=4, max_position_embeddings=65536),
    # the released configurations (all layers; built in the released format, dsv4/model/random_released.py)
    "flash": dict(vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
                  head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
                  moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
                  num_experts_per_tok=6, routed_scaling_factor=1.5, compress_ratios=FLASH_RATIOS + [0],
                  num_hash_layers=3, index_n_heads=64, index_head_dim=128, index_topk=512,
                  sliding_window=128, hc_mult=4, max_position_embeddings=1048576),
    "pro": dict(vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                head_dim=512, qk_rope_head_dim=64, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
                moe_intermediate_size=3072, n_routed_experts=384, n_shared_experts=1,
                num_experts_per_tok=6, routed_scaling_factor=2.5, compress_ratios=PRO_RATIOS + [0],
                num_hash_layers=3, index_n_heads=64, index_head_dim=128, index_topk=1024,
                sliding_window=128, hc_mult=4, max_position_embeddings=1048576),
}
# the first six layers of V4-Flash (two SWA-only, then C4 / C128 alternating) and its MTP layer
PRESETS["flash-slice"] = dict(PRESETS["flash"], num_hidden_layers=6, compress_ratios=FLASH_RATIOS[:6] + [0])
# the tiny model with a DSpark drafter: three window-only draft stages (mtp.0..2)
PRESETS["tiny-dspark"] = dict(PRESETS["tiny"], compress_ratios=[0, 4, 128, 4, 0, 0, 0], dspark_block_size=4,
                              dspark_noise_token_id=511, dspark_target_layer_ids=[1, 2, 3], dspark_markov_rank=16)
# the Flash slice with Flash-0731's DSpark drafter shape (block 5, rank 256, three stages)
PRESETS["flash-slice-dspark"] = dict(PRESETS["flash-slice"], compress_ratios=FLASH_RATIOS[:6] + [0, 0, 0],
                                     dspark_block_size=5, dspark_noise_token_id=128799,
                                     dspark_target_layer_ids=[3, 4, 5], dspark_markov_rank=256)
# presets built in the released format (FP8 projections, MXFP4 experts) by `random:` specs
RELEASED_PRESETS = ("flash", "pro")
# a tiny DeepSeek-V4-Flash-Vision (docs/vision.md): the tiny model with a 2-layer tower
PRESETS["tiny-vision"] = dict(PRESETS["tiny"], vision_n_layers=2, vision_dim=32, vision_n_heads=2,
                              vision_inter_dim=48, vision_patch_size=4, vision_rope_theta=10000.0,
                              vision_downsample_ratio=2, vision_max_n_token=64, vision_min_pixels=1024,
                              vision_max_wh_ratio=8.0, image_token_id=511)
_COMMON = dict(scoring_func="sqrtsoftplus", hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
               swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0, num_nextn_predict_layers=1,
               rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1}, bos_token_id=0, eos_token_id=1)

# released FP8 weights (block-scaled); routed experts follow expert_dtype
FP8_NAMES = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|"
                       r"e_proj|h_proj)\.weight$")


def preset_config(name: str, layers: int | None = None, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    d = {**_COMMON, **PRESETS[name], **overrides}
    if layers is not None:
        ratios = d["compress_ratios"]
        full = {"flash-slice": FLASH_RATIOS, "flash": FLASH_RATIOS, "pro": PRO_RATIOS}.get(name, ratios[:-1] * layers)
        main = full[:layers]
        d.update(num_hidden_layers=layers, compress_ratios=main + [ratios[-1]],
                 num_hash_layers=min(d["num_hash_layers"], layers))
    return ModelConfig.from_dict(d)


def random_state(cfg: ModelConfig, seed: int = 0, with_mtp: bool = True,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor (experts stacked), scaled so activations stay O(1)."""
    from .deepseek_v4 import DeepseekV4
    from .mtp import attach_mtp
    with torch.device("meta"):
        model = DeepseekV4(cfg, dtype)
        if with_mtp and cfg.num_nextn_predict_layers:
            attach_mtp(model)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "tid2eid" in n]:
        state[name] = _random_tensor(name, tuple(p.shape), p.dtype, cfg, gen)
    return state


def _random_tensor(name, shape, dtype, cfg, gen, device="cpu"):
    def randn(scale):
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)
    n, H = cfg.hc_mult, cfg.hidden_size
    if name.endswith("tid2eid"):
        noise = torch.rand(shape[0], cfg.n_routed_experts, generator=gen, device=device)
        return noise.argsort(dim=-1)[:, :shape[1]]   # k distinct experts per token
    if name == "embed.weight" or name.startswith("image_"):
        return randn(1.0)
    if re.search(r"^vision\..*norm\d?\.weight$", name):
        return (1 + torch.randn(shape, generator=gen, device=device) * 0.1).to(dtype)
    if re.search(r"(norm\.weight|norm)$", name):
        return (1 + torch.randn(shape, generator=gen, device=device) * 0.1).to(dtype)
    if re.search(r"hc_\w*fn$", name):
        return randn(0.5 / (n * H) ** 0.5)
    if re.search(r"hc_\w*base$", name) or name.endswith(("gate.bias", "gate.bias_vl")):
        return randn(0.1)
    if re.search(r"hc_\w*scale$", name):
        return (1 + torch.randn(shape, generator=gen, device=device) * 0.1).to(dtype)
    if name.endswith(("attn_sink", "ape")):
        return randn(0.5)
    if name.endswith(("experts.w1", "experts.w3")):
        return randn(4.0 / shape[-1] ** 0.5)   # large enough that the SwiGLU clamp engages
    return randn(1.0 / shape[-1] ** 0.5)


def save_checkpoint(cfg: ModelConfig, state: dict[str, torch.Tensor], out_dir: str, names: str = "deepseek",
                    quant: str | None = None, dtype: torch.dtype = torch.float32,
                    max_shard_bytes: int = 2 << 30, expert_dtype: str = "fp4") -> None:
    """Write config.json + safetensors shards (+ index when sharded). With quant="fp8" the
    routed experts are MXFP4 (the released V4) or, expert_dtype="fp8", FP8 (as Flash-Base)."""
    if names not in ("deepseek", "transformers"):
        raise ValueError(f"--names: expected 'deepseek' or 'transformers', got {names!r}")
    if quant not in (None, "fp8"):
        raise ValueError(f"--quant: expected 'fp8', got {quant!r}")
    if quant and names == "transformers":
        raise ValueError("--quant fp8 writes DeepSeek's released format; use --names deepseek")
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype: expected 'fp4' or 'fp8', got {expert_dtype!r}")
    os.makedirs(out_dir, exist_ok=True)
    if quant:
        cfg = cfg.replace(quant_method="fp8", expert_dtype=expert_dtype)
    tensors = _released(state, dtype, quant, expert_dtype) if names == "deepseek" else _transformers(state, dtype)
    cfg_dict = cfg.to_released_dict() if names == "deepseek" else cfg.to_transformers_dict()
    if names == "transformers":
        cfg_dict["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
    cfg_dict["torch_dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    _write_shards(tensors, out_dir, max_shard_bytes)


FP32_NAMES = re.compile(r"(hc_|attn_sink|\.ape$|gate\.bias(_vl)?$|norm\d?\.weight$)")


def _keep_dtype(name: str, t: torch.Tensor, dtype) -> torch.Tensor:
    """Released precision: fp32 for hc_*, sinks, ape, gate bias and norms; int64 tables as is."""
    if t.dtype == torch.int64:
        return t
    return t.float() if FP32_NAMES.search(name) else t.to(dtype)


def _released(state, dtype, quant, expert_dtype="fp4"):
    out = {}
    for name, t in state.items():
        m = re.match(r"^(.*\.ffn\.experts)\.(w[123])$", name)
        items = [(f"{m.group(1)}.{e}.{m.group(2)}.weight", t[e]) for e in range(t.shape[0])] if m else [(name, t)]
        for key, value in items:
            if quant and DS_EXPERT.match(key):
                q = quant_fp8 if expert_dtype == "fp8" else quant_fp4
                out[key], out[key[:-len("weight")] + "scale"] = q(value)
            elif quant and FP8_NAMES.search(key):
                out[key], out[key[:-len("weight")] + "scale"] = quant_fp8(value)
            else:
                out[key] = _keep_dtype(key, value, dtype).contiguous()
    return out


def _transformers(state, dtype):
    out = {}
    for name, t in state.items():
        if name.startswith("mtp."):
            continue
        m = re.match(r"^(layers\.\d+)\.ffn\.experts\.(w[123])$", name)
        if m and m.group(2) == "w1":
            out[f"model.{m.group(1)}.mlp.experts.gate_up_proj"] = torch.cat(
                [t, state[f"{m.group(1)}.ffn.experts.w3"]], dim=1).to(dtype)
        elif m and m.group(2) == "w2":
            out[f"model.{m.group(1)}.mlp.experts.down_proj"] = t.to(dtype)
        elif not m:
            out[ds_to_hf(name)] = _keep_dtype(name, t, dtype).contiguous()
    return out


def _write_shards(tensors, out_dir, max_shard_bytes):
    shards, current, size = [], {}, 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensors[key]
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
