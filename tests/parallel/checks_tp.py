"""Tensor parallelism (dsv4/parallel/tensor_parallel.py), the check every rank runs: every rank
shards a copy of the same model and runs the same requests; the logits of every step equal the
one-process model's within the fp32 tolerance and the greedy tokens are identical (invariant
5), with chunked prefill and mixed batches (ranks.SMALL)."""
from __future__ import annotations

import copy

from dsv4.model.weights import load_model
from dsv4.parallel.tensor_parallel import apply_tensor_parallel
from ranks import MODEL, Recorder, assert_same_run, prompts


TP_PROMPTS, TP_TOKENS = [150, 30, 7], 4     # 150: past a C128 group; chunked at 48 tokens


def tp_same_as_one_process(comm, expert_parallel: bool, ref) -> None:
    """ref: reference_run(prompts(TP_PROMPTS), TP_TOKENS), computed once by the test."""
    full = load_model(MODEL)
    sharded = apply_tensor_parallel(copy.deepcopy(full), comm, expert_parallel=expert_parallel)
    n = comm.size
    attn = sharded.layers[0].attn
    assert attn.heads == full.cfg.num_attention_heads // n
    assert sharded.head.weight.shape[0] == full.cfg.vocab_size // n
    experts = sharded.layers[0].ffn.experts.w1
    assert experts.shape[0 if expert_parallel else 1] == full.layers[0].ffn.experts.w1.shape[0 if expert_parallel else 1] // n
    ours = Recorder(sharded)
    ours.add(prompts(TP_PROMPTS), TP_TOKENS)
    assert_same_run(ours, ours.run(), ref, f"TP {n} (expert parallel: {expert_parallel}) rank {comm.rank}")
