"""Data-parallel attention + expert parallelism (dsv4/parallel/expert_parallel.py) on 2 CPU
ranks (and 4, two of them never holding a request): each rank runs its own requests with its own cache (uneven: rank 1's requests end early
and it then holds none, running idle steps), the routed experts split over the ranks; each
rank's logits and greedy tokens equal those of the one-process model on its requests."""
from __future__ import annotations

import copy

import pytest

from dsv4.model.weights import load_model
from dsv4.parallel.expert_parallel import apply_dp_expert_parallel, idle_step
from ranks import MODEL, Recorder, assert_same_run, prompts, run_ranks


def _dp_same_as_one_process(comm, dispatch: str) -> None:
    full = load_model(MODEL)
    dp = apply_dp_expert_parallel(copy.deepcopy(full), comm, dispatch)
    assert dp.layers[0].ffn.experts.w1.shape[0] == full.cfg.n_routed_experts // comm.size
    own = [prompts([300, 40, 9], seed=1), prompts([20], seed=2), [], []][comm.rank]   # ranks 2, 3: never any
    max_tokens = 6 if comm.rank == 0 else 2          # rank 1 runs out of requests early
    ref, ours = Recorder(full), Recorder(dp)
    ref.add(own, max_tokens)
    ours.add(own, max_tokens)
    ours_done, idle = {}, 0
    while any(comm.all_gather_ints(int(ours.engine.has_unfinished()))):
        if ours.engine.has_unfinished():
            ours_done.update(ours.step())
        else:
            idle_step(dp)
            idle += 1
    assert comm.rank == 0 or idle > 0, "the test meant this rank to idle"
    assert_same_run(ours, ref, ours_done, ref.run(), f"DP+EP ({dispatch}) rank {comm.rank}")


@pytest.mark.parametrize("n, dispatch", [(2, "gather"), (4, "all_to_all")])
def test_dp_attention_expert_parallel_equals_one_process(n, dispatch):
    run_ranks(_dp_same_as_one_process, n, dispatch)
