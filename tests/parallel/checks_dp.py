"""Data-parallel attention + expert parallelism (dsv4/parallel/expert_parallel.py), the check
every rank runs: each rank runs its own requests with its own cache (uneven: rank 1's requests end early
and it then holds none, running idle steps), the routed experts split over the ranks; each
rank's logits and greedy tokens equal those of the one-process model on its requests."""
from __future__ import annotations

import copy

from dsv4.model.weights import load_model
from dsv4.parallel.expert_parallel import apply_dp_expert_parallel, idle_step
from ranks import MODEL, Recorder, assert_same_run, prompts


# per rank: (prompts, max_tokens); rank 1 runs out of requests early
DP_WORK = [(prompts([150, 40, 9], seed=1), 5), (prompts([20], seed=2), 2)]


def dp_same_as_one_process(comm, dispatch: str) -> None:
    full = load_model(MODEL)
    dp = apply_dp_expert_parallel(copy.deepcopy(full), comm, dispatch)
    assert dp.layers[0].ffn.experts.w1.shape[0] == full.cfg.n_routed_experts // comm.size
    own, max_tokens = DP_WORK[comm.rank] if comm.rank < len(DP_WORK) else ([], 1)   # ranks 2, 3: never any
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
    assert_same_run(ours, ours_done, (ref.run(), ref.logits), f"DP+EP ({dispatch}) rank {comm.rank}")
