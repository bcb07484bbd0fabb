"""benchmarks/serve_path.py and cpu_sampler.py: the sampler charges a busy function its own
samples and every caller a total sample; a state round-trips; runs of one concurrency merge to
the least CPU per process; /proc CPU seconds grow with work; the stubbed forward picks a
different plain token per batch slot and per step."""
from __future__ import annotations

import os

import pytest

from benchmarks.cpu_sampler import Sampler
from benchmarks.serve_path import cpu_seconds, least


def _busy(sampler: Sampler, samples: int, max_cpu_s: float = 20.0) -> int:
    """Spin until `sampler` took `samples` samples (or max_cpu_s of user CPU went by: a
    loaded host delivers the CPU-time signals late, never not at all)."""
    start, n = os.times().user, 0
    while sampler.samples < samples and os.times().user - start < max_cpu_s:
        n += sum(range(200))
    return n


def _spin(seconds: float) -> int:
    start, n = os.times().user, 0
    while os.times().user - start < seconds:
        n += sum(range(200))
    return n


def _caller(sampler: Sampler) -> int:
    return _busy(sampler, 30)


def test_sampler_charges_own_and_total_time():
    sampler = Sampler(0.005).start()
    try:
        _caller(sampler)
    finally:
        sampler.stop()
    busy = next(k for k in sampler.own if k.endswith("(_busy)"))
    caller = next(k for k in sampler.total if k.endswith("(_caller)"))
    assert sampler.samples >= 10
    assert sampler.own[busy] >= sampler.samples // 2          # the loop itself (its C calls included)
    assert sampler.total[caller] >= sampler.own[busy] and caller not in sampler.own
    again = Sampler.from_state(sampler.state())
    assert (again.samples, again.own, again.total) == (sampler.samples, sampler.own, sampler.total)
    assert "(_busy)" in again.report(3, per=1e-6, unit="token")


def test_runs_merge_to_the_least_cpu_and_the_fastest_run():
    runs = [{"output_tok_s": 10.0, "failed": 0, "cpu_us_per_token": {"api": 5.0, "engine": 9.0}},
            {"output_tok_s": 30.0, "failed": 1, "cpu_us_per_token": {"api": 7.0, "engine": 4.0}}]
    merged = least(runs)
    assert merged["output_tok_s"] == 30.0 and merged["failed"] == 1 and merged["runs"] == runs
    assert merged["cpu_us_per_token"] == {"api": 5.0, "engine": 4.0}


def test_proc_cpu_seconds_grow_with_work():
    before = cpu_seconds(os.getpid())
    _spin(0.05)
    assert cpu_seconds(os.getpid()) - before >= 0.03


def test_stubbed_forward_varies_tokens_by_slot_and_step():
    from dsv4.assets import demo_model_dir
    from dsv4.config import EngineConfig
    from dsv4.engine.engine import LLMEngine
    from dsv4.sampling_params import SamplingParams
    from benchmarks.serve_path import stub_forward
    engine = LLMEngine(demo_model_dir(), EngineConfig(device="cpu", dtype="float32", max_num_seqs=4,
                                                     enforce_eager=True, num_pages=16, enable_prefix_caching=False))
    stub_forward(engine)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), [200 + i] * 5, params)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    tokens = [done[str(i)] for i in range(3)]
    assert all(len(t) == 4 and len(set(t)) == 4 and min(t) >= 100 for t in tokens)
    assert len({t[0] for t in tokens}) == 3


def test_serve_args_give_the_api_process_count_and_refuse_other_flags():
    from benchmarks.serve_path import api_server_count_of
    assert api_server_count_of("") == 1
    assert api_server_count_of("--api-server-count=2") == 2
    with pytest.raises(SystemExit, match=r"--api-server-count must be >= 1"):
        api_server_count_of("--api-server-count 0")
    with pytest.raises(SystemExit, match=r"only --api-server-count applies here, not \['port'\]"):
        api_server_count_of("--port 5")


def test_server_pids_come_from_its_log_with_every_api_process(tmp_path):
    from benchmarks.server_proc import server_pids, with_api_total
    log = tmp_path / "serve.log"
    log.write_text("dsv4 serve: processes: api 11 12 13; engine core 14\ndsv4 serve: ready at http://x:1\n")
    assert server_pids(str(log)) == {"api0": 11, "api1": 12, "api2": 13, "engine": 14}
    assert with_api_total({"api0": 1.0, "api1": 2.5, "engine": 4.0}) == {"api0": 1.0, "api1": 2.5, "engine": 4.0,
                                                                        "api": 3.5}
