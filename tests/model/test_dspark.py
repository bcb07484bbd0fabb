"""The DSpark drafter (dsv4/model/dspark.py) against a direct, unpaged transcription of the math
of docs/speculative.md "DSpark" (DeepSeek's `DSparkBlock.forward_embed` / `DSparkAttention` /
`forward_head`): window keys of the committed positions, a block [anchor, noise...] attending to
them and to itself non-causally, the Markov head left to right and the confidence head. The
model side reads its window through scattered (paged-like) SWA rows."""
from __future__ import annotations

import pytest
import torch

from dsv4.config import ConfigError, ModelConfig
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.dspark import markov_drafts, run_block, write_window
from dsv4.model.kv import LayerKV
from dsv4.model.mtp import attach_mtp
from dsv4.model.random_init import preset_config, random_state
from dsv4.ops.mhc import hc_head, hc_post, hc_pre


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = preset_config("tiny-dspark", sliding_window=8)
    m = DeepseekV4(cfg)
    attach_mtp(m)
    state = random_state(cfg, seed=7)
    for name, p in list(m.named_parameters()) + [(n, b) for n, b in m.named_buffers() if "tid2eid" in n]:
        p.data.copy_(state[name])
    return m.eval()


# ---- the reference: one request, plain tensors, no cache ----------------------------------
def _rms(x, w=None, eps=1e-6):
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return y * w.float() if w is not None else y


def _rope(x, pos, inv_freq, sign=1.0):
    """Rotate the last 2 * len(inv_freq) channels as complex pairs by sign * pos * inv_freq."""
    r = 2 * inv_freq.shape[0]
    angle = sign * pos.float()[:, None] * inv_freq.float()[None, :]          # [T, R/2]
    rot = torch.polar(torch.ones_like(angle), angle)
    if x.dim() == 3:
        rot = rot[:, None, :]
    z = torch.view_as_complex(x[..., -r:].float().contiguous().unflatten(-1, (-1, 2)))
    return torch.cat([x[..., :-r].float(), torch.view_as_real(z * rot).flatten(-2)], dim=-1)


def _attention(a, x, pos, inv_freq, window_keys):
    """Every block row attends to window_keys [K, D] and all block keys, with sinks."""
    q = _rms(x @ a.wq_a.weight.T, a.q_norm.weight) @ a.wq_b.weight.T
    q = _rope(_rms(q.unflatten(-1, (a.heads, a.head_dim))), pos, inv_freq)               # [B, heads, D]
    own = _rope(_rms(x @ a.wkv.weight.T, a.kv_norm.weight), pos, inv_freq)              # [B, D]
    keys = torch.cat([window_keys, own])                                                 # [K + B, D]
    s = torch.einsum("bhd,kd->bhk", q, keys) * a.head_dim ** -0.5
    s = torch.cat([s, a.attn_sink.float()[None, :, None].expand(s.shape[0], -1, 1)], dim=-1)
    o = torch.einsum("bhk,kd->bhd", torch.softmax(s, -1)[..., :-1], keys)
    o = _rope(o, pos, inv_freq, sign=-1.0)
    g = a.groups
    wo_a = a.wo_a.weight.float().view(g, -1, o.shape[1] * o.shape[2] // g)
    o = torch.einsum("bgi,gri->bgr", o.flatten(1).unflatten(-1, (g, -1)), wo_a).flatten(1)
    return o @ a.wo_b.weight.float().T


def reference(model, taps, anchor, n):
    """taps [t + 1, n_taps * H] of positions 0..t, anchor = x_{t+1} -> (drafts [n], base logits
    [B, V], confidence logits [n]) at temperature 0."""
    cfg, st = model.cfg, list(model.mtp)
    B, W, t = cfg.dspark_block_size, cfg.sliding_window, taps.shape[0] - 1
    inv = model.main_freq
    main_x = _rms(taps @ st[0].main_proj.weight.T, st[0].main_norm.weight)
    lo = max(0, t - W + 1)
    ctx = torch.arange(lo, t + 1)
    pos = torch.arange(t + 1, t + 1 + B)
    tokens = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (B - 1))
    h = model.embed.weight[tokens].float()[:, None, :].repeat(1, cfg.hc_mult, 1)
    c = cfg
    for s in st:
        window = _rope(_rms(main_x[lo:] @ s.attn.wkv.weight.T, s.attn.kv_norm.weight), ctx, inv)
        x, post, comb = hc_pre(h, s.hc_attn_fn, s.hc_attn_base, s.hc_attn_scale, c.rms_norm_eps, c.hc_eps,
                               c.hc_sinkhorn_iters)
        h = hc_post(_attention(s.attn, _rms(x, s.attn_norm.weight), pos, inv, window), h, post, comb)
        x, post, comb = hc_pre(h, s.hc_ffn_fn, s.hc_ffn_base, s.hc_ffn_scale, c.rms_norm_eps, c.hc_eps,
                               c.hc_sinkhorn_iters)
        h = hc_post(s.ffn(_rms(x, s.ffn_norm.weight), tokens), h, post, comb)
    last = st[-1]
    y = hc_head(h, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, c.rms_norm_eps, c.hc_eps)
    base = _rms(y, last.norm.weight) @ model.head.weight.float().T
    w1, w2 = last.markov_head.markov_w1.weight, last.markov_head.markov_w2.weight
    proj = last.confidence_head.proj.weight
    prev, drafts, conf = anchor, [], []
    for i in range(n):
        logits = base[i] + w2 @ w1[prev]
        conf.append(torch.cat([y[i], w1[prev]]) @ proj[0])
        prev = int(logits.argmax())
        drafts.append(prev)
    return drafts, base, torch.stack(conf)


# ---- the model's path: scattered SWA rows, a batch of two requests -------------------------
def test_dspark_forward_matches_reference(model):
    cfg = model.cfg
    H, nT, W, B = cfg.hidden_size, len(cfg.dspark_target_layer_ids), cfg.sliding_window, cfg.dspark_block_size
    g = torch.Generator().manual_seed(3)
    lengths, anchors = [14, 4], [17, 300]          # request 1's window is shorter than W
    taps = [torch.randn(n, nT * H, generator=g) for n in lengths]
    rows = torch.randperm(64, generator=g)[:sum(lengths)]   # each (request, position) -> its own SWA row
    kv = [LayerKV(swa=torch.randn(64, cfg.head_dim, generator=g) * 100) for _ in
          range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)]
    positions = torch.cat([torch.arange(n) for n in lengths])
    write_window(model, torch.cat(taps), positions, rows, kv)
    window = torch.full((2, W), -1, dtype=torch.long)
    first = 0
    for r, n in enumerate(lengths):
        own = rows[first:first + n][max(0, n - W):]
        window[r, :len(own)] = own
        first += n
    logits, x = run_block(model, torch.tensor(anchors), torch.tensor(lengths), window, kv)
    drafts, _, conf = markov_drafts(model, logits, x, torch.tensor(anchors), B,
                                    lambda lg, i: (lg.argmax(-1), None))
    for r in range(2):
        want_d, want_logits, want_conf = reference(model, taps[r], anchors[r], B)
        torch.testing.assert_close(logits[r], want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(conf[r], want_conf, rtol=1e-4, atol=1e-4)
        assert drafts[r].tolist() == want_d


def test_block_is_non_causal(model):
    """The anchor row's logits depend on the noise rows after it: changing the noise token
    changes row 0 (a causal block would not)."""
    cfg = model.cfg
    kv = [LayerKV(swa=torch.zeros(8, cfg.head_dim)) for _ in range(cfg.num_hidden_layers + 3)]
    window = torch.full((1, cfg.sliding_window), -1, dtype=torch.long)
    a, _ = run_block(model, torch.tensor([5]), torch.tensor([1]), window, kv)
    other = model.cfg.replace(dspark_noise_token_id=3)
    model.cfg, saved = other, model.cfg
    try:
        b, _ = run_block(model, torch.tensor([5]), torch.tensor([1]), window, kv)
    finally:
        model.cfg = saved
    assert (a[0, 0] - b[0, 0]).abs().max() > 1e-4


# ---- config -------------------------------------------------------------------------------
def _cfg(**kw):
    d = preset_config("tiny-dspark").to_released_dict()
    d.update(kw)
    return d


def test_dspark_config_round_trip_and_stage_count():
    cfg = ModelConfig.from_dict(_cfg())
    assert (cfg.dspark_block_size, cfg.dspark_noise_token_id, cfg.dspark_target_layer_ids,
            cfg.dspark_markov_rank, cfg.num_nextn_predict_layers) == (4, 511, (1, 2, 3), 16, 3)
    # the released 0731 config says num_nextn_predict_layers 1 but lists three draft stages
    assert ModelConfig.from_dict(_cfg(num_nextn_predict_layers=1)).num_nextn_predict_layers == 3


@pytest.mark.parametrize("field,value", [("dspark_block_size", 0), ("dspark_block_size", "4"),
                                         ("dspark_noise_token_id", 512), ("dspark_noise_token_id", -1),
                                         ("dspark_target_layer_ids", [1, 4]), ("dspark_target_layer_ids", []),
                                         ("dspark_target_layer_ids", [2, 2]), ("dspark_markov_rank", 0),
                                         ("dspark_markov_rank", None)])
def test_dspark_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(_cfg(**{field: value}))
    assert e.value.args[0].startswith(field) or field in str(e.value)


def test_checkpoint_names_are_the_released_ones(model):
    """The DSpark tensors under the names of the released checkpoints (docs/speculative.md)."""
    names = {n for n, _ in model.named_parameters() if n.startswith("mtp.")}
    for want in ("mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.2.hc_head_fn",
                 "mtp.2.hc_head_base", "mtp.2.hc_head_scale", "mtp.2.markov_head.markov_w1.weight",
                 "mtp.2.markov_head.markov_w2.weight", "mtp.2.confidence_head.proj.weight",
                 "mtp.1.attn.wkv.weight", "mtp.1.attn.attn_sink", "mtp.1.ffn.gate.weight", "mtp.1.hc_attn_fn"):
        assert want in names, want
    assert not any(n.startswith("mtp.1.main_proj") or n.startswith("mtp.0.markov") or ".e_proj" in n
                   or ".compressor" in n for n in names)


def test_dspark_stages_must_be_window_only():
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelConfig.from_dict(_cfg(compress_ratios=[0, 4, 128, 4, 0, 4, 0]))
