"""Steps of k + 1 tokens per running request with the logits of all of them (what verifying k
drafts needs) give the logits of a plain run (invariant 5), through the eager path and through
the padded CUDA-graph shapes (run eagerly here, captured on a GPU)."""
from __future__ import annotations

import pytest
import torch

from dsv4.engine.cuda_graphs import StepGraphs
from dsv4.engine.request import Request, Status
from dsv4.engine.scheduler import ScheduledChunk
from dsv4.sampling_params import SamplingParams

Q = 3                       # tokens per request per verify step (k = 2 drafts)


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-shapes"])
def test_k_token_steps_equal_the_reference(tiny, h, monkeypatch, padded):
    eng = tiny.engine(spec_slots=Q, max_num_batched_tokens=512, max_num_seqs=4, num_pages=12)
    initial, calls = h.free_counts(eng), []
    if padded:
        eng.runner.graphs = StepGraphs(eng.model, eng.runner.storage, max_bs=4, capture=False)
        run = eng.runner.graphs.run
        monkeypatch.setattr(eng.runner.graphs, "run", lambda seqs, fill=None: calls.append(len(seqs)) or run(seqs, fill))
    # prefill ends just before C4, C128 and SWA-page boundaries, so verify steps cross them
    starts = (61, 126, 254)
    seqs = [tiny.tie_free_ids(n + 5 * Q, seed=70 + n) for n in starts]
    reqs = [Request(f"v{i}", ids, SamplingParams(temperature=0.0), arrival=i) for i, ids in enumerate(seqs)]
    _step(eng, [ScheduledChunk(r, n, num_logits=0) for r, n in zip(reqs, starts)])
    got = [[] for _ in reqs]
    for _ in range(5):
        out = _step(eng, [ScheduledChunk(r, Q, num_logits=Q) for r in reqs])
        assert out.num_rows == [Q] * len(reqs)
        for i in range(len(reqs)):
            got[i].append(out.logits[out.first_row[i]:out.first_row[i] + Q])
    assert bool(calls) == padded and all(n == len(reqs) for n in calls)
    for ids, n, rows in zip(seqs, starts, got):
        positions = range(n, n + 5 * Q)
        h.assert_rows_close(torch.cat(rows), tiny.ref_logits(ids)[n:n + 5 * Q], positions, "k-token steps")
    for r in reqs:
        eng.cache.release(r)
    assert h.free_counts(eng) == initial


def _step(eng, chunks):
    for c in chunks:
        assert eng.cache.reserve(c.request, c.num_tokens)
        c.request.status = Status.RUNNING
    out = eng.runner.execute(chunks)
    for c in chunks:
        c.request.num_computed += c.num_tokens
        eng.cache.trim(c.request)
    return out
