"""The parallelism flags: bad combinations are config errors naming the field (the CLI names
the flag)."""
from __future__ import annotations

import pytest

from dsv4.cli import main
from dsv4.config import ConfigError, EngineConfig


@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(data_parallel_size=2), "data_parallel_size"),
    (dict(enable_expert_parallel=True), "enable_expert_parallel"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "mtp"}), "speculative_config"),
])
def test_bad_parallel_settings_name_their_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert e.value.field == field


def test_good_parallel_settings():
    c = EngineConfig(tensor_parallel_size=4, enable_expert_parallel=True)
    assert (c.tensor_parallel_size, c.enable_expert_parallel) == (4, True)


def test_cli_names_the_flag():
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "random:tiny", "--enable-expert-parallel"])
    assert str(e.value).startswith("--enable-expert-parallel")


def test_a_built_model_is_not_spread_over_ranks():
    from dsv4.engine.engine import LLMEngine
    from dsv4.model.weights import load_model
    with pytest.raises(ConfigError) as e:
        LLMEngine("random:tiny", EngineConfig(tensor_parallel_size=2), model=load_model("random:tiny"))
    assert e.value.field == "tensor_parallel_size"
