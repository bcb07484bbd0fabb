"""Random models in the released format (dsv4/model/random_released.py, `build_random_model(...,
released=True, shard=...)`), the path of `random:flash` / `random:pro`: tensors drawn in place
in their kept format; the same values dequantised without the keep flags (same logits);
any shard equals the same slice of the whole model; the full-size layouts."""
import torch

from dsv4.engine.oneshot import full_logits
from dsv4.model.random_model import ExpertShard, Shard, build_random_model
from dsv4.ops.quant import dequant_kept, weight_format

SPEC = "random:tiny:2"


def _kept_and_plain(**keep):
    kept = build_random_model(SPEC, released=True, **keep)
    plain = build_random_model(SPEC, released=True)
    return kept, plain


def _params(model):
    return dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if "tid2eid" in n}


def _assert_holds_dequantised(kept, plain):
    """Every kept weight dequantises to exactly the plain model's value; the rest are equal."""
    kp, pp = _params(kept), _params(plain)
    n_quant = 0
    for name, want in pp.items():
        got = kp[name]
        if weight_format(got) is not None:
            scale = kp[name[:-len(".weight")] + ".scale" if name.endswith(".weight") else name + "_scale"]
            got = dequant_kept(got, scale) if got.dim() == 2 or weight_format(got) == "mxfp4" else \
                torch.stack([dequant_kept(w, s) for w, s in zip(got, scale)])
            n_quant += 1
        assert torch.equal(got.to(want.dtype), want), name
    return n_quant


def test_released_kept_formats_equal_dequantised_values_and_logits():
    kept, plain = _kept_and_plain(keep_fp8_dense=True, keep_mxfp4=True)
    assert len(kept.mtp) == len(plain.mtp) == 1                        # the MTP block too
    attn, experts = kept.layers[1].attn, kept.layers[1].ffn.experts
    assert attn.wq_b.weight.dtype == attn.wo_a.weight.dtype == kept.mtp[0].e_proj.weight.dtype == torch.float8_e4m3fn
    assert experts.w1.dtype == torch.uint8 and experts.w1_scale.dtype == torch.uint8
    assert kept.layers[1].ffn.shared_experts.w1.weight.dtype == torch.float32     # with MXFP4: unquantised
    assert attn.compressor.wkv.weight.dtype == torch.float32                       # BF16 in the release
    # 2 layers + MTP x (wq_a..wo_b, w1..w3), the CSA layer's indexer wq_b, e_proj, h_proj
    assert _assert_holds_dequantised(kept, plain) == 3 * (5 + 3) + 1 + 2
    ids = list(range(3, 45))
    want, got = full_logits(plain, ids), full_logits(kept, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_released_fp8_experts_equal_dequantised_values():
    kept, plain = _kept_and_plain(keep_fp8=True)
    e, s = kept.layers[0].ffn.experts, kept.layers[0].ffn.shared_experts
    assert e.w2.dtype == s.w2.weight.dtype == torch.float8_e4m3fn and kept.layers[0].attn.wq_a.weight.dtype == torch.float32
    _assert_holds_dequantised(kept, plain)


def test_same_seed_same_weights_other_seed_differs():
    a, b = build_random_model(SPEC, released=True), build_random_model(SPEC, released=True)
    c = build_random_model(SPEC, released=True, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(_params(a).values(), _params(b).values()))
    assert not torch.equal(a.layers[0].attn.wq_a.weight, c.layers[0].attn.wq_a.weight)


class _CutShard(Shard):
    """Rows and columns cut inside tensors: wq_b rows [128, 256), hc_attn_fn columns [100, 200)."""

    def index(self, name, shape):
        full = super().index(name, shape)
        if name.endswith("attn.wq_b.weight") and "indexer" not in name:
            return (slice(128, 256), full[1])
        if name.endswith("hc_attn_fn"):
            return (full[0], slice(100, 200))
        return full


def test_any_shard_is_the_slice_of_the_whole():
    whole = _params(build_random_model(SPEC, released=True, keep_fp8_dense=True, keep_mxfp4=True))
    E = whole["layers.0.ffn.experts.w1"].shape[0]
    for rank in range(2):
        part = _params(build_random_model(SPEC, keep_fp8_dense=True, keep_mxfp4=True, shard=ExpertShard(rank, 2)))
        for name, t in part.items():
            if ".ffn.experts.w" in name:
                assert t.shape[0] == E // 2 and torch.equal(t, whole[name][rank * E // 2:(rank + 1) * E // 2]), name
            else:
                assert torch.equal(t, whole[name]), name
    cut = _params(build_random_model(SPEC, keep_fp8_dense=True, shard=_CutShard()))
    name = "layers.1.attn.wq_b.weight"
    assert torch.equal(cut[name].view(torch.uint8), whole[name][128:256].view(torch.uint8))
    assert cut["layers.1.attn.wq_b.scale"].shape == (1, 1)
    assert torch.equal(cut["layers.0.hc_attn_fn"], whole["layers.0.hc_attn_fn"][:, 100:200])


def test_full_size_presets_lay_out_the_released_models():
    """random:flash / random:pro on the meta device (shapes only): every layer and the MTP block,
    FP8 projections and MXFP4 experts; V4-Flash about 160 GB so, V4-Pro about 0.9 TB."""
    sizes = {}
    for preset, layers in (("flash", 43), ("pro", 61)):
        m = build_random_model(f"random:{preset}", "meta", torch.bfloat16, keep_fp8=True, keep_fp8_dense=True,
                               keep_mxfp4=True)
        assert len(m.layers) == layers and len(m.mtp) == 1
        assert m.layers[5].attn.wo_b.weight.dtype == torch.float8_e4m3fn and m.mtp[0].ffn.experts.w1.dtype == torch.uint8
        sizes[preset] = sum(t.numel() * t.element_size() for t in _params(m).values()) / 1e9
    assert 150 < sizes["flash"] < 175 and 800 < sizes["pro"] < 1000, sizes
