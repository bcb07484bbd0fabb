"""The engine over ranks (engine/workers.py): rank 0 schedules and samples, rank 1 (a spawned
process) runs the steps rank 0 describes. Greedy tokens equal the one-process engine's and
logprobs agree within fp32 tolerance, with async scheduling on (pending tokens filled on every
rank from the broadcast samples) and after a warm-up every rank runs alongside; shutdown leaves no rank behind; a rank that dies ends the
engine's process with an error instead of a hang."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dsv4.engine.llm import LLM
from dsv4.sampling_params import SamplingParams
from ranks import MODEL, SMALL, prompts

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
WORK = prompts([150, 30, 7], seed=4)


def _generate(**config):
    llm = LLM(MODEL, **{**SMALL, **config})
    try:
        llm.engine.warmup()          # (as on CUDA) every rank runs it alongside rank 0, on scratch rows only
        return llm.generate(prompt_token_ids=WORK, sampling_params=PARAMS, use_tqdm=False), llm.engine
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def one_process():
    return _generate()[0]


@pytest.mark.parametrize("config", [dict(tensor_parallel_size=2, async_scheduling="off"),
                                    dict(tensor_parallel_size=2, enable_expert_parallel=True, async_scheduling="on")])
def test_engine_over_two_ranks_equals_one_process(one_process, config):
    outs, engine = _generate(**config)
    assert engine.workers is not None and not any(p.is_alive() for p in engine.workers.procs), "a rank outlived close()"
    assert engine.async_scheduling == (config["async_scheduling"] == "on")
    for ours, ref in zip(outs, one_process):
        assert ours.token_ids == ref.token_ids
        for got, want in zip(ours.logprobs, ref.logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) <= 1e-4 for t in want)


KILL_A_RANK = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from dsv4.engine.llm import LLM
    from dsv4.sampling_params import SamplingParams
    from ranks import MODEL, SMALL, prompts
    llm = LLM(MODEL, **{parallel}, **SMALL)
    engine = llm.engine
    engine.add_request("a", prompts([30])[0], SamplingParams(max_tokens=200, temperature=0.0))
    engine.step()
    engine.workers.procs[0].kill()
    for _ in range(10000):
        engine.step()
    print("still running")
""")


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(data_parallel_size=2, enable_expert_parallel=True)])
def test_a_dead_rank_ends_the_engine_with_an_error(parallel):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    script = KILL_A_RANK.format(tests=os.path.dirname(__file__), parallel=parallel)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "parallel rank dsv4-rank1 exited" in done.stderr
    assert "still running" not in done.stdout


def test_prefix_cache_hits_under_tensor_parallelism():
    """A request resuming from a cached prefix (checkpoint copied into its SWA pages and ring on
    rank 0, replayed on rank 1) gives the tokens and logprobs of a run without the cache."""
    base = prompts([300], seed=5)[0]
    first, second = base + prompts([20], seed=6)[0], base + prompts([40], seed=7)[0]

    def run(**config):
        llm = LLM(MODEL, **{**SMALL, **config})
        try:
            llm.generate(prompt_token_ids=[first], sampling_params=PARAMS, use_tqdm=False)
            return llm.generate(prompt_token_ids=[second], sampling_params=PARAMS, use_tqdm=False)[0]
        finally:
            llm.engine.close()
    ours = run(tensor_parallel_size=2, enable_prefix_caching=True)
    ref = run(enable_prefix_caching=False)
    assert ours.num_cached_tokens == 256, "the second request should resume from the first page"
    assert ours.token_ids == ref.token_ids
    for got, want in zip(ours.logprobs, ref.logprobs):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) <= 1e-4 for t in want)
