"""The memory planner under tensor parallelism: every rank holds the whole KV cache (one
shared K=V head), and `dsv4 plan` shows each rank's share of the weights beside it."""
from __future__ import annotations

import re

import torch

from dsv4.cache.layout import CacheLayout, CachePlan
from dsv4.cache.sizing import cache_bytes, memory_report
from dsv4.cli import main
from dsv4.model.random_init import preset_config


def test_report_shows_the_whole_cache_per_rank():
    layout = CacheLayout(preset_config("tiny"))
    plan = CachePlan(num_pages=8, num_swa_pages=8, max_num_seqs=2, num_checkpoints=0)
    one, two = memory_report(layout, plan, torch.float32, 1024), memory_report(layout, plan, torch.float32, 1024, 2)
    assert "per rank" not in one
    mib = cache_bytes(layout, plan, torch.float32) / 2**20
    assert f"per rank: {mib:.1f} MiB of KV cache on each of 2 tensor-parallel ranks ({2 * mib:.1f} MiB in all" in two


def test_plan_prints_each_ranks_share(capsys):
    assert main(["plan", "--model", "random:flash-slice:2", "--tensor-parallel-size", "2", "--num-pages", "64"]) == 0
    out = capsys.readouterr().out
    whole = float(re.search(r"^  routed experts \(256 per layer\)\s+([\d.]+) GiB", out, re.M).group(1))
    section = out[out.index("per rank of 2"):]
    rank = float(re.search(r"routed experts \(256 per layer\)\s+([\d.]+) GiB", section).group(1))
    assert abs(rank - whole / 2) < 0.002
    assert "KV cache (whole)" in section


def test_report_shows_each_dp_ranks_own_cache():
    layout = CacheLayout(preset_config("tiny"))
    plan = CachePlan(num_pages=8, num_swa_pages=8, max_num_seqs=2, num_checkpoints=0)
    report = memory_report(layout, plan, torch.float32, 1024, 1, 2)
    mib = cache_bytes(layout, plan, torch.float32) / 2**20
    assert "fit at once on each rank" in report
    assert (f"per rank: {mib:.1f} MiB of KV cache on each of 2 data-parallel ranks, each for its own requests "
            f"({2 * mib:.1f} MiB in all; {plan.max_tokens} tokens and 2 request slots per rank, "
            f"{2 * plan.max_tokens} tokens in all)") in report


def test_plan_prints_each_dp_ranks_share(capsys):
    assert main(["plan", "--model", "random:flash-slice:2", "--data-parallel-size", "2", "--enable-expert-parallel",
                 "--num-pages", "64"]) == 0
    out = capsys.readouterr().out
    split = out.index("per rank of 2 (data-parallel attention")
    whole, rank = (_gib_lines(text) for text in (out[:split], out[split:]))
    assert abs(rank["routed experts (256 per layer)"] - whole["routed experts (256 per layer)"] / 2) < 0.002
    assert rank["attention projections"] == whole["attention projections"]     # attention stays whole
    assert "KV cache (its own requests)" in rank


def _gib_lines(text: str) -> dict[str, float]:
    """`  name   1.234 GiB` lines of a plan section -> {name: GiB}."""
    return {k: float(v) for k, v in re.findall(r"^  (\w[\w ()]+?)\s+([\d.]+) GiB", text, re.M)}
