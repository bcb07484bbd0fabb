"""IndexCache in the model: producer ("F") CSA layers compute the indexer top-k, the shared
("S") layers after them reuse it at their own rows and skip their indexer (docs/architecture.md,
"Model"). Checked against two references built independently of that path:

* on the torch ops: the model without IndexCache (same weights) with every S layer's selection
  replaced by its producer's (`replace_shared_selections`);
* the oracle: transformers' DeepseekV4ForCausalLM patched the same way (each S layer's indexer
  returns its producer's indices), on the oracle's config with 4 CSA layers.

freq 1 is the model without IndexCache, bit for bit.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import dsv4.model.compressor as compressor_module
import dsv4.ops.indexer as indexer_ops
import dsv4.model.attention as attention_module
from dsv4.engine.oneshot import OneSequence, full_logits
from dsv4.model.weights import load_model
from dsv4.ops.paged import dense_index

from test_oracle import CONFIGS, assert_matches

OVERRIDES, LENGTH = CONFIGS["csa-hca-w32-hc4-e8k2"]
LAYERS = 8                      # compress_ratios 0, 4, 128, 4, 0, 4, 128, 4: four CSA layers
PATTERNS = {1: "FFFF", 2: "FSFS", 4: "FSSS"}
TIGHT = 1e-5                    # same ops, another fused-GEMM width: rounding only


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(LAYERS, seed=1, **OVERRIDES)


@pytest.fixture(scope="module")
def ids(ckpt, ids_for):
    return ids_for(ckpt.cfg, LENGTH)


@contextmanager
def replace_shared_selections(pattern: str):
    """While inside: the model's indexer_topk, called once per CSA layer in layer order per
    forward, returns for an S layer the rows its producer (the last F layer) chose. All CSA
    layers address their C4 entries through the same rows, so that is the producer's choice of
    entries at the S layer's own rows."""
    inner, calls = compressor_module.indexer_topk, []

    def patched(q, weights, keys, cand, topk, weight_scale=1.0):
        rows = inner(q, weights, keys, cand, topk, weight_scale)
        if pattern[len(calls) % len(pattern)] == "S":
            rows = next(r for r, role in reversed(calls) if role == "F")
        calls.append((rows, pattern[len(calls) % len(pattern)]))
        return rows

    compressor_module.indexer_topk = patched
    try:
        yield calls
    finally:
        compressor_module.indexer_topk = inner


@contextmanager
def boundary_gaps():
    """Every selection's score gap between the k-th and (k+1)-th candidate (inf where at most k
    are causal): the comparisons are well posed only without ties there."""
    inner, gaps = indexer_ops._topk, []

    def spy(q, weights, keys, cand, topk, weight_scale):
        dense = dense_index(cand)
        k = min(topk, dense.shape[1])
        scores = torch.relu(torch.einsum("thd,ted->the", q.float(), keys[dense.clamp(min=0)].float()))
        scores = (scores * q.shape[-1] ** -0.5 * (weights.float() * weight_scale)[..., None]).sum(dim=1)
        scores = scores.masked_fill(dense < 0, float("-inf"))
        if scores.shape[1] > k:
            top = scores.topk(k + 1, dim=-1).values
            gap = top[:, k - 1] - top[:, k]
            gaps.append(float(gap[torch.isfinite(top[:, k])].min()))
        return inner(q, weights, keys, cand, topk, weight_scale)

    indexer_ops._topk = spy
    try:
        yield gaps
    finally:
        indexer_ops._topk = inner


def model_at(ckpt, freq):
    return load_model(ckpt.path, overrides={"index_topk_freq": freq})


def test_freq_1_is_the_model_without_index_cache(ckpt, ids, monkeypatch):
    """Bit for bit, and through the very same calls: no offsets handed over, no translation."""
    plain = load_model(ckpt.path)
    want = full_logits(plain, ids)
    for overrides in ({"index_topk_freq": 1}, {"index_topk_freq": None}, {"index_topk_pattern": "FFFF"}):
        model = load_model(ckpt.path, overrides=overrides)
        assert model.cfg == plain.cfg
        monkeypatch.setattr(attention_module, "translate_topk", None)
        monkeypatch.setattr(compressor_module, "indexer_topk_offsets", None)
        assert torch.equal(full_logits(model, ids), want)
        monkeypatch.undo()


@pytest.mark.parametrize("freq", [2, 4])
def test_shared_layers_reuse_the_producers_selection(ckpt, ids, freq):
    """The IndexCache model equals the model without it whose S layers' selections are
    replaced by their producers', and differs from it without the replacement far beyond that."""
    model = model_at(ckpt, freq)
    assert model.cfg.index_topk_pattern == PATTERNS[freq]
    with boundary_gaps() as gaps:
        got = full_logits(model, ids)
    assert len(gaps) == PATTERNS[freq].count("F") and min(gaps) > 0, "ties at a producer's top-k boundary"
    plain = load_model(ckpt.path)
    with replace_shared_selections(PATTERNS[freq]) as calls:
        want = full_logits(plain, ids)
    assert len(calls) == 4
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= TIGHT * scale
    assert float((full_logits(plain, ids) - want).abs().max()) > 100 * TIGHT * scale


@pytest.mark.parametrize("freq", [2, 4])
def test_shared_layers_skip_their_indexer(ckpt, ids, freq, monkeypatch):
    """An S layer runs no indexer: no projection, compressor, scores or top-k of its own (its
    indexer-key cache stays untouched), one translation of its producer's offsets instead."""
    model = model_at(ckpt, freq)
    pattern = PATTERNS[freq]
    csa = [b.attn for b in model.layers if b.attn.indexer is not None]
    assert [a.index_role for a in csa] == list(pattern)
    topk_calls, translations = [], []
    for name in ("indexer_topk", "indexer_topk_offsets"):
        inner = getattr(compressor_module, name)
        monkeypatch.setattr(compressor_module, name,
                            lambda *a, _inner=inner, _name=name: topk_calls.append(_name) or _inner(*a))
    translate = attention_module.translate_topk
    monkeypatch.setattr(attention_module, "translate_topk", lambda *a: translations.append(1) or translate(*a))
    one = OneSequence(model, len(ids))
    fb = one.batch(ids)
    model(fb, one.storage.layers)
    assert sorted(topk_calls) == sorted(["indexer_topk_offsets"] * pattern.count("FS") +
                                        ["indexer_topk"] * (pattern.count("F") - pattern.count("FS")))
    assert len(translations) == pattern.count("S")
    kinds = one.storage.kinds                             # [units, CSA layers, rows, C]
    for i, attn in enumerate(csa):
        written = [bool(kinds[kind][:, i].abs().sum() > 0) for kind in ("idx", "iring_kv", "c4", "ring_kv")]
        role = attn.index_role
        assert written == [role == "F", role == "F", True, True], f"layer {attn.layer}: {written}"
        linears = attn._input_linears()
        assert (attn.indexer.weights_proj in linears) == (attn.index_role == "F")


def test_a_shared_layer_needs_its_producer(ckpt, ids):
    model = model_at(ckpt, 2)
    one = OneSequence(model, 16)
    fb = one.batch(ids[:16])
    shared = next(b for b in model.layers if b.attn.index_role == "S")
    h = torch.zeros(16, model.cfg.hc_mult, model.cfg.hidden_size)
    from dsv4.model.attention import RopeTables
    with pytest.raises(RuntimeError, match="needs its producer's top-k"):
        shared(h, fb, one.storage.layers[shared.attn.layer], RopeTables(fb, model.main_freq, model.compress_freq))


# ---- the oracle, patched the same way ----------------------------------------------------
@contextmanager
def transformers_with_shared_indices(reference, pattern: str):
    """Each S layer's indexer of transformers' model returns the indices its producer returned
    in the same forward (they are logical C4 entries there: no page table)."""
    indexers = [layer.self_attn.compressor.indexer for layer in reference.model.layers
                if layer.self_attn.layer_type == "compressed_sparse_attention"]
    assert len(indexers) == len(pattern)
    last, originals = {}, []
    for role, indexer in zip(pattern, indexers):
        inner = indexer.forward
        originals.append((indexer, inner))

        def forward(*args, _inner=inner, _role=role, **kw):
            out = _inner(*args, **kw)
            if _role == "F":
                last["indices"] = out
                return out
            return last["indices"]
        indexer.forward = forward
    try:
        yield
    finally:
        for indexer, _ in originals:
            del indexer.forward


@pytest.mark.parametrize("freq", [2, 4])
def test_index_cache_matches_transformers_patched_the_same_way(ckpt, ids, freq):
    from dsv4.model.reference import load_reference
    got = full_logits(model_at(ckpt, freq), ids)
    reference = load_reference(ckpt.path)
    with torch.no_grad():
        with transformers_with_shared_indices(reference, PATTERNS[freq]):
            want = reference(torch.tensor([ids]), use_cache=False).logits[0].float()
        unpatched = reference(torch.tensor([ids]), use_cache=False).logits[0].float()
    assert_matches(got, want)
    assert float((unpatched - want).abs().max()) > 100 * 1e-4 * float(want.abs().max())


def test_mtp_block_is_untouched(ckpt, ids):
    """V4's MTP block is sliding-window only (the cache keeps only SWA keys for it): IndexCache
    leaves it alone, so given the same main-model streams it drafts the same at every freq. (A
    CSA MTP layer would be its own producer, `ModelConfig.index_topk_role`: its forward has no
    CSA layer before it.)"""
    drafts = []
    for freq in (1, 4):
        model = model_at(ckpt, freq)
        mtp = model.mtp[0]
        assert mtp.attn.index_role == "" and not mtp.attn.feeds_shared
        one = OneSequence(model, len(ids), with_mtp=True)
        fb = one.batch(ids)
        h = torch.randn(len(ids), model.cfg.hc_mult, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            drafts.append(mtp.logits(model, mtp.draft(model, h, fb, one.storage.layers)))
    assert torch.equal(drafts[0], drafts[1])


def test_switching_a_built_model(ckpt, ids):
    """set_index_topk_pattern gives the model loaded with that setting, bit for bit, and back."""
    from dsv4.config import ConfigError
    model = load_model(ckpt.path)
    plain = full_logits(model, ids)
    model.set_index_topk_pattern("FSSS")
    assert model.cfg == model_at(ckpt, 4).cfg
    assert torch.equal(full_logits(model, ids), full_logits(model_at(ckpt, 4), ids))
    model.set_index_topk_pattern("")
    assert torch.equal(full_logits(model, ids), plain)
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        model.set_index_topk_pattern("SFFF")
