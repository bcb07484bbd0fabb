"""Parallel runs on 2 CPU ranks (gloo), the processes started once for every check of this
module (tests/parallel/ranks.py): TP 2, TP 2 + expert parallelism, DP attention + EP 2 (a rank
holding no requests for part of the run), and loading a sharded checkpoint."""
from __future__ import annotations

import pytest

from checks_dp import dp_same_as_one_process
from checks_load import rank_holds_its_shard
from checks_tp import TP_PROMPTS, TP_TOKENS, tp_same_as_one_process
from ranks import prompts, reference_run, run_checks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dsv4.model.random_init import preset_config, random_state, save_checkpoint
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    cfg = preset_config("tiny")
    save_checkpoint(cfg, random_state(cfg, seed=3, with_mtp=False), ckpt, max_shard_bytes=200_000)   # several files
    ref = reference_run(prompts(TP_PROMPTS), TP_TOKENS)
    checks = {"tp": (tp_same_as_one_process, False, ref), "tp_ep": (tp_same_as_one_process, True, ref),
              "dp_ep": (dp_same_as_one_process, "gather"), "load": (rank_holds_its_shard, ckpt, False),
              "load_ep": (rank_holds_its_shard, ckpt, True)}
    return run_checks(checks, 2, str(tmp_path_factory.mktemp("ranks")))


def test_tensor_parallel_2_equals_one_process(results):
    assert not results["tp"], results["tp"]


def test_tensor_parallel_with_expert_parallel_equals_one_process(results):
    assert not results["tp_ep"], results["tp_ep"]


def test_dp_attention_expert_parallel_equals_one_process(results):
    assert not results["dp_ep"], results["dp_ep"]


def test_sharded_checkpoint_gives_every_rank_its_shard(results):
    assert not results["load"], results["load"]
    assert not results["load_ep"], results["load_ep"]
