"""Parallel runs on 4 CPU ranks (gloo), the processes started once (tests/parallel/ranks.py):
TP 4 (more ranks than o-groups: each group's projection split by columns) and DP attention +
EP with the all-to-all dispatch, two ranks never holding a request."""
from __future__ import annotations

import pytest

from checks_dp import dp_same_as_one_process
from checks_tp import TP_PROMPTS, TP_TOKENS, tp_same_as_one_process
from ranks import prompts, reference_run, run_checks


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ref = reference_run(prompts(TP_PROMPTS), TP_TOKENS)
    checks = {"tp": (tp_same_as_one_process, False, ref), "dp_ep": (dp_same_as_one_process, "all_to_all")}
    return run_checks(checks, 4, str(tmp_path_factory.mktemp("ranks")))


def test_tensor_parallel_4_equals_one_process(results):
    assert not results["tp"], results["tp"]


def test_dp_attention_all_to_all_with_idle_ranks_equals_one_process(results):
    assert not results["dp_ep"], results["dp_ep"]
