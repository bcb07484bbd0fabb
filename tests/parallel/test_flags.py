"""The parallelism flags: bad combinations are config errors naming the field (the CLI names
the flag)."""
from __future__ import annotations

import pytest

from dsv4.cli import main
from dsv4.config import ConfigError, EngineConfig


@pytest.mark.parametrize("kwargs, field", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(data_parallel_size=2), "data_parallel_size"),                       # without expert parallelism
    (dict(data_parallel_size=0), "data_parallel_size"),
    (dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True), "data_parallel_size"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, speculative_config={"method": "mtp"}),
     "speculative_config"),
    (dict(data_parallel_size=2, enable_expert_parallel=True, host_cache_gb=1.0), "host_cache_gb"),
    (dict(enable_expert_parallel=True), "enable_expert_parallel"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "mtp"}), "speculative_config"),
])
def test_bad_parallel_settings_name_their_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert e.value.field == field


def test_good_parallel_settings():
    c = EngineConfig(tensor_parallel_size=4, enable_expert_parallel=True)
    assert (c.tensor_parallel_size, c.enable_expert_parallel, c.world_size) == (4, True, 4)
    c = EngineConfig(data_parallel_size=2, enable_expert_parallel=True)
    assert (c.data_parallel_size, c.world_size) == (2, 2)


def test_dp_keeps_a_prefix_cache():
    from dsv4.cache.sizing import prefix_caching
    assert prefix_caching(EngineConfig()) and prefix_caching(EngineConfig(data_parallel_size=2,
                                                                            enable_expert_parallel=True))


def test_cli_names_the_flag():
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "random:tiny", "--enable-expert-parallel"])
    assert str(e.value).startswith("--enable-expert-parallel")


def test_cli_names_the_dp_flag():
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "random:tiny", "--data-parallel-size", "2"])
    assert str(e.value).startswith("--data-parallel-size")


def test_a_disaggregated_role_refuses_dp():
    with pytest.raises(SystemExit) as e:
        main(["serve", "--role", "prefill", "--data-parallel-size", "2", "--enable-expert-parallel"])
    assert "--data-parallel-size" in str(e.value) and "--role" in str(e.value)


def test_experts_that_do_not_split_over_the_dp_ranks_are_refused_before_any_rank_starts():
    from dsv4.engine.engine import LLMEngine
    with pytest.raises(ConfigError) as e:          # random:tiny has 8 routed experts
        LLMEngine("random:tiny", EngineConfig(data_parallel_size=3, enable_expert_parallel=True))
    assert e.value.field == "data_parallel_size" and "8 routed experts" in str(e.value)


def test_a_built_model_is_not_spread_over_ranks():
    from dsv4.engine.engine import LLMEngine
    from dsv4.model.weights import load_model
    with pytest.raises(ConfigError) as e:
        LLMEngine("random:tiny", EngineConfig(tensor_parallel_size=2), model=load_model("random:tiny"))
    assert e.value.field == "tensor_parallel_size"
    with pytest.raises(ConfigError) as e:
        LLMEngine("random:tiny", EngineConfig(data_parallel_size=2, enable_expert_parallel=True),
                  model=load_model("random:tiny"))
    assert e.value.field == "data_parallel_size"
