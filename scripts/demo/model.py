"""The demo model as trained: transformers' `DeepseekV4ForCausalLM` (the oracle dsv4 agrees
with) plus one MTP layer built from transformers' own pieces, the training losses, and the
export to DeepSeek's released tensor names.

MTP (DeepSeek-V3/V4): at position t, h = e_proj(enorm(embed(x_{t+1}))) + h_proj(hnorm(h_t)),
with h_t the main model's final residual streams [B, S, hc_mult, hidden] *before* hc_head,
then a sliding-window block with a top-k MoE (rope positions t, the same causal window as
the main model), its own hc_head -> norm, and the shared head: logits for x_{t+2}.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import ModelConfig
from dsv4.model.names import HF_DOWN, HF_GATE_UP, hf_to_ds
from dsv4.model.random_init import FP32_NAMES

DEMO_CONFIG = dict(
    vocab_size=8192, hidden_size=256, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
    qk_rope_head_dim=32, q_lora_rank=128, o_groups=2, o_lora_rank=128, moe_intermediate_size=192,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus", compress_ratios=[0, 4, 128, 4, 128, 0, 0], num_hash_layers=1,
    num_nextn_predict_layers=1, index_n_heads=8, index_head_dim=64, index_topk=64, sliding_window=128,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, swiglu_limit=10.0,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                  "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=65536, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)

# a few-seconds CPU smoke configuration with every layer kind (sliding, CSA, HCA) and both MoE kinds
SMOKE_OVERRIDES = dict(hidden_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                       q_lora_rank=32, o_lora_rank=32, moe_intermediate_size=32, index_n_heads=4,
                       index_head_dim=32, index_topk=8, sliding_window=32)


def demo_config(vocab_size: int, smoke: bool = False) -> ModelConfig:
    return ModelConfig.from_dict({**DEMO_CONFIG, **(SMOKE_OVERRIDES if smoke else {}), "vocab_size": vocab_size})


def _hf_config(cfg: ModelConfig, extra_layer: bool = False):
    from transformers import DeepseekV4Config
    d = cfg.to_transformers_dict()
    if extra_layer:  # the MTP block: one more layer, sliding window with a top-k MoE
        d.update(num_hidden_layers=cfg.num_hidden_layers + 1,
                 layer_types=d["layer_types"] + ["sliding_attention"],
                 mlp_layer_types=d["mlp_layer_types"] + ["moe"])
    hf = DeepseekV4Config(**d)
    hf._attn_implementation = "eager"
    hf._experts_implementation = "eager"
    return hf


class MTPHead(nn.Module):
    """One MTP layer; parameter names map onto `mtp.0.*` (see `export_state`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer, DeepseekV4HyperHead, DeepseekV4RMSNorm)
        hf = _hf_config(cfg, extra_layer=True)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = DeepseekV4DecoderLayer(hf, cfg.num_hidden_layers)
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(H, eps) for _ in range(3))
        self.hc_head = DeepseekV4HyperHead(hf)

    def forward(self, streams, next_ids, embed: nn.Embedding, layer_kwargs: dict) -> torch.Tensor:
        """streams [B, S, N, H] at positions t, next_ids [B, S] = x_{t+1} -> normed hidden [B, S, H]."""
        e = self.e_proj(self.enorm(embed(next_ids)))
        h = self.h_proj(self.hnorm(streams)) + e.unsqueeze(2)
        h = self.layer(h, input_ids=next_ids, **layer_kwargs)
        return self.norm(self.hc_head(h))


class DemoModel(nn.Module):
    """Main model + MTP head; `forward` returns main and MTP logits and the indexer loss."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        from transformers import DeepseekV4ForCausalLM
        torch.manual_seed(seed)
        self.cfg = cfg
        self.main = DeepseekV4ForCausalLM(_hf_config(cfg))
        self.mtp = MTPHead(cfg)
        _init_like_transformers(self.mtp, self.main.config.initializer_range)
        self.mtp.layer.mlp.gate.e_score_correction_bias.zero_()
        gen = torch.Generator().manual_seed(seed)
        for router in self.hash_routers():   # fixed token -> expert table of the hash layers
            router.tid2eid.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[:router.top_k]
                                              for _ in range(cfg.vocab_size)]))
        self._probe = _Probe(self)

    def hash_routers(self):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter
        return [m for m in self.modules() if isinstance(m, DeepseekV4HashRouter)]

    def topk_routers(self):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter
        return [m for m in self.modules() if isinstance(m, DeepseekV4TopKRouter)]

    def forward(self, ids: torch.Tensor, with_indexer_loss: bool = False):
        """ids [B, L+2] -> (main logits [B, L, V] for x_{t+1}, MTP logits [B, L, V] for x_{t+2},
        indexer KL loss or None)."""
        x, nxt = ids[:, :-2], ids[:, 1:-1]
        self._probe.start(with_indexer_loss)
        try:
            logits = self.main(input_ids=x, use_cache=False).logits
            streams, layer_kwargs = self._probe.last_layer
            hidden = self.mtp(streams, nxt, self.main.model.embed_tokens, layer_kwargs)
            mtp_logits = self.main.lm_head(hidden)
            idx_loss = self._probe.indexer_loss() if with_indexer_loss else None
        finally:
            self._probe.stop()
        return logits, mtp_logits, idx_loss

    def router_loads(self) -> list[tuple[nn.Module, torch.Tensor]]:
        return self._probe.loads


class _Probe:
    """Forward hooks: the last main layer's output streams and call kwargs (for MTP), top-k
    router choices (for the bias balancing), and what the indexer loss needs."""

    def __init__(self, model: DemoModel):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4Attention, DeepseekV4CSACompressor, DeepseekV4Indexer)
        self.active = False
        self.last_layer = None
        self.loads: list = []
        self._idx: dict[int, dict] = {}
        main_layers = model.main.model.layers
        main_layers[-1].register_forward_hook(self._on_last_layer, with_kwargs=True)
        for router in model.topk_routers():
            router.register_forward_hook(self._on_router)
        for i, layer in enumerate(main_layers):
            comp = layer.self_attn.compressor
            if isinstance(comp, DeepseekV4CSACompressor):
                assert isinstance(comp.indexer, DeepseekV4Indexer)
                comp.indexer.register_forward_pre_hook(_detach_inputs)
                comp.indexer.scorer.register_forward_hook(self._store(i, "scores"))
                comp.register_forward_hook(self._store(i, "block_bias", 1))
                assert isinstance(layer.self_attn, DeepseekV4Attention)
                layer.self_attn.register_forward_hook(self._store(i, "probs", 1))

    def start(self, indexer: bool):
        self.active, self.indexer, self.loads, self._idx = True, indexer, [], {}

    def stop(self):
        self.active, self.last_layer, self._idx = False, None, {}

    def _on_last_layer(self, module, args, kwargs, output):
        if self.active:
            keep = ("position_embeddings", "position_ids", "attention_mask")
            self.last_layer = (output, {k: kwargs[k] for k in keep})

    def _on_router(self, module, args, output):
        if self.active:
            self.loads.append((module, output[2].detach()))

    def _store(self, layer: int, what: str, index: int | None = None):
        def hook(module, args, output):
            if self.active and self.indexer:
                self._idx.setdefault(layer, {})[what] = output if index is None else output[index]
        return hook

    def indexer_loss(self) -> torch.Tensor:
        """KL(attention mass on the selected compressed entries || indexer softmax over them),
        summed over heads and averaged over queries that selected any entry (DeepSeek-V3.2's
        sparse-stage indexer loss; the indexer's inputs are detached from the main graph)."""
        losses = []
        for rec in self._idx.values():
            scores, bias, probs = rec["scores"].float(), rec["block_bias"], rec["probs"]
            T = scores.shape[-1]
            if T == 0 or bias is None:
                continue
            selected = bias[:, 0] == 0                                           # [B, S, T]
            target = probs[..., -T:].detach().float().sum(1) * selected         # [B, S, T]
            rows = target.sum(-1) > 0
            if not rows.any():
                continue
            target = target[rows] / target[rows].sum(-1, keepdim=True)
            logq = torch.log_softmax(scores[rows].masked_fill(~selected[rows], float("-inf")), -1)
            kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - logq), 0.0)
            losses.append(kl.sum(-1).mean())
        return torch.stack(losses).mean() if losses else torch.zeros(())


def _detach_inputs(module, args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def _init_like_transformers(module: nn.Module, std: float) -> None:
    """transformers' V4 initialisation: matrices N(0, std); hc base and sinks 0; hc scale and
    norm weights 1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("base", "hc_base", "sinks"):
                p.zero_()
            elif leaf in ("scale", "hc_scale") or "norm" in name or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


def lm_losses(logits, mtp_logits, ids):
    """Mean cross-entropy of the main model (x_{t+1}) and of the MTP head (x_{t+2})."""
    V = logits.shape[-1]
    main = F.cross_entropy(logits.float().reshape(-1, V), ids[:, 1:-1].reshape(-1))
    mtp = F.cross_entropy(mtp_logits.float().reshape(-1, V), ids[:, 2:].reshape(-1))
    return main, mtp


@torch.no_grad()
def balance_router_bias(loads: list[tuple[nn.Module, torch.Tensor]], rate: float) -> None:
    """DeepSeek's auxiliary-loss-free balancing: after a step, raise the selection bias of the
    experts a router under-used and lower that of the over-used ones (the bias only changes
    which experts are chosen, not their weights). `loads`: (router, chosen expert ids)."""
    counts: dict[nn.Module, torch.Tensor] = {}
    for router, idx in loads:
        c = torch.bincount(idx.reshape(-1), minlength=router.num_experts).float()
        counts[router] = counts[router] + c if router in counts else c
    for router, load in counts.items():
        router.e_score_correction_bias += rate * torch.sign(load.mean() - load)


# ---- export -----------------------------------------------------------------------------------

def _ds_names(hf_name: str, tensor: torch.Tensor, inter: int) -> list[tuple[str, torch.Tensor]]:
    if m := HF_GATE_UP.match(hf_name):
        layer = hf_to_ds(m.group(1))
        return [(f"{layer}.ffn.experts.w1", tensor[:, :inter]), (f"{layer}.ffn.experts.w3", tensor[:, inter:])]
    if m := HF_DOWN.match(hf_name):
        return [(f"{hf_to_ds(m.group(1))}.ffn.experts.w2", tensor)]
    return [(hf_to_ds(hf_name), tensor)]


def named_tensors(model: DemoModel):
    """(transformers-style name in the main model or `mtp.` name, tensor) of every persistent
    tensor: the main model's state dict and the MTP head's, its block named as a layer."""
    for name, t in model.main.state_dict().items():
        yield name, t
    for name, t in model.mtp.state_dict().items():
        yield "mtp." + name, t


def ds_name_map(model: DemoModel) -> dict[str, list[tuple[str, slice | None]]]:
    """transformers name -> [(DeepSeek name, slice of dim 1 or None)]."""
    inter = model.cfg.moe_intermediate_size
    out = {}
    for name, t in named_tensors(model):
        if name.startswith("mtp.layer."):
            pairs = _ds_names("model.layers.0." + name[len("mtp.layer."):], t, inter)
            pairs = [("mtp.0." + ds[len("layers.0."):], v) for ds, v in pairs]
        elif name.startswith("mtp.hc_head.hc_"):
            pairs = [("mtp.0.hc_head_" + name[len("mtp.hc_head.hc_"):], t)]
        elif name.startswith("mtp."):
            pairs = [("mtp.0." + name[len("mtp."):], t)]
        else:
            pairs = _ds_names(name, t, inter)
        out[name] = pairs
    return out


def export_state(model: DemoModel) -> dict[str, torch.Tensor]:
    """Canonical DeepSeek names (routed experts stacked [E, I, H]) -> fp32/int64 CPU tensors."""
    state = {}
    for name, pairs in ds_name_map(model).items():
        for ds, t in pairs:
            state[ds] = t.detach().cpu().clone() if t.dtype == torch.int64 else t.detach().float().cpu().clone()
    check_names(model.cfg, state)
    return state


def check_names(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """The exported names and shapes are exactly those dsv4's model (with MTP) expects."""
    from dsv4.model.deepseek_v4 import DeepseekV4
    from dsv4.model.mtp import attach_mtp
    with torch.device("meta"):
        ref = DeepseekV4(cfg)
        attach_mtp(ref)
    want = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    want.update((n, tuple(b.shape)) for n, b in ref.named_buffers() if n.endswith("tid2eid"))
    got = {n: tuple(t.shape) for n, t in state.items()}
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        bad = sorted(n for n in set(got) & set(want) if got[n] != want[n])
        raise ValueError(f"export names differ from dsv4's: missing {missing[:5]}, extra {extra[:5]}, "
                         f"shape {[(n, got[n], want[n]) for n in bad[:5]]}")


@torch.no_grad()
def round_to_shipped_precision_(model: DemoModel) -> None:
    """Round every weight the checkpoint stores in bf16 to bf16 in place (fp32 stays for hc_*,
    sinks, ape, gate bias and norms), so that evaluation sees exactly the shipped weights."""
    params = dict(model.main.named_parameters())
    params.update(("mtp." + n, p) for n, p in model.mtp.named_parameters())
    for name, pairs in ds_name_map(model).items():
        if name in params and not FP32_NAMES.search(pairs[0][0]):
            p = params[name]
            p.copy_(p.to(torch.bfloat16).float())


def count_params(model: DemoModel) -> dict[str, int]:
    main = sum(p.numel() for p in model.main.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    return {"main": main, "mtp": mtp, "total": main + mtp}



@torch.no_grad()
def load_exported(model: DemoModel, model_dir: str) -> None:
    """Fill `model` from a checkpoint written by `export_state` + `save_checkpoint` (the inverse
    of the export's name map; every tensor must be used)."""
    from dsv4.model.weights import iter_checkpoint
    found: dict[str, dict] = {}
    for name, expert, t in iter_checkpoint(model_dir):
        found.setdefault(name, {})[expert] = t
    ds = {n: (torch.stack([d[e] for e in sorted(d)]) if None not in d else d[None]) for n, d in found.items()}
    targets = dict(named_tensors(model))
    used = set()
    for hf_name, pairs in ds_name_map(model).items():
        parts = [ds[n] for n, _ in pairs]
        used.update(n for n, _ in pairs)
        value = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        targets[hf_name].copy_(value.to(targets[hf_name].dtype))
    if set(ds) != used:
        raise ValueError(f"unused tensors in {model_dir}: {sorted(set(ds) - used)[:5]}")
