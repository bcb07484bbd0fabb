"""Parsing of a checkpoint's config.json into `ModelConfig` (dsv4/config.py describes the two
schemas): each field read and checked, the schemas reconciled, contradictions rejected with a
`ConfigError` naming the field and the values it expects. The schema's constants, `ConfigError`
and `YarnScaling` live here (dsv4/config.py re-exports them), so config.py imports this module
and never the reverse."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CSA_RATIO = 4
HCA_RATIO = 128
LAYER_TYPE_OF_RATIO = {0: "sliding_attention", CSA_RATIO: "compressed_sparse_attention",
                       HCA_RATIO: "heavily_compressed_attention"}
RATIO_OF_LAYER_TYPE = {v: k for k, v in LAYER_TYPE_OF_RATIO.items()}
MLP_TYPES = ("hash_moe", "moe")


class ConfigError(ValueError):
    """A config field is missing, invalid or contradicts another one."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"config field `{field_name}`: {message}")
        self.field = field_name


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0

@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of DeepSeek-V4-Flash-Vision (docs/vision.md): config.json's flat
    `vision_*` fields, as the released checkpoint writes them."""
    n_layers: int
    dim: int
    n_heads: int
    inter_dim: int
    patch_size: int
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_n_token: int = 384           # LLM tokens of one image block at most (alignment pads included)
    min_pixels: int = 147456         # smaller images are scaled up to this area first
    max_wh_ratio: float | None = 8.0  # wider images are squeezed to this width / height
    image_token_id: int | None = None  # the id written at image block positions (None: the tokenizer's)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


_VISION_INT = ("n_layers", "dim", "n_heads", "inter_dim", "patch_size", "downsample_ratio", "max_n_token",
               "min_pixels")


def parse_vision(d: dict[str, Any]) -> VisionConfig | None:
    """config.json's `vision_*` fields -> VisionConfig; None for a text-only checkpoint (no
    `vision_n_layers`, or 0). ConfigError names the field."""
    if not d.get("vision_n_layers"):
        return None
    kw: dict[str, Any] = {}
    for name in _VISION_INT:
        key = "vision_" + name
        if key in d:
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(key, f"expected a positive integer, got {v!r}")
            kw[name] = v
        elif name in ("n_layers", "dim", "n_heads", "inter_dim", "patch_size"):
            raise ConfigError(key, "is required when vision_n_layers is set")
    if "vision_rope_theta" in d:
        kw["rope_theta"] = _number(d, "vision_rope_theta")
    if d.get("vision_max_wh_ratio") is not None:
        kw["max_wh_ratio"] = _number(d, "vision_max_wh_ratio")
    if d.get("image_token_id") is not None:
        if not isinstance(d["image_token_id"], int) or isinstance(d["image_token_id"], bool):
            raise ConfigError("image_token_id", f"expected a token id, got {d['image_token_id']!r}")
        kw["image_token_id"] = d["image_token_id"]
    v = VisionConfig(**kw)
    if v.dim % v.n_heads or v.head_dim % 4:
        raise ConfigError("vision_n_heads", f"vision_dim={v.dim} / vision_n_heads must be a multiple of 4 "
                                            f"(2D RoPE halves), got {v.n_heads} heads")
    if v.max_n_token < 16:
        raise ConfigError("vision_max_n_token", f"expected at least 16, got {v.max_n_token}")
    return v


def vision_dict(v: VisionConfig) -> dict[str, Any]:
    """The released config.json fields of `v`."""
    d = {"vision_" + k: getattr(v, k) for k in (*_VISION_INT, "rope_theta", "max_wh_ratio")}
    if v.image_token_id is not None:
        d["image_token_id"] = v.image_token_id
    return d


_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
               "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
               "n_shared_experts", "num_experts_per_tok", "num_nextn_predict_layers", "index_n_heads",
               "index_head_dim", "index_topk", "sliding_window", "hc_mult", "hc_sinkhorn_iters",
               "max_position_embeddings")
_FLOAT_FIELDS = ("routed_scaling_factor", "hc_eps", "rms_norm_eps", "swiglu_limit", "rope_theta",
                 "compress_rope_theta")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def parse_model_config(d: dict[str, Any], model_config: type):
    """config.json (either schema, see dsv4/config.py) -> a `model_config` (dsv4.config.ModelConfig);
    ConfigError names the field."""
    for name in _REQUIRED:
        if name not in d:
            raise ConfigError(name, "is required")
    kw: dict[str, Any] = {}
    for name in _INT_FIELDS:
        if name in d and d[name] is not None:
            kw[name] = _positive_int(d, name)
    for name in _FLOAT_FIELDS:
        if name in d and d[name] is not None:
            kw[name] = _number(d, name)
    n = kw["num_hidden_layers"]
    n_mtp = kw.setdefault("num_nextn_predict_layers", 1)
    _check_kv_heads(d)
    kw.update(parse_dspark(d, n, kw["vocab_size"]))
    if kw.get("dspark_block_size") and isinstance(d.get("compress_ratios"), list) and len(d["compress_ratios"]) > n:
        n_mtp = kw["num_nextn_predict_layers"] = len(d["compress_ratios"]) - n   # the draft stages
    kw["compress_ratios"], kw["mtp_compress_ratio"] = _parse_ratios(d, n, n_mtp)
    if kw.get("dspark_block_size") and any(d.get("compress_ratios", [])[n:]):
        raise ConfigError("compress_ratios", f"DSpark draft stages are sliding-window only: expected 0 for "
                                             f"entries {n}.., got {d['compress_ratios'][n:]}")
    kw["mlp_layer_types"] = _parse_mlp_types(d, n)
    head_dim = kw.get("head_dim", 512)
    kw["qk_rope_head_dim"] = _parse_rope_dim(d, head_dim)
    _parse_rope(d, kw)
    for name in ("bos_token_id", "eos_token_id"):
        if isinstance(d.get(name), int):
            kw[name] = d[name]
        elif isinstance(d.get(name), list) and d[name]:
            kw[name] = int(d[name][0])
    if "scoring_func" in d and d["scoring_func"] != "sqrtsoftplus":
        raise ConfigError("scoring_func", f"expected 'sqrtsoftplus', got {d['scoring_func']!r}")
    kw["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    if "torch_dtype" in d and "dtype" in d and d["torch_dtype"] != d["dtype"]:
        raise ConfigError("torch_dtype", f"contradicts dtype: {d['torch_dtype']!r} vs {d['dtype']!r}")
    dtype = d.get("torch_dtype", d.get("dtype", "bfloat16"))
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ConfigError("torch_dtype", f"expected bfloat16, float16 or float32, got {dtype!r}")
    kw["torch_dtype"] = dtype
    _parse_quant(d, kw)
    kw["index_topk_pattern"] = parse_index_topk(d, kw["compress_ratios"])
    kw["vision"] = parse_vision(d)
    known = set(model_config.__dataclass_fields__) | {"index_topk_freq", "image_token_id"}
    known |= {k for k in d if k.startswith("vision_")}
    kw["extra"] = {k: v for k, v in d.items() if k not in known}
    cfg = model_config(**kw)
    _validate(cfg)
    return cfg


def parse_dspark(d, n: int, vocab: int) -> dict[str, Any]:
    """The DSpark drafter's fields (docs/speculative.md "DSpark"): all or nothing, once
    `dspark_block_size` is given."""
    names = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")
    if d.get("dspark_block_size") is None:
        return {}
    for name in names:
        if d.get(name) is None:
            raise ConfigError(name, "is required when dspark_block_size is set")
    out = {name: _positive_int(d, name) for name in ("dspark_block_size", "dspark_markov_rank")}
    noise = d["dspark_noise_token_id"]
    if isinstance(noise, bool) or not isinstance(noise, int) or not 0 <= noise < vocab:
        raise ConfigError("dspark_noise_token_id", f"expected a token id in [0, {vocab}), got {noise!r}")
    ids = d["dspark_target_layer_ids"]
    if (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in ids)):
        raise ConfigError("dspark_target_layer_ids", f"expected distinct main layer ids in [0, {n}), got {ids!r}")
    out.update(dspark_noise_token_id=noise, dspark_target_layer_ids=tuple(ids))
    return out


def _positive_int(d, name) -> int:
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "num_nextn_predict_layers" else 1):
        raise ConfigError(name, f"expected a positive integer, got {v!r}")
    return v


def _number(d, name) -> float:
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(name, f"expected a number, got {v!r}")
    return float(v)


def _check_kv_heads(d):
    if d.get("num_key_value_heads", 1) != 1:
        raise ConfigError("num_key_value_heads", f"DeepSeek-V4 has one shared K=V head; expected 1, "
                                                 f"got {d['num_key_value_heads']!r}")


def _parse_ratios(d, n: int, n_mtp: int) -> tuple[tuple[int, ...], int]:
    rates = d.get("compress_rates")
    if rates is not None:
        want = {"compressed_sparse_attention": CSA_RATIO, "heavily_compressed_attention": HCA_RATIO}
        if not isinstance(rates, dict) or any(rates.get(k, v) != v for k, v in want.items()):
            raise ConfigError("compress_rates", f"expected {want}, got {rates!r}")
    for legacy, want in (("compress_rate_csa", CSA_RATIO), ("compress_rate_hca", HCA_RATIO)):
        if legacy in d and d[legacy] != want:
            raise ConfigError(legacy, f"expected {want}, got {d[legacy]!r}")
    ratios = d.get("compress_ratios")
    types = d.get("layer_types")
    mtp_ratio = 0
    if ratios is not None:
        if not isinstance(ratios, list) or any(isinstance(r, bool) or r not in LAYER_TYPE_OF_RATIO for r in ratios):
            raise ConfigError("compress_ratios", f"expected a list of values in {sorted(LAYER_TYPE_OF_RATIO)}, "
                                                 f"got {ratios!r}")
        if len(ratios) not in (n, n + n_mtp):
            raise ConfigError("compress_ratios", f"expected {n} entries (num_hidden_layers) or {n + n_mtp} "
                                                 f"(+ num_nextn_predict_layers), got {len(ratios)}")
        if len(ratios) > n:
            mtp_ratio = ratios[n]
        ratios = tuple(ratios[:n])
    if types is not None:
        if not isinstance(types, list) or any(t not in RATIO_OF_LAYER_TYPE for t in types):
            raise ConfigError("layer_types", f"expected a list of values in {list(RATIO_OF_LAYER_TYPE)}, "
                                             f"got {types!r}")
        if len(types) != n:
            raise ConfigError("layer_types", f"expected {n} entries (num_hidden_layers), got {len(types)}")
        from_types = tuple(RATIO_OF_LAYER_TYPE[t] for t in types)
        if ratios is not None and from_types != ratios:
            raise ConfigError("layer_types", f"contradicts compress_ratios {list(ratios)}: expected "
                                             f"{[LAYER_TYPE_OF_RATIO[r] for r in ratios]}")
        ratios = from_types
    if ratios is None:
        raise ConfigError("compress_ratios", "is required (or layer_types in the transformers schema)")
    return ratios, mtp_ratio


def _parse_mlp_types(d, n: int) -> tuple[str, ...]:
    types = d.get("mlp_layer_types")
    n_hash = d.get("num_hash_layers")
    if n_hash is not None and (isinstance(n_hash, bool) or not isinstance(n_hash, int) or not 0 <= n_hash <= n):
        raise ConfigError("num_hash_layers", f"expected an integer in [0, {n}], got {n_hash!r}")
    if types is not None:
        if not isinstance(types, list) or len(types) != n or any(t not in MLP_TYPES for t in types):
            raise ConfigError("mlp_layer_types", f"expected {n} entries from {MLP_TYPES}, got {types!r}")
        if n_hash is not None and tuple(types) != ("hash_moe",) * n_hash + ("moe",) * (n - n_hash):
            raise ConfigError("mlp_layer_types", f"contradicts num_hash_layers={n_hash}: expected the first "
                                                 f"{n_hash} to be 'hash_moe' and the rest 'moe'")
        return tuple(types)
    n_hash = 3 if n_hash is None else n_hash
    n_hash = min(n_hash, n)
    return ("hash_moe",) * n_hash + ("moe",) * (n - n_hash)


def _parse_rope_dim(d, head_dim: int) -> int:
    rope_dim = d.get("qk_rope_head_dim")
    prf = d.get("partial_rotary_factor")
    rp = d.get("rope_parameters")
    nested = [v.get("partial_rotary_factor") for v in (rp or {}).values() if isinstance(v, dict)] if isinstance(
        rp, dict) else []
    for value in nested:
        if value is None:
            continue
        if prf is not None and value != prf:
            raise ConfigError("rope_parameters.partial_rotary_factor",
                              f"contradicts partial_rotary_factor={prf}: got {value}")
        prf = value
    if rope_dim is None and prf is not None:
        rope_dim = int(round(head_dim * prf))
    elif rope_dim is not None and prf is not None and int(round(head_dim * prf)) != rope_dim:
        raise ConfigError("partial_rotary_factor", f"contradicts qk_rope_head_dim={rope_dim}: expected "
                                                   f"{rope_dim / head_dim}")
    rope_dim = 64 if rope_dim is None else rope_dim
    if not isinstance(rope_dim, int) or rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError("qk_rope_head_dim", f"expected an even integer in (0, head_dim={head_dim}], "
                                              f"got {rope_dim!r}")
    return rope_dim


def _parse_rope(d, kw):
    """Main (sliding) θ, compress θ and YaRN from flat `rope_scaling` or nested `rope_parameters`."""
    rp = d.get("rope_parameters")
    yarn_src = d.get("rope_scaling")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict):
        main, comp = rp["main"], rp.get("compress") or {}
        for src, dst in ((main, "rope_theta"), (comp, "compress_rope_theta")):
            if "rope_theta" in src:
                if dst in kw and float(src["rope_theta"]) != kw[dst]:
                    raise ConfigError(dst, f"contradicts rope_parameters: {src['rope_theta']} vs {kw[dst]}")
                kw[dst] = float(src["rope_theta"])
        if main.get("rope_type", "default") != "default":
            raise ConfigError("rope_parameters.main.rope_type", f"expected 'default', got {main['rope_type']!r}")
        comp_kind = comp.get("rope_type", comp.get("type", "default"))
        flat_kind = (yarn_src or {}).get("rope_type", (yarn_src or {}).get("type")) if yarn_src else None
        if yarn_src and (flat_kind != comp_kind or yarn_src.get("factor") != comp.get("factor")):
            raise ConfigError("rope_scaling", f"contradicts rope_parameters.compress: expected the same type "
                                              f"({comp_kind!r}) and factor ({comp.get('factor')!r})")
        yarn_src = comp if comp_kind == "yarn" else None
    elif isinstance(rp, dict) and rp and yarn_src is None:
        yarn_src = rp  # flat rope_parameters, transformers' legacy form
    if yarn_src:
        kind = yarn_src.get("rope_type", yarn_src.get("type", "default"))
        if kind == "default":
            kw["yarn"] = None
            return
        if kind != "yarn":
            raise ConfigError("rope_scaling.type", f"expected 'yarn', got {kind!r}")
        try:
            kw["yarn"] = YarnScaling(
                factor=float(yarn_src["factor"]),
                original_max_position_embeddings=int(yarn_src["original_max_position_embeddings"]),
                beta_fast=float(yarn_src.get("beta_fast") or 32), beta_slow=float(yarn_src.get("beta_slow") or 1))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError("rope_scaling", f"YaRN needs numeric factor and original_max_position_embeddings "
                                              f"({e})") from None
        if yarn_src.get("mscale") or yarn_src.get("attention_factor") not in (None, 1, 1.0):
            raise ConfigError("rope_scaling", "V4 applies no YaRN mscale; expected attention_factor 1 / no mscale")


def _parse_quant(d, kw):
    ed = d.get("expert_dtype")
    q = d.get("quantization_config")
    if isinstance(q, dict) and ed is None:
        ed = q.get("expert_dtype")
    if ed not in (None, "fp4", "fp8", "bf16", "bfloat16"):
        raise ConfigError("expert_dtype", f"expected 'fp4', 'fp8' or 'bf16', got {ed!r}")
    kw["expert_dtype"] = ed
    if q is None:
        return
    if not isinstance(q, dict) or q.get("quant_method", "fp8") != "fp8":
        raise ConfigError("quantization_config.quant_method", f"expected 'fp8', got {q!r}")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError("quantization_config.fmt", f"expected 'e4m3', got {fmt!r}")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError("quantization_config.weight_block_size", f"expected [rows, cols], got {block!r}")
    kw["quant_method"] = "fp8"
    kw["quant_block"] = tuple(block)


def parse_index_topk(d, ratios: tuple[int, ...]) -> str:
    """IndexCache: which CSA layers compute the indexer top-k ("F", producers) and which reuse
    the last producer's ("S", shared), as one letter per CSA layer of the main model, in
    order; "" when every CSA layer is a producer (no IndexCache).

    `index_topk_freq` f (null -> 1): the CSA layer j (0-based among CSA layers) is F iff
    j % f == 0. `index_topk_pattern`: the F/S string itself (it wins over a default freq; a
    freq that gives another pattern contradicts it)."""
    freq = d.get("index_topk_freq")
    if freq is None:
        freq = 1
    elif isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ConfigError("index_topk_freq", f"expected a positive integer (or null for 1), got {freq!r}")
    n_csa = sum(r == CSA_RATIO for r in ratios)
    from_freq = "".join("F" if j % freq == 0 else "S" for j in range(n_csa))
    pattern = d.get("index_topk_pattern")
    if pattern is None:
        return normal_index_topk_pattern(from_freq)
    check_index_topk_pattern(pattern, n_csa)
    if freq != 1 and pattern != from_freq:
        raise ConfigError("index_topk_pattern", f"contradicts index_topk_freq={freq} (which gives "
                                                f"{from_freq!r}); give one of the two")
    return normal_index_topk_pattern(pattern)


def check_index_topk_pattern(pattern, n_csa: int) -> None:
    """An explicit pattern: one F or S per CSA layer, the first one F (a shared layer needs a
    producer before it)."""
    if not isinstance(pattern, str) or set(pattern) - {"F", "S"}:
        raise ConfigError("index_topk_pattern", f"expected a string of 'F' (producer) and 'S' (shared) "
                                                f"letters, got {pattern!r}")
    if len(pattern) != n_csa:
        raise ConfigError("index_topk_pattern", f"expected one letter per CSA layer ({n_csa} in "
                                                f"compress_ratios), got {len(pattern)} ({pattern!r})")
    if pattern and pattern[0] != "F":
        raise ConfigError("index_topk_pattern", f"the first CSA layer must be 'F' (a producer), got {pattern!r}")


def normal_index_topk_pattern(pattern: str) -> str:
    """"" for a pattern of only producers: every such config is the same model."""
    return "" if "S" not in pattern else pattern


def apply_overrides(d: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json with engine overrides on top (each key replaced). index_topk_freq and
    index_topk_pattern are one setting: overriding one drops the other from config.json."""
    out = {**d, **overrides}
    for name, other in (("index_topk_freq", "index_topk_pattern"), ("index_topk_pattern", "index_topk_freq")):
        if name in overrides and other not in overrides:
            out.pop(other, None)
    return out


def _validate(c):
    if c.num_attention_heads % c.o_groups:
        raise ConfigError("o_groups", f"must divide num_attention_heads={c.num_attention_heads}, got {c.o_groups}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError("num_experts_per_tok", f"expected at most n_routed_experts={c.n_routed_experts}, "
                                                 f"got {c.num_experts_per_tok}")
    if c.n_shared_experts != 1:
        raise ConfigError("n_shared_experts", f"expected 1, got {c.n_shared_experts}")
    if c.head_dim % 2:
        raise ConfigError("head_dim", f"expected an even number, got {c.head_dim}")
    if c.vision is not None and c.vision.image_token_id is not None and not 0 <= c.vision.image_token_id < c.vocab_size:
        raise ConfigError("image_token_id", f"expected an id below vocab_size={c.vocab_size}, "
                                            f"got {c.vision.image_token_id}")
    if c.index_head_dim < c.qk_rope_head_dim:
        raise ConfigError("index_head_dim", f"expected at least qk_rope_head_dim={c.qk_rope_head_dim}, "
                                            f"got {c.index_head_dim}")
