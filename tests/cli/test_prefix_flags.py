"""The prefix-cache and tokenizer flags of every engine command: on by default,
--no-enable-prefix-caching, --num-checkpoints (validated, naming the flag), and `dsv4 serve`
refusing a random: model without --tokenizer before it binds or loads anything."""
from __future__ import annotations

import argparse

import pytest

from dsv4.cli import main
from dsv4.cli.engine_args import add_engine_args, engine_config


def config(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config(parser.parse_args(argv))


def test_prefix_caching_is_on_by_default_and_can_be_turned_off():
    assert config([]).enable_prefix_caching is True
    assert config(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert config(["--enable-prefix-caching"]).enable_prefix_caching is True
    assert config(["--num-checkpoints", "12"]).num_checkpoints == 12
    assert config(["--tokenizer", "/x"]).tokenizer == "/x"
    assert config([]).enforce_eager is False and config(["--enforce-eager"]).enforce_eager is True


def test_bad_checkpoint_count_names_the_flag():
    with pytest.raises(SystemExit, match="--num-checkpoints: .*expected >= 0"):
        config(["--num-checkpoints", "-1"])


def test_serve_needs_a_tokenizer_for_a_random_model(tmp_path):
    with pytest.raises(SystemExit, match="random model has no tokenizer; give --tokenizer"):
        main(["serve", "--model", "random:tiny", "--port", "0"])
    with pytest.raises(SystemExit, match="--tokenizer .*: no tokenizer.json"):
        main(["serve", "--model", "random:tiny", "--tokenizer", str(tmp_path), "--port", "0"])
