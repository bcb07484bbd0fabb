"""A step's logits rows are bounded (engine/workspace.py, logits_rows): chunks computing prompt
logprobs have max_prompt_logprobs_tokens rows together at most, and the memory plan's head term
is what the head allocates for the most rows a step has. Prompt logprobs computed in those
smaller chunks are those of an unbounded run, and the generated tokens the same (invariant 5)."""
from __future__ import annotations

import torch

from dsv4.config import EngineConfig
from dsv4.engine import workspace as ws
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

SEQS, BUDGET, ROWS = 4, 64, 16


def _run(tiny, h, rows: int):
    """Three short greedy requests and one asking for prompt logprobs, all in the first step;
    -> (outputs, the bytes the head allocated at each step, the engine's config)."""
    config = EngineConfig(max_num_batched_tokens=BUDGET, max_num_seqs=SEQS, max_prompt_logprobs_tokens=rows,
                          num_pages=16)
    eng = LLMEngine(tiny.path, config, model=tiny.model)
    allocated, head = [], eng.model.head_logits

    def recorded(x):
        out = head(x)
        allocated.append(out.untyped_storage().nbytes())
        return out

    eng.model.head_logits = recorded
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    vocab = tiny.cfg.vocab_size
    reqs = [h.Req(str(i), h.random_ids(vocab, 5, seed=i), greedy) for i in range(SEQS - 1)]
    reqs.append(h.Req("scored", h.random_ids(vocab, 40, seed=9), scored))
    try:
        return h.drive(eng, reqs), allocated, config
    finally:
        del eng.model.head_logits


def test_prompt_logprob_rows_are_bounded_and_the_plan_counts_them(tiny, h, one_thread):
    bounded, allocated, config = _run(tiny, h, ROWS)
    rows = ws.logits_rows(config)
    assert rows == ROWS + SEQS - 1 < BUDGET               # a 16-row chunk beside three decodes
    per_row = ws.head_bytes_per_row(tiny.cfg, torch.float32)
    assert max(allocated) == rows * per_row               # the first step: the worst case, allocated
    assert ws.workspace_components(tiny.cfg, config, torch.float32)[ws.ACTIVATIONS] == \
        ws.step_bytes(tiny.cfg, torch.float32, BUDGET, rows)

    unbounded, _, _ = _run(tiny, h, BUDGET)
    for rid, out in unbounded.items():
        assert bounded[rid].token_ids == out.token_ids, rid
    got, want = bounded["scored"].prompt_logprobs, unbounded["scored"].prompt_logprobs
    assert len(got) == len(want) == 40 and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        assert all(abs(g[t] - w[t]) < 1e-4 for t in g)
