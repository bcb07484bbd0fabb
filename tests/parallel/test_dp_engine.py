"""The engine under data-parallel attention + expert parallelism (dsv4/engine/data_parallel.py):
`LLMEngine` with data_parallel_size 2 runs rank 1 as a spawned process; each rank runs its own
requests on its own cache, the routed experts split over the two. Greedy tokens equal the
one-process engine's (invariant 5) and the logits every token is sampled from agree within the
fp32 tolerance, over a run with chunked prefill, mixed prefill/decode steps, a request arriving
mid-run (to the least loaded rank) and steps where one rank (either) has no requests. The
memory report (the serve log) shows each rank's own cache."""
from __future__ import annotations

from collections import defaultdict

import pytest

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams
from ranks import MODEL, REL_TOL, SMALL, prompts

DP = dict(data_parallel_size=2, enable_expert_parallel=True)
# (prompt tokens, max_tokens, the engine.step() call it arrives before). Rank 0 runs "a" and
# "c" while rank 1 prefills "b" in chunks; "d" arrives to rank 0 beside the decoding "c" (a
# mixed step); rank 0 then idles while "b" decodes, until "e" arrives to it and outlives "b"
# (rank 1 idles). The run checks that it covered each case.
ARRIVALS = {"a": (20, 2, 0), "b": (150, 12, 0), "c": (7, 5, 0), "d": (40, 3, 3), "e": (30, 12, 10)}


class Recorded:
    """An engine whose steps are recorded: per request, the logits row of each token it
    sampled; per step, each chunk's (rank, start, tokens, prompt length)."""

    def __init__(self, **config):
        self.engine = LLMEngine(MODEL, EngineConfig(**{**SMALL, **config}))
        self.rows: dict[str, list] = defaultdict(list)
        self.steps: list[list[tuple[int, int, int, int]]] = []
        self.assigned: dict[str, int] = {}
        execute = self.engine.runner.execute

        def recording(chunks, prev_tokens=None):
            out = execute(chunks, prev_tokens)
            rank_of = getattr(self.engine.cache, "rank_of", {})
            self.steps.append([(rank_of.get(c.request.request_id, 0), c.request.num_computed, c.num_tokens,
                                len(c.request.prompt_token_ids)) for c in chunks])
            for i, c in enumerate(chunks):
                if c.completes:
                    self.rows[c.request.request_id].append(out.logits[out.first_row[i] + out.num_rows[i] - 1].clone())
            return out
        self.engine.runner.execute = recording

    def run(self) -> dict[str, list[int]]:
        work = {rid: prompts([n], seed=i)[0] for i, (rid, (n, _, _)) in enumerate(ARRIVALS.items())}
        done, step = {}, 0
        try:
            self.engine.warmup()     # (as on CUDA) every rank runs it alongside rank 0, on scratch rows only
            while len(done) < len(ARRIVALS):
                for rid, (_, max_tokens, at) in ARRIVALS.items():
                    if at == step:
                        loads = [self.engine.scheduler.load(r) for r in (0, 1)] if DP_ON(self.engine) else [0]
                        self.engine.add_request(rid, work[rid], SamplingParams(max_tokens=max_tokens, temperature=0.0))
                        self.assigned[rid] = (self.engine.cache.rank_of[rid], loads) if DP_ON(self.engine) else 0
                done.update({o.request_id: o.token_ids for o in self.engine.step() if o.finished})
                step += 1
            return done
        finally:
            self.engine.close()


def DP_ON(engine) -> bool:
    return engine.config.data_parallel_size > 1


@pytest.fixture(scope="module")
def one_process():
    ref = Recorded()
    return ref.run(), ref.rows


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_dp2_ep2_engine_equals_one_process(one_process, async_scheduling):
    ref_done, ref_rows = one_process
    ours = Recorded(**DP, async_scheduling=async_scheduling)
    done = ours.run()
    assert ours.engine.async_scheduling == (async_scheduling == "on")
    assert not any(p.is_alive() for p in ours.engine.workers.procs), "a rank outlived close()"
    assert done == ref_done, "greedy tokens differ from one process"
    for rid, rows in ref_rows.items():
        assert len(ours.rows[rid]) == len(rows), rid
        for i, (a, b) in enumerate(zip(ours.rows[rid], rows)):
            err = float((a - b).abs().max() / b.abs().max())
            assert err <= REL_TOL, f"request {rid}, token {i}: logits differ by {err:.3g} x max|ref|"
    _assert_the_run_covers_its_cases(ours)
    assert "on each of 2 data-parallel ranks, each for its own requests" in ours.engine.memory_report()


def _assert_the_run_covers_its_cases(ours: Recorded) -> None:
    for rid, (rank, loads) in ours.assigned.items():           # the least loaded rank, then the lowest
        assert rank == loads.index(min(loads)), (rid, rank, loads)
    by_rank = [[[c for c in step if c[0] == r] for step in ours.steps] for r in (0, 1)]
    assert any(not mine and other for mine, other in zip(*by_rank)), "rank 0 never idled beside rank 1"
    assert any(mine and not other for mine, other in zip(*by_rank)), "rank 1 never idled beside rank 0"
    assert any(0 < start < prompt for step in ours.steps for _, start, _, prompt in step), "no chunked prefill"
    assert any({start < prompt for _, start, _, prompt in rank_step} == {True, False}
               for rank in by_rank for rank_step in rank), "no step mixing a prefill chunk and a decode on a rank"


def test_an_idle_rank_skips_the_mtp_blocks(tmp_path):
    """A checkpoint with MTP blocks (loaded, not run without drafting): the idle rank joins the
    main layers' MoE collectives only, as the busy rank's forward runs."""
    from dsv4.engine.llm import LLM
    from dsv4.model.random_init import preset_config, random_state, save_checkpoint
    cfg = preset_config("tiny")
    save_checkpoint(cfg, random_state(cfg, seed=3, with_mtp=True), str(tmp_path))
    params = SamplingParams(max_tokens=3, temperature=0.0)

    def run(**config):
        llm = LLM(str(tmp_path), **{**SMALL, **config})
        try:
            assert len(llm.engine.model.mtp) == cfg.num_nextn_predict_layers > 0
            return [o.token_ids for o in llm.generate(prompt_token_ids=prompts([20], seed=8), sampling_params=params,
                                                       use_tqdm=False)]
        finally:
            llm.engine.close()
    assert run(**DP) == run()
