"""Checkpoint names: DeepSeek's released names and transformers' names load the same weights
(identical logits), the name maps are inverse, and the MTP block (`mtp.0.*`, DeepSeek names
only) loads."""
from __future__ import annotations

import pytest
import torch

from dsv4.model.names import ds_to_hf, hf_to_ds
from dsv4.model.weights import checkpoint_keys, load_model

OVERRIDES = dict(index_n_heads=16)


@pytest.fixture(scope="module")
def both(tiny_checkpoint):
    """The same random weights under both naming schemes."""
    return (tiny_checkpoint(4, names="deepseek", seed=3, **OVERRIDES),
            tiny_checkpoint(4, names="transformers", seed=3, **OVERRIDES))


def test_checkpoints_really_use_each_scheme(both):
    ds, hf = both
    ds_keys, hf_keys = checkpoint_keys(ds.path), checkpoint_keys(hf.path)
    assert "layers.1.attn.indexer.wq_b.weight" in ds_keys and "layers.0.ffn.experts.7.w2.weight" in ds_keys
    assert "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight" in hf_keys
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf_keys
    assert all(k.startswith("model.") or k == "lm_head.weight" for k in hf_keys)
    assert not any(k.startswith("model.") for k in ds_keys)


def test_both_schemes_give_identical_weights_and_logits(both, our_logits, ids_for):
    ds, hf = both
    ds_model, hf_model = load_model(ds.path), load_model(hf.path)
    hf_params = dict(hf_model.named_parameters())
    for name, p in ds_model.named_parameters():
        if not name.startswith("mtp."):
            assert torch.equal(p, hf_params[name]), name
    ids = ids_for(ds.cfg, 300)
    assert torch.equal(our_logits(ds.path, ids), our_logits(hf.path, ids))


def test_reference_identical_from_both_schemes(both, reference_logits, ids_for):
    """transformers' own loader (transformers names) and dsv4's conversion (DeepSeek names)."""
    ds, hf = both
    ids = ids_for(ds.cfg, 200)
    assert torch.equal(reference_logits(ds.path, ids), reference_logits(hf.path, ids))


def test_transformers_checkpoint_fills_every_reference_tensor(both):
    """from_pretrained only warns about missing tensors; make sure there are none."""
    from dsv4.model.reference import load_reference

    _, hf = both
    assert set(checkpoint_keys(hf.path)) == set(load_reference(hf.path).state_dict())


def test_name_maps_are_inverse_and_injective(both):
    ds, _ = both
    names = [k for k in checkpoint_keys(ds.path) if not k.startswith("mtp.")]
    hf_names = [ds_to_hf(k) for k in names]
    assert len(set(hf_names)) == len(names)
    assert [hf_to_ds(k) for k in hf_names] == names
    with pytest.raises(KeyError, match="mtp.0.e_proj.weight"):
        ds_to_hf("mtp.0.e_proj.weight")


def test_mtp_weights_load(both):
    ds, hf = both
    model = load_model(ds.path)
    assert len(model.mtp) == ds.cfg.num_nextn_predict_layers == 1
    mtp = dict(model.mtp.named_parameters(prefix="mtp"))
    written = {k: v for k, v in ds.state.items() if k.startswith("mtp.0.")}
    assert set(mtp) == set(written)
    for name in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.experts.w2"):
        assert name in written
    for name, value in written.items():
        assert torch.equal(mtp[name], value), name
    assert len(load_model(hf.path).mtp) == 0  # transformers' names carry no MTP block

