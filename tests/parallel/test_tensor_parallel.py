"""Tensor parallelism (dsv4/parallel/tensor_parallel.py) on 2 and 4 CPU ranks: every rank
shards a copy of the same model and runs the same requests; the logits of every step equal the
one-process model's within the fp32 tolerance and the greedy tokens are identical (invariant
5), with chunked prefill and mixed batches (ranks.SMALL)."""
from __future__ import annotations

import copy

import pytest

from dsv4.model.weights import load_model
from dsv4.parallel.tensor_parallel import apply_tensor_parallel
from ranks import MODEL, Recorder, assert_same_run, prompts, run_ranks


def _same_as_one_process(comm, expert_parallel: bool) -> None:
    full = load_model(MODEL)
    sharded = apply_tensor_parallel(copy.deepcopy(full), comm, expert_parallel=expert_parallel)
    n = comm.size
    attn = sharded.layers[0].attn
    assert attn.heads == full.cfg.num_attention_heads // n
    assert sharded.head.weight.shape[0] == full.cfg.vocab_size // n
    experts = sharded.layers[0].ffn.experts.w1
    assert experts.shape[0 if expert_parallel else 1] == full.layers[0].ffn.experts.w1.shape[0 if expert_parallel else 1] // n
    ref, ours = Recorder(full), Recorder(sharded)
    work = prompts([300, 150, 30, 7])
    ref.add(work)
    ours.add(work)
    assert_same_run(ours, ref, ours.run(), ref.run(), f"TP {n} (expert parallel: {expert_parallel}) rank {comm.rank}")


@pytest.mark.parametrize("n, expert_parallel", [(2, False), (4, False), (2, True)])
def test_tensor_parallel_equals_one_process(n, expert_parallel):
    run_ranks(_same_as_one_process, n, expert_parallel)
