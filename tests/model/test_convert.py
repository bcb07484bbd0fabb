"""Checkpoint conversion (dsv4/model/convert.py) on random tiny checkpoints in every format:
converted then loaded gives the source's weights and logits (bit for bit where the math is
exact: E8M0-scaled FP8/MXFP4 to BF16, scale formats, names), the source files are unchanged,
round trips give back the source's tensors, conversion streams one shard at a time, and
options that do not fit are refused before anything is written."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv4.model.checkpoint_reader as checkpoint_reader
import dsv4.model.checkpoint_writer as checkpoint_writer
from dsv4.model.checkpoint_reader import checkpoint_keys, shard_files
from dsv4.model.convert import ConvertError, ConvertOptions, convert_checkpoint
from dsv4.model.draft import load_draft
from dsv4.model.weights import CheckpointError, load_model

OVERRIDES = dict(index_n_heads=16)


def digest(path: str) -> dict[str, str]:
    """relative path -> sha256 of every file under `path`."""
    return {os.path.relpath(os.path.join(root, f), path): hashlib.sha256(open(os.path.join(root, f), "rb").read()
                                                                         ).hexdigest()
            for root, _, files in os.walk(path) for f in files}


def tensors_of(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in shard_files(path):
        out.update(load_file(file))
    return out


def same_tensors(a: dict, b: dict) -> bool:
    """Same keys, dtypes and bytes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def assert_same_params(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and torch.equal(pa[name], pb[name]), name


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint):
    """The same random weights as released (FP8 + MXFP4, sharded so weights and scales
    split across shards), FP8 experts (Flash-Base style), unquantised and transformers-named."""
    return {"fp8": tiny_checkpoint(4, quant="fp8", seed=9, max_shard_bytes=64 << 10, **OVERRIDES),
            "fp32": tiny_checkpoint(4, seed=9, **OVERRIDES),
            "transformers": tiny_checkpoint(4, names="transformers", seed=9, **OVERRIDES)}


@pytest.fixture(scope="module")
def fp8_experts_ckpt(tmp_path_factory):
    from dsv4.model.random_init import preset_config, random_state, save_checkpoint

    cfg = preset_config("tiny", 4, **OVERRIDES)
    path = str(tmp_path_factory.mktemp("fp8-experts"))
    save_checkpoint(cfg, random_state(cfg, seed=9), path, quant="fp8", expert_dtype="fp8")
    return path


def convert(src: str, out, **opts) -> str:
    """convert_checkpoint with the source's files checked unchanged."""
    before = digest(src)
    convert_checkpoint(src, str(out), ConvertOptions(**opts))
    assert digest(src) == before, "the source folder changed"
    return str(out)


def logits(path: str, ids):
    from dsv4.engine.oneshot import full_logits
    return full_logits(load_model(path), ids)


@pytest.mark.parametrize("source", ["fp8", "fp8-experts"])
def test_to_bf16_gives_the_loaders_values_bit_for_bit(source, ckpts, fp8_experts_ckpt, tmp_path, ids_for):
    src = fp8_experts_ckpt if source == "fp8-experts" else ckpts["fp8"].path
    out = convert(src, tmp_path / "bf16", to="bf16")
    written = tensors_of(out)
    assert not any(t.dtype in (torch.float8_e4m3fn, torch.int8) for t in written.values())
    assert written["layers.0.ffn.experts.0.w1.weight"].dtype == torch.bfloat16
    assert written["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16 and "layers.0.attn.wq_a.scale" not in written
    assert written["layers.0.hc_attn_fn"].dtype == torch.float32          # unquantised tensors keep their dtype
    config = json.load(open(os.path.join(out, "config.json")))
    assert "quantization_config" not in config and "expert_dtype" not in config
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert_same_params(load_model(out), load_model(src))
    ids = ids_for(ckpts["fp32"].cfg, 64)
    assert torch.equal(logits(out, ids), logits(src, ids))


def test_fp8_scales_round_trip_is_bit_exact(fp8_experts_ckpt, tmp_path, ids_for):
    fp32 = convert(fp8_experts_ckpt, tmp_path / "fp32", fp8_scales="fp32")
    scales = {k: v for k, v in tensors_of(fp32).items() if k.endswith(".scale")}
    assert scales and all(v.dtype == torch.float32 for v in scales.values())
    assert json.load(open(os.path.join(fp32, "config.json")))["quantization_config"]["scale_fmt"] == "float"
    assert_same_params(load_model(fp32, keep_fp8=True), load_model(fp8_experts_ckpt, keep_fp8=True))
    back = convert(fp32, tmp_path / "e8m0", fp8_scales="e8m0")
    assert same_tensors(tensors_of(back), tensors_of(fp8_experts_ckpt))


def test_fp8_scales_leave_mxfp4_scales_e8m0(ckpts, tmp_path):
    out = tensors_of(convert(ckpts["fp8"].path, tmp_path / "fp32", fp8_scales="fp32"))
    assert out["layers.0.attn.wq_a.scale"].dtype == torch.float32
    assert out["layers.0.ffn.experts.0.w1.scale"].dtype == torch.float8_e8m0fnu
    assert same_tensors(tensors_of(convert(str(tmp_path / "fp32"), tmp_path / "back", fp8_scales="e8m0")),
                        tensors_of(ckpts["fp8"].path))


def test_fp8_scales_refuse_values_e8m0_cannot_hold(fp8_experts_ckpt, tmp_path):
    fp32 = convert(fp8_experts_ckpt, tmp_path / "fp32", fp8_scales="fp32")
    file = shard_files(fp32)[0]
    tensors = load_file(file)
    key = "layers.1.attn.wq_b.scale"
    tensors[key] = tensors[key] * 0.75
    save_file(tensors, file)
    with pytest.raises(ConvertError, match=re.escape(f"--fp8-scales e8m0: scale {key!r} in {file!r}") +
                       ".*not a power of two"):
        convert_checkpoint(fp32, str(tmp_path / "e8m0"), ConvertOptions(fp8_scales="e8m0"))
    assert not os.path.exists(tmp_path / "e8m0")
    assert not [f for f in os.listdir(tmp_path) if ".partial-" in f], "a failed conversion leaves nothing"


@pytest.mark.parametrize("source", ["fp32", "transformers"])
def test_names_round_trip(source, ckpts, tmp_path, ids_for):
    """DeepSeek -> transformers -> DeepSeek gives the source's tensors back; transformers'
    own from_pretrained loads the transformers-named output with the source's logits."""
    from transformers import DeepseekV4ForCausalLM

    src = ckpts[source].path
    hf = convert(src, tmp_path / "hf", names="transformers")
    keys = set(checkpoint_keys(hf))
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and "lm_head.weight" in keys
    assert all(k.startswith(("model.", "mtp.")) or k == "lm_head.weight" for k in keys)
    ds = convert(hf, tmp_path / "ds", names="deepseek")
    want = {k: v for k, v in tensors_of(ckpts["fp32"].path).items() if source == "fp32" or not k.startswith("mtp.")}
    assert same_tensors(tensors_of(ds), want)
    assert_same_params(load_model(ds), load_model(src))
    ids = ids_for(ckpts["fp32"].cfg, 64)
    with torch.no_grad():
        theirs = DeepseekV4ForCausalLM.from_pretrained(hf)(torch.tensor([ids]), use_cache=False).logits[0]
    ours = logits(src, ids)
    assert float((ours - theirs).abs().max()) <= 1e-4 * float(theirs.abs().max())


def test_transformers_names_need_bf16_for_a_quantised_source(ckpts, tmp_path, ids_for):
    with pytest.raises(ConvertError, match="--names transformers: .*add --to bf16"):
        convert_checkpoint(ckpts["fp8"].path, str(tmp_path / "hf"), ConvertOptions(names="transformers"))
    assert not os.path.exists(tmp_path / "hf")
    out = convert(ckpts["fp8"].path, tmp_path / "hf-bf16", names="transformers", to="bf16")
    assert_same_params(load_model(out), load_model(ckpts["fp8"].path))


def test_extract_mtp_writes_a_draft_the_main_model_loads(ckpts, tmp_path):
    src = ckpts["fp8"].path
    draft = convert(src, tmp_path / "draft", part="draft")
    keys = set(checkpoint_keys(draft))
    assert {k for k in keys if not k.startswith("mtp.")} == {"embed.weight", "head.weight"}
    assert {k for k in checkpoint_keys(src) if k.startswith("mtp.")} == {k for k in keys if k.startswith("mtp.")}
    main = convert(src, tmp_path / "main", part="main")
    assert not any(k.startswith("mtp.") for k in checkpoint_keys(main))
    assert json.load(open(os.path.join(main, "config.json")))["num_nextn_predict_layers"] == 0
    full, model = load_model(src), load_model(main)
    assert len(model.mtp) == 0
    load_draft(model, draft)
    assert_same_params(model, full)


def test_draft_from_another_checkpoint_is_refused(ckpts, tiny_checkpoint, tmp_path):
    other = tiny_checkpoint(4, seed=10, **OVERRIDES)
    draft = convert(other.path, tmp_path / "draft", part="draft")
    with pytest.raises(CheckpointError, match="tensor 'embed.weight' .* differs from the model's"):
        load_draft(load_model(ckpts["fp32"].path), draft)


def test_dspark_weights_are_named_then_split_off(ckpts, tmp_path):
    """Draft weights the MTP block does not have (a DSpark module's) fail the load with the
    conversion to run; --drop-mtp loads, --extract-mtp keeps them."""
    tensors = tensors_of(ckpts["fp32"].path)
    tensors["mtp.0.markov_head.weight"] = torch.zeros(8, 64)
    src = str(tmp_path / "dspark")
    os.makedirs(src)
    shutil.copy(os.path.join(ckpts["fp32"].path, "config.json"), src)
    save_file(tensors, os.path.join(src, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mtp.0.markov_head.weight' in '.*model.safetensors'"
                                              r".*dsv4 convert SRC OUT --drop-mtp"):
        load_model(src)
    main = convert(src, tmp_path / "main", part="main")
    assert_same_params(load_model(main), load_model(convert(ckpts["fp32"].path, tmp_path / "ref", part="main")))
    assert "mtp.0.markov_head.weight" in checkpoint_keys(convert(src, tmp_path / "draft", part="draft"))


def test_conversion_streams_shard_by_shard(ckpts, tmp_path, monkeypatch):
    """Each output shard is written before the next source shard is opened, one source file
    is open at a time, and a weight whose scale sits in the next shard waits for it."""
    events, real_open, real_save = [], checkpoint_reader.safe_open, checkpoint_writer.save_file

    @contextmanager
    def logged_open(file, *args, **kwargs):
        events.append(("open", file))
        with real_open(file, *args, **kwargs) as f:
            yield f
        events.append(("close", file))

    def logged_save(tensors, *args, **kwargs):
        events.append(("write", len(tensors)))
        return real_save(tensors, *args, **kwargs)

    monkeypatch.setattr(checkpoint_reader, "safe_open", logged_open)
    monkeypatch.setattr(checkpoint_writer, "save_file", logged_save)
    src = ckpts["fp8"].path
    files = shard_files(src)
    assert len(files) > 4
    convert_checkpoint(src, str(tmp_path / "bf16"), ConvertOptions(to="bf16"))
    reads = [e for e in events if e[0] != "write"]
    assert reads == [(kind, f) for f in files for kind in ("open", "close")]
    writes = [i for i, e in enumerate(events) if e[0] == "write"]
    assert all(events[i - 1][0] == "close" for i in writes), "output is written when a source shard ends"
    assert len(writes) > len(files) // 2, "most source shards give their own output shard"
    assert sum(events[i][1] for i in writes) == len(checkpoint_keys(str(tmp_path / "bf16")))


@pytest.mark.parametrize("opts,message", [
    (dict(to="bf16", fp8_scales="e8m0"), "--fp8-scales: no FP8 scales remain with --to bf16"),
    (dict(part="draft"), "--extract-mtp: "),
    (dict(fp8_scales="fp32"), "--fp8-scales fp32: "),
])
def test_options_that_do_not_fit_are_refused(opts, message, ckpts, tmp_path):
    src = ckpts["transformers"].path               # no MTP, no FP8
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert_checkpoint(src, str(tmp_path / "out"), ConvertOptions(**opts))
    assert os.listdir(tmp_path) == []


def test_output_must_be_new_and_outside_the_source(ckpts, tmp_path):
    src = ckpts["fp32"].path
    for out in (src, os.path.join(src, "sub")):
        with pytest.raises(ValueError, match="the source is never modified"):
            convert_checkpoint(src, out, ConvertOptions())
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        convert_checkpoint(src, str(tmp_path / "busy"), ConvertOptions())
    (tmp_path / "empty").mkdir()
    convert(src, tmp_path / "empty")
    assert same_tensors(tensors_of(str(tmp_path / "empty")), tensors_of(src))


def test_other_files_are_copied(ckpts, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(ckpts["fp32"].path, src)
    (tmp_path / "src" / "tokenizer.json").write_text('{"x": 1}')
    (tmp_path / "src" / "encoding").mkdir()
    (tmp_path / "src" / "encoding" / "encoding_dsv4.py").write_text("REASONING_EFFORT_MAX = 1\n")
    out = convert(src, tmp_path / "out", to="bf16")
    assert open(os.path.join(out, "tokenizer.json")).read() == '{"x": 1}'
    assert os.path.isfile(os.path.join(out, "encoding", "encoding_dsv4.py"))
