"""Model configuration: one frozen, normalised view of a checkpoint's config.json.

Two schemas describe the same model:
  * DeepSeek's released one: `compress_ratios` (per layer, optionally + one MTP entry),
    `num_hash_layers`, `qk_rope_head_dim`, flat `rope_scaling` (YaRN), `expert_dtype`,
    `quantization_config`;
  * transformers' one: `layer_types`, `compress_rates`, `mlp_layer_types`, nested
    `rope_parameters` {"main": ..., "compress": ...}.
`ModelConfig.from_dict` accepts either (or a mix) and rejects contradictions with a
`ConfigError` that names the field and the values it expects.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .config_parse import (CSA_RATIO, HCA_RATIO, LAYER_TYPE_OF_RATIO, MLP_TYPES,  # noqa: F401 (re-exported)
                           RATIO_OF_LAYER_TYPE, ConfigError, VisionConfig, YarnScaling, apply_overrides, check_index_topk_pattern,
                           normal_index_topk_pattern, parse_model_config, vision_dict)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    # one entry per main layer: 0 sliding only, 4 CSA, 128 HCA
    compress_ratios: tuple[int, ...] = ()
    # one entry per main layer: "hash_moe" or "moe"
    mlp_layer_types: tuple[str, ...] = ()
    mtp_compress_ratio: int = 0
    num_nextn_predict_layers: int = 1
    # DSpark block drafter (docs/speculative.md "DSpark"): 0 = none; its draft stages are the
    # num_nextn_predict_layers `mtp.*` blocks (sliding window only)
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # IndexCache: one letter per CSA layer of the main model, "F" computes the indexer top-k,
    # "S" reuses the last F layer's; "" = all F (config.json's index_topk_freq /
    # index_topk_pattern, normalised: equal settings give equal configs)
    index_topk_pattern: str = ""
    sliding_window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = None
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    expert_dtype: str | None = None  # "fp4" | "fp8" | None (same as the rest)
    quant_method: str | None = None  # "fp8" when the checkpoint holds FP8 weights
    quant_block: tuple[int, int] = (128, 128)
    torch_dtype: str = "bfloat16"
    vision: VisionConfig | None = None   # the vision tower (DeepSeek-V4-Flash-Vision; docs/vision.md)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        check_index_topk_pattern(self.index_topk_pattern or "F" * self.num_csa_layers, self.num_csa_layers)
        object.__setattr__(self, "index_topk_pattern", normal_index_topk_pattern(self.index_topk_pattern))

    # ---- derived ---------------------------------------------------------------
    @property
    def num_csa_layers(self) -> int:
        return sum(r == CSA_RATIO for r in self.compress_ratios)

    def index_topk_role(self, layer: int) -> str:
        """IndexCache role of layer `layer`: "F" (computes the indexer top-k), "S" (reuses the
        last F layer's) or "" (not a CSA layer). An MTP layer (layer >= num_hidden_layers) runs
        in a forward of its own, with no CSA layer before it: when it is CSA it is always F."""
        if layer >= len(self.compress_ratios):
            return "F" if self.mtp_compress_ratio == CSA_RATIO else ""
        if self.compress_ratios[layer] != CSA_RATIO:
            return ""
        j = sum(r == CSA_RATIO for r in self.compress_ratios[:layer])
        return self.index_topk_pattern[j] if self.index_topk_pattern else "F"

    @property
    def index_topk_producers(self) -> tuple[int, ...]:
        """Main layers whose indexer runs (and whose indexer-key cache is written): every CSA
        layer without IndexCache. Part of the cache layout: state written under another set
        lacks the indexer keys of some layer."""
        return tuple(i for i in range(len(self.compress_ratios)) if self.index_topk_role(i) == "F")

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(LAYER_TYPE_OF_RATIO[r] for r in self.compress_ratios)

    @property
    def num_hash_layers(self) -> int:
        return sum(t == "hash_moe" for t in self.mlp_layer_types)

    def is_hash_layer(self, layer: int) -> bool:
        return layer < len(self.mlp_layer_types) and self.mlp_layer_types[layer] == "hash_moe"

    # ---- construction ----------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """config.json of the checkpoint at `path`, with `overrides` (config.json keys, e.g.
        the engine's `--hf-overrides`) applied before parsing."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in checkpoint folder {path!r}")
        with open(cfg_path) as f:
            return cls.from_dict(json.load(f), overrides)

    @classmethod
    def from_dict(cls, d: dict[str, Any], overrides: dict[str, Any] | None = None) -> "ModelConfig":
        return parse_model_config(apply_overrides(d, overrides or {}), cls)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- export ----------------------------------------------------------------
    def to_released_dict(self) -> dict[str, Any]:
        """DeepSeek's released schema (what `init-random --names deepseek` writes)."""
        d = self._common_dict()
        d["compress_ratios"] = list(self.compress_ratios) + [self.mtp_compress_ratio] * self.num_nextn_predict_layers
        d["num_hash_layers"] = self.num_hash_layers
        d["qk_rope_head_dim"] = self.qk_rope_head_dim
        d["compress_rope_theta"] = self.compress_rope_theta
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.yarn)}
        if self.expert_dtype:
            d["expert_dtype"] = self.expert_dtype
        if self.index_topk_pattern:
            d["index_topk_pattern"] = self.index_topk_pattern
        if self.vision is not None:
            d.update(vision_dict(self.vision))
        if self.dspark_block_size:
            d.update(dspark_block_size=self.dspark_block_size, dspark_noise_token_id=self.dspark_noise_token_id,
                     dspark_target_layer_ids=list(self.dspark_target_layer_ids),
                     dspark_markov_rank=self.dspark_markov_rank)
        if self.quant_method:
            d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                        "activation_scheme": "dynamic",
                                        "weight_block_size": list(self.quant_block)}
        return d

    def to_transformers_dict(self) -> dict[str, Any]:
        """transformers' schema, as `DeepseekV4Config(**d)` accepts it (the oracle)."""
        d = self._common_dict()
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["compress_rates"] = {"compressed_sparse_attention": CSA_RATIO,
                               "heavily_compressed_attention": HCA_RATIO}
        d["partial_rotary_factor"] = self.qk_rope_head_dim / self.head_dim
        main = {"rope_type": "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": d["partial_rotary_factor"]}
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": d["partial_rotary_factor"]}
        if self.yarn is not None:
            compress.update(rope_type="yarn", attention_factor=1.0, **dataclasses.asdict(self.yarn))
        d["rope_parameters"] = {"main": main, "compress": compress}
        return d

    def _common_dict(self) -> dict[str, Any]:
        keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts",
                "n_shared_experts", "num_experts_per_tok", "routed_scaling_factor", "scoring_func",
                "num_nextn_predict_layers", "index_n_heads", "index_head_dim", "index_topk",
                "sliding_window", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps",
                "swiglu_limit", "rope_theta", "max_position_embeddings", "bos_token_id",
                "eos_token_id", "tie_word_embeddings", "torch_dtype")
        d = {k: getattr(self, k) for k in keys}
        d.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"],
                 num_key_value_heads=1, compress_rope_theta=self.compress_rope_theta)
        return d


SPECULATIVE_METHODS = ("mtp", "dspark")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/architecture.md, "Speculative decoding"): `method` drafts
    `num_speculative_tokens` tokens per request and step, verified in the next step. `model`:
    a draft checkpoint folder (`dsv4 convert --extract-mtp`) whose MTP blocks replace the
    model's own, or for method "dspark" a DSpark draft folder (dsv4/model/draft.py).
    `confidence_threshold` (method "dspark"): only the leading drafts whose confidence head
    probability is at least this are verified (0: all k)."""
    method: str = "mtp"
    num_speculative_tokens: int = 1
    model: str | None = None
    confidence_threshold: float = 0.0

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError("speculative_config", f"method: expected one of {list(SPECULATIVE_METHODS)}, "
                                                    f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError("speculative_config", f"num_speculative_tokens: expected an integer in "
                                                    f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError("speculative_config", f"model: expected a folder path, got {self.model!r}")
        c = self.confidence_threshold
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0:
            raise ConfigError("speculative_config", f"confidence_threshold: expected a number in [0, 1], got {c!r}")
        if c and self.method != "dspark":
            raise ConfigError("speculative_config", "confidence_threshold: only for method 'dspark'")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig, a dict of its fields, or that dict as JSON text (the CLI's
        `--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'`); None stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError("speculative_config", f"not valid JSON ({e.msg} at character {e.pos}): "
                                                        f"{value!r}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config", f"expected a JSON object, got {value!r}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError("speculative_config", f"unknown key(s) {unknown}; known: method, "
                                                    f"num_speculative_tokens, model, confidence_threshold")
        return cls(**value)


# Tokens a step when none is given: vLLM's choice, so the same flags behave alike. A large GPU
# (>= 70 GiB, not an A100) takes bigger steps; offline use (LLM) takes bigger steps than a server,
# whose running requests wait out every prefill chunk mixed into their decode steps.
LARGE_GPU_BYTES = 70 << 30
BATCHED_TOKENS = {("large", True): 8192, ("large", False): 16384, ("gpu", True): 2048, ("gpu", False): 8192,
                  ("cpu", True): 2048, ("cpu", False): 2048}


def default_batched_tokens(device: str, serving: bool) -> int:
    """max_num_batched_tokens when unset: by device class (cpu / gpu / large) and use."""
    kind = "cpu"
    if device.startswith("cuda"):
        import torch
        kind = "gpu"
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.device(device))
            if props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower():
                kind = "large"
    return BATCHED_TOKENS[(kind, serving)]


GRAMMAR_PROCESS_MIN_CORES = 8    # usable cores from which grammar_worker "auto" picks the process


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting (the CLI flags of `generate`, `serve` and `bench`)."""
    device: str = "cpu"
    dtype: str = "float32"                 # float32 | bfloat16
    max_num_batched_tokens: int | None = None   # tokens per step, all sequences together; None: by device (default_batched_tokens)
    max_num_seqs: int = 64                 # sequences per step (and request state slots)
    # prompt positions a step computes prompt logprobs for (logits rows), all requests together: 2048
    # keeps an evaluation's scoring prefills (many short prompts) at 2,048 tokens a step while the
    # memory plan's fp32 logits stay ~1 GiB (V4's 129k vocabulary) at any token budget
    max_prompt_logprobs_tokens: int = 2048
    max_model_len: int | None = None       # prompt + output tokens; None: min(model max, cache)
    num_pages: int | None = None           # 256-token history pages; None: from the memory budget
    cache_memory_gb: float | None = None   # cache budget; None: 1 GiB on CPU, 90% of free on GPU
    kv_cache_dtype: str = "auto"           # auto: the model dtype; fp8: DeepSeek's packed FP8 rows
    spec_slots: int = 0                    # S: speculative tokens the private state can roll back
    seed: int = 0
    ops_backend: str = "auto"              # auto: Triton kernels on CUDA; reference: torch ops only
    enforce_eager: bool = False            # no CUDA graphs for decode steps
    cuda_graph_max_bs: int = 256           # largest decode batch replayed as a CUDA graph
    async_scheduling: str = "auto"         # on: launch step k+1 before reading step k's tokens; auto: on CUDA
    keep_fp8: bool = False                 # FP8 expert weights stay FP8 (dequantised in the MoE kernels)
    keep_mxfp4: bool = False               # MXFP4 routed expert weights stay MXFP4 (likewise)
    keep_fp8_dense: bool = False           # FP8 attention / dense projections stay FP8 (FP8 GEMMs, ops/quant_gemm.py)
    index_topk_freq: int | None = None     # IndexCache over config.json: every f-th CSA layer computes the top-k
    index_topk_pattern: str | None = None  # IndexCache over config.json: "F"/"S" per CSA layer
    hf_overrides: str | None = None        # JSON object of config.json keys applied over the checkpoint's
    enable_prefix_caching: bool = True     # share the history pages of resent prefixes (cache/prefix.py)
    num_checkpoints: int | None = None     # prefix-cache checkpoints; None: one per 16 history pages, >= 2 per slot
    host_cache_gb: float = 0.0             # host-RAM tier of the prefix cache (cache/tiers/); 0: off
    disk_cache_dir: str | None = None      # disk tier's folder (needs the host tier); None: off
    disk_cache_gb: float = 16.0            # most bytes of the disk tier's files
    tokenizer: str | None = None           # tokenizer folder; None: the model folder's
    speculative_config: SpeculativeConfig | None = None   # off by default; a dict or JSON text is parsed
    tensor_parallel_size: int = 1          # ranks sharing each layer (dsv4/parallel/tensor_parallel.py)
    data_parallel_size: int = 1            # ranks running attention on their own requests (expert parallel MoE)
    enable_expert_parallel: bool = False   # routed experts split E/N over the ranks instead of each expert's width
    grammar_worker: str = "auto"           # process | threads | auto: where grammar masks are filled (grammar_process)

    def __post_init__(self):
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", default_batched_tokens(self.device, serving=False))
        for name in ("max_num_batched_tokens", "max_num_seqs", "cuda_graph_max_bs", "max_prompt_logprobs_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"expected a positive integer, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError("dtype", f"expected 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len", f"expected a positive integer, got {self.max_model_len}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError("num_pages", f"expected a positive integer, got {self.num_pages}")
        if self.num_checkpoints is not None and self.num_checkpoints < 0:
            raise ConfigError("num_checkpoints", f"expected >= 0, got {self.num_checkpoints}")
        if self.spec_slots < 0:
            raise ConfigError("spec_slots", f"expected >= 0, got {self.spec_slots}")
        self._check_tiers()
        self._set_speculative()
        self._check_parallel()
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError("async_scheduling", f"expected 'auto', 'on' or 'off', got {self.async_scheduling!r}")
        if self.grammar_worker not in ("auto", "process", "threads"):
            raise ConfigError("grammar_worker", f"expected 'auto', 'process' or 'threads', got {self.grammar_worker!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ConfigError("kv_cache_dtype", f"expected 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.ops_backend not in ("auto", "reference"):
            raise ConfigError("ops_backend", f"expected 'auto' or 'reference', got {self.ops_backend!r}")
        f = self.index_topk_freq
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 1):
            raise ConfigError("index_topk_freq", f"expected a positive integer, got {f!r}")
        p = self.index_topk_pattern
        if p is not None and (not isinstance(p, str) or not p or set(p) - {"F", "S"}):
            raise ConfigError("index_topk_pattern", f"expected a string of 'F' and 'S' letters, got {p!r}")
        self._hf_overrides()

    def _check_tiers(self) -> None:
        for name in ("host_cache_gb", "disk_cache_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
                raise ConfigError(name, f"expected a finite number of GiB >= 0, got {v!r}")
        if self.host_cache_gb and not self.enable_prefix_caching:
            raise ConfigError("host_cache_gb", "the host tier keeps prefix-cache pages: it needs "
                                               "enable_prefix_caching")
        if self.disk_cache_dir is not None:
            if not self.disk_cache_dir:
                raise ConfigError("disk_cache_dir", "expected a folder, got ''")
            if not self.host_cache_gb:
                raise ConfigError("disk_cache_dir", "the disk tier is written from the host tier: set "
                                                    "host_cache_gb > 0")
            if not self.disk_cache_gb:
                raise ConfigError("disk_cache_gb", "expected > 0 with disk_cache_dir")

    def _hf_overrides(self) -> dict[str, Any]:
        if self.hf_overrides is None:
            return {}
        try:
            d = json.loads(self.hf_overrides)
        except (TypeError, ValueError) as e:
            raise ConfigError("hf_overrides", f"expected a JSON object, got {self.hf_overrides!r} ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError("hf_overrides", f"expected a JSON object, got {self.hf_overrides!r}")
        return d

    def check_no_model_overrides(self) -> None:
        """For a model built elsewhere (not loaded by the engine): the overrides cannot be applied
        to it, so there must be none."""
        given = [n for n in ("index_topk_freq", "index_topk_pattern", "hf_overrides") if getattr(self, n) is not None]
        if given:
            raise ConfigError(given[0], "model overrides apply when the engine loads the model; this engine was "
                                        "given a built model: build it with them (load_model(overrides=...))")

    def model_overrides(self) -> dict[str, Any]:
        """config.json keys the engine applies over the checkpoint's (`ModelConfig.from_dir`):
        hf_overrides, then the IndexCache flags."""
        d = self._hf_overrides()
        for name in ("index_topk_freq", "index_topk_pattern"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(name, f"expected a positive integer, got {v!r}")
        dp, tp = self.data_parallel_size, self.tensor_parallel_size
        if dp > 1 and tp > 1:
            raise ConfigError("data_parallel_size", f"{dp} with tensor_parallel_size {tp}: data-parallel attention "
                                                    "runs one whole attention per rank (tensor_parallel_size 1)")
        if dp > 1 and not self.enable_expert_parallel:
            raise ConfigError("data_parallel_size", f"{dp} needs --enable-expert-parallel: the DP ranks split the "
                                                    "routed experts E/N (docs/architecture.md, Parallelism)")
        if self.enable_expert_parallel and self.world_size == 1:
            raise ConfigError("enable_expert_parallel", "needs --tensor-parallel-size or --data-parallel-size above 1")
        if self.world_size > 1 and self.speculative_config is not None:
            raise ConfigError("speculative_config", "speculative decoding does not run over several ranks yet")
        if self.world_size > 1 and self.host_cache_gb:
            raise ConfigError("host_cache_gb", "the host / disk tiers restore pages on one rank only: "
                                               "not under tensor or data parallelism yet")

    @property
    def grammar_process(self) -> bool:
        """Whether the matchers live in a grammar worker process (structured/remote.py) rather
        than in the engine's, filled on its fill threads; auto: a process with
        GRAMMAR_PROCESS_MIN_CORES usable cores or more (on fewer it takes a core the main
        thread needs)."""
        if self.grammar_worker != "auto":
            return self.grammar_worker == "process"
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cores >= GRAMMAR_PROCESS_MIN_CORES

    @property
    def world_size(self) -> int:
        """Processes (ranks) of the run: tensor_parallel_size x data_parallel_size (one of them is 1)."""
        return self.tensor_parallel_size * self.data_parallel_size

    def _set_speculative(self) -> None:
        """Parse `speculative_config`; spec_slots (the positions the private cache state can roll
        back) defaults to num_speculative_tokens and may not be smaller."""
        spec = SpeculativeConfig.parse(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is None:
            return
        k = spec.num_speculative_tokens
        if self.spec_slots == 0:
            object.__setattr__(self, "spec_slots", k)
        elif self.spec_slots < k:
            raise ConfigError("spec_slots", f"{self.spec_slots} is below num_speculative_tokens {k}: the "
                                            f"cache must roll back every rejected draft")
