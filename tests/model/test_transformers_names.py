"""Every naming transformers produces for V4 loads: its module names (with and without the
`model.` prefix), what the installed transformers' `save_pretrained` writes (its reverse
renames: `model.layers.N.attn.norm.weight` for the KV norm, `head.weight`, per-expert
`ffn.experts.E.w1.weight`), sharded or not, fp32 or bf16. Checked two ways: names against
transformers' own key renaming (`rename_source_key` with the model's conversion mapping), and
logits of the loaded checkpoint against the transformers model that saved it."""
from __future__ import annotations

import copy

import pytest
import torch

from dsv4.model.checkpoint_reader import checkpoint_keys, model_tensors, read_checkpoint, shard_files
from dsv4.model.names import canonical_name, transformers_load_name, transformers_name
from dsv4.model.weights import load_model

TOLERANCE = 1e-4  # max |Δlogit| relative to max |reference logit|, fp32 (as tests/model/test_oracle.py)

OVERRIDES = dict(index_n_heads=16)


@pytest.fixture(scope="module")
def source(tiny_checkpoint):
    """DeepSeek-named random checkpoint: sliding, CSA and HCA layers, a hash layer, MTP."""
    return tiny_checkpoint(4, seed=11, **OVERRIDES)


@pytest.fixture(scope="module")
def hf_model(source):
    """transformers' DeepseekV4ForCausalLM holding the source's weights, built (not
    from_pretrained): `save_pretrained` applies every reverse rename."""
    from dsv4.model.reference import load_reference
    return load_reference(source.path)


@pytest.fixture(scope="module")
def saved(hf_model, tmp_path_factory):
    """Folders written by transformers' save_pretrained, by how the model came to be."""
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("saved")
    out = {"built": root / "built", "sharded-bf16": root / "sharded-bf16", "base": root / "base"}
    hf_model.save_pretrained(out["built"])
    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(out["sharded-bf16"], max_shard_size="200KB")
    hf_model.model.save_pretrained(out["base"])        # DeepseekV4Model: no `model.` prefix, no head
    out["reloaded"] = root / "reloaded"
    DeepseekV4ForCausalLM.from_pretrained(out["built"]).save_pretrained(out["reloaded"])
    return {k: str(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def module_named(tiny_checkpoint, tmp_path_factory):
    """A mix, as written by loading a module-named checkpoint with from_pretrained and saving
    it: module names, except that the `\\.norm\\.` -> `.kv_norm.` rename matched
    `model.norm.weight` at load (then kept as written), so its reverse turns every
    `kv_norm` into `norm` on save."""
    from transformers import DeepseekV4ForCausalLM

    hf = tiny_checkpoint(4, names="transformers", seed=11, **OVERRIDES)
    out = str(tmp_path_factory.mktemp("module-named"))
    DeepseekV4ForCausalLM.from_pretrained(hf.path).save_pretrained(out)
    return out


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def test_save_pretrained_writes_the_reverse_renamed_names(saved, module_named, source):
    built = set(checkpoint_keys(saved["built"]))
    assert {"head.weight", "model.layers.0.attn.norm.weight", "model.layers.1.ffn.experts.3.w1.weight",
            "model.embed_tokens.weight", "model.hc_head.hc_fn"} <= built
    assert not any("self_attn" in k or "gate_up_proj" in k for k in built)
    assert set(checkpoint_keys(saved["reloaded"])) == built
    assert set(checkpoint_keys(saved["sharded-bf16"])) == built and len(shard_files(saved["sharded-bf16"])) > 1
    base = set(checkpoint_keys(saved["base"]))
    assert "layers.0.attn.norm.weight" in base and "embed.weight" in base and "hc_head_fn" in base
    assert not any(k.startswith("model.") for k in base)
    deepseek = {k for k in checkpoint_keys(source.path) if not k.startswith("mtp.")}
    assert {canonical_name(k) for k in base} == deepseek - {"head.weight"}
    module = set(checkpoint_keys(module_named))
    assert {"model.layers.0.self_attn.norm.weight", "model.layers.1.self_attn.compressor.indexer.norm.weight",
            "lm_head.weight", "model.layers.1.mlp.experts.gate_up_proj"} <= module


@pytest.mark.parametrize("variant", ["built", "reloaded", "sharded-bf16"])
def test_save_pretrained_output_loads_with_the_savers_logits(variant, saved, hf_model, source, ids_for):
    """dsv4 on what transformers saved == the transformers model that saved it (fp32 oracle
    tolerance), and the weights are the source's bit for bit (bf16: the source's rounded)."""
    ours = load_model(saved[variant])
    ref = load_model(source.path)
    ref_params = dict(ref.named_parameters())
    stored = {item.name: item.tensor.dtype for item in read_checkpoint(saved[variant])}
    assert (torch.bfloat16 in stored.values()) == (variant == "sharded-bf16")
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name].to(stored[name]).to(p.dtype)), name
    assert len(ours.mtp) == 0
    if variant == "sharded-bf16":
        return
    ids = ids_for(source.cfg, 300)
    from dsv4.engine.oneshot import full_logits
    got, want = full_logits(ours, ids), hf_logits(hf_model, ids)
    assert float((got - want).abs().max()) <= TOLERANCE * float(want.abs().max())


def test_module_names_load_with_the_same_weights(module_named, source):
    ours, ref = load_model(module_named), load_model(source.path)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name]), name


def test_names_without_the_model_prefix_load(saved, source, tmp_path):
    """A bare DeepseekV4Model's save (no `model.`, no head) plus the head: what `model.`-less
    checkpoints look like."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in shard_files(saved["base"]):
        tensors.update(load_file(file))
    assert "layers.0.attn.norm.weight" in tensors and not any(k.startswith("model.") for k in tensors)
    tensors["head.weight"] = load_file(f"{saved['built']}/model.safetensors")["head.weight"]
    (tmp_path / "config.json").write_text(open(f"{saved['base']}/config.json").read())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ours, ref = load_model(str(tmp_path)), load_model(source.path)
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, ref_params[name]), name


# ---- names against transformers' own renaming -------------------------------------------
@pytest.fixture(scope="module")
def transformers_renamer(source):
    """key -> the parameter name transformers loads it into (None: it ignores the key)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**source.cfg.to_transformers_dict()))
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = model.state_dict()

    def rename(key):
        renamed, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
        if renamed not in meta and key in meta:             # transformers' fallback: the key as written
            renamed = key
        return renamed if renamed in meta else None

    rename.module_names = list(meta)
    return rename


def ours(key: str) -> str:
    """The transformers parameter dsv4 reads `key` into (stacked experts: the stack's name)."""
    param = next(model_tensors(canonical_name(key), torch.empty(2, 2, 2)))[0]
    return transformers_name(param)


def all_namings(source, saved, module_names):
    return {"deepseek": [k for k in checkpoint_keys(source.path) if not k.startswith("mtp.")],
            "module": module_names,
            "module-no-prefix": [k.removeprefix("model.") for k in module_names],
            "saved": checkpoint_keys(saved["built"]),
            "saved-no-prefix": checkpoint_keys(saved["base"])}


def test_every_naming_reads_as_transformers_reads_it(transformers_renamer, source, saved):
    checked = 0
    for naming, keys in all_namings(source, saved, transformers_renamer.module_names).items():
        for key in keys:
            want = transformers_renamer(key)
            assert want is not None, f"{naming}: transformers does not load {key!r}"
            assert ours(key) == want, f"{naming}: {key!r} -> {ours(key)!r}, transformers: {want!r}"
            checked += 1
    assert checked > 5 * len(transformers_renamer.module_names)


def test_renames_only_move_model_norm_off_a_module_name(transformers_renamer):
    """The fallback dsv4 transcribes (`_KEPT_MODULE_NAMES`) is the only one transformers needs."""
    from dsv4.model import names

    moved = []
    for key in transformers_renamer.module_names:
        renamed = key
        for pattern, repl in names._TRANSFORMERS_RENAMES:
            renamed = pattern.sub(repl, renamed, count=1)
        if renamed != key:
            moved.append(key)
    assert moved == sorted(names._KEPT_MODULE_NAMES)
    assert all(transformers_load_name(k) == k for k in transformers_renamer.module_names)


def test_canonical_names_are_fixed_points(source):
    """DeepSeek's names (MTP included) read as themselves."""
    for key in checkpoint_keys(source.path):
        assert canonical_name(key) == key
