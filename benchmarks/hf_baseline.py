"""transformers' DeepseekV4ForCausalLM (eager, bf16) on the weights of a dsv4 model, for the
GPU suite's baseline. The dsv4 model's tensors are handed over (not copied); only the
experts' gate_up concatenation allocates, one layer at a time, so both never coexist."""
from __future__ import annotations

import time

import torch


@torch.no_grad()
def to_transformers(model):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from dsv4.model.names import ds_to_hf
    cfg = model.cfg
    device = next(model.parameters()).device
    state = {}
    for i, block in enumerate(model.layers):
        e = block.ffn.experts
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([e.w1, e.w3], dim=1)
        state[f"model.layers.{i}.mlp.experts.down_proj"] = e.w2
        del e.w1, e.w3, e.w2
    for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "tid2eid" in n]:
        state[ds_to_hf(name)] = t
    hf_cfg = DeepseekV4Config(**cfg.to_transformers_dict())
    with torch.device("meta"):
        hf = DeepseekV4ForCausalLM(hf_cfg)
    hf.load_state_dict(state, strict=True, assign=True)
    for parent in list(hf.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DeepseekV4RotaryEmbedding):
                setattr(parent, name, DeepseekV4RotaryEmbedding(hf_cfg, device=device))
    return hf.eval()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def time_prefill(hf, batch: int, length: int, vocab: int) -> tuple[float, object]:
    ids = torch.randint(100, vocab, (batch, length), device=next(hf.parameters()).device)
    _sync()
    t = time.perf_counter()
    out = hf(ids, use_cache=True, logits_to_keep=1)
    _sync()
    return time.perf_counter() - t, out


@torch.no_grad()
def time_decode(hf, batch: int, context: int, vocab: int, steps: int = 6) -> float:
    _, out = time_prefill(hf, batch, context, vocab)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        _sync()
        t = time.perf_counter()
        out = hf(nxt, cache=cache, use_cache=True, logits_to_keep=1)
        _sync()
        times.append(time.perf_counter() - t)
        nxt = out.logits[:, -1:].argmax(-1)
    times.sort()
    return times[len(times) // 2]
