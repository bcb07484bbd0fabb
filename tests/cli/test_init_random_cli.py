"""`dsv4 init-random`: writes a loadable random checkpoint in either naming scheme, optionally
FP8 / MXFP4 as released; bad flags are refused with a message."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from dsv4.cli import main
from dsv4.config import ModelConfig
from dsv4.model.weights import checkpoint_keys, load_model


def tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_deepseek_names(tmp_path, capsys):
    out = str(tmp_path / "ds")
    assert main(["init-random", out, "--layers", "3", "--seed", "7"]) == 0
    assert "wrote" in capsys.readouterr().out
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["num_hidden_layers"] == 3 and len(cfg["compress_ratios"]) == 4    # + the MTP entry
    assert "layer_types" not in cfg and "quantization_config" not in cfg
    keys = checkpoint_keys(out)
    assert "layers.2.attn.wkv.weight" in keys and "mtp.0.e_proj.weight" in keys
    assert not any(k.startswith("model.") for k in keys)
    model = load_model(out)
    assert model.cfg.num_hidden_layers == 3 and len(model.mtp) == 1


def test_transformers_names(tmp_path):
    out = str(tmp_path / "hf")
    assert main(["init-random", out, "--names", "transformers"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert len(cfg["layer_types"]) == cfg["num_hidden_layers"] and "compress_ratios" not in cfg
    keys = checkpoint_keys(out)
    assert all(k.startswith("model.") or k == "lm_head.weight" for k in keys)
    assert len(load_model(out).mtp) == 0


def test_seed_decides_the_weights(tmp_path):
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert main(["init-random", str(tmp_path / name), "--seed", seed]) == 0
    a, b, c = (tensors(str(tmp_path / n))["embed.weight"] for n in "abc")
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_fp8_quant_writes_released_precisions(tmp_path):
    out = str(tmp_path / "fp8")
    assert main(["init-random", out, "--quant", "fp8"]) == 0
    cfg = ModelConfig.from_dir(out)
    assert cfg.quant_method == "fp8" and cfg.expert_dtype == "fp4"
    t = tensors(out)
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert t["layers.1.ffn.experts.0.w2.weight"].dtype == torch.int8
    assert t["layers.0.hc_attn_fn"].dtype == torch.float32 and t["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    load_model(out)


def test_bfloat16(tmp_path):
    out = str(tmp_path / "bf16")
    assert main(["init-random", out, "--dtype", "bfloat16"]) == 0
    t = tensors(out)
    assert t["embed.weight"].dtype == torch.bfloat16 and t["layers.0.attn.attn_sink"].dtype == torch.float32
    assert ModelConfig.from_dir(out).torch_dtype == "bfloat16"


@pytest.mark.parametrize("argv,message", [
    (["--layers", "0"], "--layers must be at least 1"),
    (["--names", "megatron"], "invalid choice: 'megatron'"),
    (["--quant", "int4"], "invalid choice: 'int4'"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
])
def test_bad_flags_are_refused(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["init-random", str(tmp_path / "x"), *argv])
    assert message in str(info.value.code) + capsys.readouterr().err
    assert not (tmp_path / "x" / "config.json").exists()


def test_fp8_with_transformers_names_is_refused_naming_the_flags(tmp_path):
    with pytest.raises(SystemExit, match="--quant fp8 .* use --names deepseek"):
        main(["init-random", str(tmp_path / "x"), "--names", "transformers", "--quant", "fp8"])
    assert not os.path.exists(tmp_path / "x" / "config.json")
