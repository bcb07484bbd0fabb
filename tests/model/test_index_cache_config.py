"""IndexCache settings: config.json's index_topk_freq / index_topk_pattern, the engine's
overrides (--index-topk-freq, --index-topk-pattern, --hf-overrides) and the errors naming the
field or flag (docs/architecture.md, "Model"). Cases after SGLang's DeepSeek-V4 IndexCache port
(seed 004: positive-integer freq, null -> 1, floats and booleans rejected, first CSA layer F)."""
from __future__ import annotations

import argparse
import json

import pytest

from dsv4.config import ConfigError, EngineConfig, ModelConfig
from dsv4.model.random_init import preset_config

# 8 main layers, 4 of them CSA (layers 1, 3, 5, 7)
BASE = preset_config("tiny", layers=8)


def released(**kw) -> dict:
    return {**BASE.to_released_dict(), **kw}


def test_base_has_four_csa_layers():
    assert BASE.num_csa_layers == 4 and BASE.index_topk_pattern == ""
    assert BASE.index_topk_producers == (1, 3, 5, 7)


@pytest.mark.parametrize("freq,pattern,producers", [
    (None, "", (1, 3, 5, 7)), (1, "", (1, 3, 5, 7)), (2, "FSFS", (1, 5)), (3, "FSSF", (1, 7)),
    (4, "FSSS", (1,)), (9, "FSSS", (1,))])
def test_freq_gives_every_freq_th_csa_layer(freq, pattern, producers):
    c = ModelConfig.from_dict(released(index_topk_freq=freq))
    assert c.index_topk_pattern == pattern and c.index_topk_producers == producers
    roles = [c.index_topk_role(i) for i in range(8)]
    assert [r for r, ratio in zip(roles, c.compress_ratios) if ratio != 4] == [""] * 4
    assert "index_topk_freq" not in c.extra


@pytest.mark.parametrize("pattern,producers", [("FFFF", (1, 3, 5, 7)), ("FSFF", (1, 5, 7)), ("FFSS", (1, 3))])
def test_explicit_pattern(pattern, producers):
    c = ModelConfig.from_dict(released(index_topk_pattern=pattern))
    assert c.index_topk_producers == producers


def test_equal_settings_give_equal_configs():
    """The producer set is what the layout depends on: configs that give the same one are equal
    (and hash equal), others differ."""
    a = ModelConfig.from_dict(released(index_topk_freq=2))
    b = ModelConfig.from_dict(released(index_topk_pattern="FSFS"))
    c = ModelConfig.from_dict(released(index_topk_freq=2, index_topk_pattern="FSFS"))
    assert a == b == c and hash(a) == hash(b)
    assert ModelConfig.from_dict(released(index_topk_pattern="FFFF")) == BASE
    assert ModelConfig.from_dict(released(index_topk_freq=1)) == BASE
    assert a != BASE and a != ModelConfig.from_dict(released(index_topk_freq=4))


def test_released_dict_round_trips_the_pattern():
    c = ModelConfig.from_dict(released(index_topk_freq=3))
    d = c.to_released_dict()
    assert d["index_topk_pattern"] == "FSSF" and ModelConfig.from_dict(d) == c
    assert "index_topk_pattern" not in BASE.to_released_dict()


@pytest.mark.parametrize("value", [0, -2, 2.0, 1.5, True, False, "2", [2]])
def test_bad_freq_is_rejected(value):
    with pytest.raises(ConfigError, match="index_topk_freq") as e:
        ModelConfig.from_dict(released(index_topk_freq=value))
    assert e.value.field == "index_topk_freq"


@pytest.mark.parametrize("value,why", [
    ("FSS", "one letter per CSA layer"), ("FSSSF", "one letter per CSA layer"), ("", "one letter per CSA layer"),
    ("SFFF", "first CSA layer must be 'F'"), ("FXSS", "'F' .* and 'S'"), ("fsss", "'F' .* and 'S'"),
    (4, "'F' .* and 'S'"), (["F", "S", "S", "S"], "'F' .* and 'S'")])
def test_bad_pattern_is_rejected(value, why):
    with pytest.raises(ConfigError, match=why) as e:
        ModelConfig.from_dict(released(index_topk_pattern=value))
    assert e.value.field == "index_topk_pattern"


def test_freq_and_pattern_that_disagree_are_rejected():
    with pytest.raises(ConfigError, match="contradicts index_topk_freq=2") as e:
        ModelConfig.from_dict(released(index_topk_freq=2, index_topk_pattern="FSSS"))
    assert e.value.field == "index_topk_pattern"


def test_direct_construction_is_checked():
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        BASE.replace(index_topk_pattern="SFFF")
    assert BASE.replace(index_topk_pattern="FFFF") == BASE


def test_mtp_layer_is_its_own_producer():
    """MTP layers run in a forward of their own, with no CSA layer before them."""
    c = ModelConfig.from_dict(released(compress_ratios=list(BASE.compress_ratios) + [4], index_topk_freq=4))
    assert c.index_topk_role(c.num_hidden_layers) == "F" and c.index_topk_producers == (1,)
    assert BASE.index_topk_role(BASE.num_hidden_layers) == ""


# ---- overrides ---------------------------------------------------------------------------
def test_overrides_replace_config_json_keys():
    d = released(index_topk_freq=2)
    assert ModelConfig.from_dict(d, {"index_topk_freq": 4}).index_topk_pattern == "FSSS"
    # one of the pair overridden: config.json's other one no longer applies
    assert ModelConfig.from_dict(d, {"index_topk_pattern": "FFSS"}).index_topk_pattern == "FFSS"
    assert ModelConfig.from_dict(released(index_topk_pattern="FFSS"), {"index_topk_freq": 1}) == BASE
    assert ModelConfig.from_dict(d, {"index_topk": 8}).index_topk == 8


def test_engine_config_checks_its_flags():
    with pytest.raises(ConfigError, match="index_topk_freq"):
        EngineConfig(index_topk_freq=0)
    with pytest.raises(ConfigError, match="index_topk_freq"):
        EngineConfig(index_topk_freq=2.0)
    with pytest.raises(ConfigError, match="index_topk_pattern"):
        EngineConfig(index_topk_pattern="FQ")
    for bad in ("{", "[1]", "4"):
        with pytest.raises(ConfigError, match="hf_overrides"):
            EngineConfig(hf_overrides=bad)
    e = EngineConfig(index_topk_freq=4, hf_overrides=json.dumps({"index_topk": 8, "index_topk_freq": 2}))
    assert e.model_overrides() == {"index_topk": 8, "index_topk_freq": 4}
    assert EngineConfig().model_overrides() == {}


def _cli(argv):
    from dsv4.cli.engine_args import add_engine_args, engine_config
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    add_engine_args(p)
    return engine_config(p.parse_args(argv))


@pytest.mark.parametrize("argv,flag", [
    (["--index-topk-freq", "0"], "--index-topk-freq"),
    (["--index-topk-pattern", "FS"], "--index-topk-pattern"),          # 4 CSA layers
    (["--index-topk-pattern", "SFFF"], "--index-topk-pattern"),
    (["--hf-overrides", '{"index_topk_freq": 2.5}'], "--hf-overrides"),
    (["--hf-overrides", '{"index_topk_pattern": "FS"}'], "--hf-overrides"),
    (["--hf-overrides", "not json"], "--hf-overrides"),
    (["--index-topk-freq", "2", "--index-topk-pattern", "FSSS"], "--index-topk-pattern")])
def test_cli_errors_name_the_flag(argv, flag):
    with pytest.raises(SystemExit) as e:
        _cli(["--model", "random:tiny:8", *argv])
    assert str(e.value).startswith(flag + ":"), str(e.value)


def test_cli_flags_reach_the_model_config():
    from dsv4.model.weights import model_config
    config = _cli(["--model", "random:tiny:8", "--index-topk-freq", "2"])
    assert config.index_topk_freq == 2
    assert model_config("random:tiny:8", config.model_overrides()).index_topk_pattern == "FSFS"
    config = _cli(["--model", "random:tiny:8", "--hf-overrides", '{"index_topk_pattern": "FFSF"}'])
    assert model_config("random:tiny:8", config.model_overrides()).index_topk_producers == (1, 3, 7)
    assert model_config("random:tiny:8:index_topk_freq=4").index_topk_pattern == "FSSS"
