"""`dsv4 bench latency|throughput --speculative-config`: the result carries the acceptance
figures (docs/architecture.md, Speculative decoding); a bad value is refused naming the flag."""
from __future__ import annotations

import json

import pytest

from dsv4.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
SPEC = json.dumps({"method": "mtp", "num_speculative_tokens": 2})


@pytest.mark.parametrize("mode, extra", [("latency", ["--num-iters", "1", "--num-warmup", "0", "--batch-size", "2"]),
                                         ("throughput", ["--num-prompts", "3", "--max-num-seqs", "2"])])
def test_bench_reports_acceptance(tiny, capsys, mode, extra):
    args = ["bench", mode, "--model", tiny.path, "--input-len", "20", "--output-len", "9", "--json", *extra]
    assert main(args + ["--speculative-config", SPEC]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["speculative"] == "mtp" and result["num_speculative_tokens"] == 2
    assert result["spec_num_drafts"] > 0 and result["spec_draft_tokens"] >= result["spec_num_drafts"]
    assert result["spec_mean_acceptance_length"] == pytest.approx(
        1 + result["spec_accepted_tokens"] / result["spec_num_drafts"])
    assert len(result["spec_acceptance_rate_per_pos"]) == 2
    assert "spec_mean_acceptance_length" in out.split("{")[0]          # in the printed table too
    assert main(args) == 0
    assert "spec_num_drafts" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bad_value_names_the_flag(tiny):
    with pytest.raises(SystemExit, match="--speculative-config: .*num_speculative_tokens"):
        main(["bench", "latency", "--model", tiny.path, "--speculative-config", '{"num_speculative_tokens": 0}'])


def test_spec_host_profile_smoke():
    """benchmarks/spec_host.py --smoke: every draft accepted under its stubs (k + 1 tokens a
    verify), host figures and components for plain and speculative steps."""
    from benchmarks.spec_host import main as spec_host
    results = spec_host(["--smoke", "--batches", "2", "--ks", "2", "--steps", "3"])["results"]
    assert [(r["batch"], r["k"]) for r in results] == [(2, 0), (2, 2)]
    plain, spec = results
    assert plain["tokens_per_step"] == 2 and spec["tokens_per_step"] == 6
    assert spec["host_us_per_step"] > 0 and "spec: draft batches (build)" in spec["breakdown_us"]
