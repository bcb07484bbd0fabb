"""Rollback after rejected drafts (invariant 1) through the engine: verify steps that write
k + 1 positions across C4, C128 and SWA-page boundaries, keep some drafts and rewind over the
others. Every logits row the engine computed whose inputs were the committed tokens (the
verify rows up to the first rejected draft) equals the oracle's full-sequence logits of the
committed sequence (fp32 tolerance), so the keys, compressed entries and ring rows the
rejected drafts wrote never leaked into a later step. Run on window 32 and on V4's real 128
(one SWA page)."""
from __future__ import annotations

import random

import pytest
import torch

from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3


def spy_rows(engine, rows: dict):
    """Record (position, chunk start, the chunk's tokens up to the row, logits row) of every
    logits row of every step, per request."""
    execute = engine.runner.execute

    def spy(chunks, prev=None, draft_fills=()):
        inputs = []
        for c in chunks:
            req = c.request
            toks = req.known_tokens(req.num_computed, c.num_tokens)
            drafts = engine.spec.drafts_of(req) if engine.spec is not None else req.spec_token_ids
            inputs.append((req.request_id, req.num_computed, toks + drafts[:c.num_tokens - len(toks)]))
        out = execute(chunks, prev, draft_fills)
        for i, (rid, start, toks) in enumerate(inputs):
            n = out.num_rows[i]
            for j in range(n):
                p = start + len(toks) - n + j
                rows.setdefault(rid, []).append((p, start, toks[:p - start + 1], out.logits[out.first_row[i] + j]))
        return out
    engine.runner.execute = spy


def tie_free_request(tiny, sp, rid: str, n: int, config: dict):
    """A greedy request of an n-token prompt whose whole plain sequence (prompt + 14 tokens) has
    no indexer near-tie (tests/engine/conftest.py), so every kept row can be compared."""
    for seed in range(20):
        req = sp.Req(rid, tiny.tie_free_ids(n, seed=90 + n + 1000 * seed),
                     SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
        out = sp.drive(tiny.engine(**config), [req])[rid]
        if not tiny.ties(req.prompt + out.token_ids):
            return req
    raise AssertionError(f"no tie-free {n}-token request found")


@pytest.mark.parametrize("model", ["tiny", "tiny_w128"])
def test_logits_after_rejected_drafts_equal_the_reference(request, h, sp, model):
    tiny = request.getfixturevalue(model)
    # the first verify chunk [n, n + K] (its first draft always wrong) crosses a C4 and C128
    # close, the first history page's end, and at window 128 an SWA page's end
    starts = (62, 126, 254)
    config = dict(max_num_batched_tokens=512, max_num_seqs=4, num_pages=8)
    reqs = [tie_free_request(tiny, sp, str(i), n, config) for i, n in enumerate(starts)]
    plain = sp.drive(tiny.engine(**config), reqs)
    eng = tiny.engine(speculative_config=sp.spec(K), **config)
    truth = {r.rid: r.prompt + plain[r.rid].token_ids for r in reqs}
    rng = random.Random(7)
    wrong = {(r.rid, p): p == len(r.prompt) + 1 or rng.random() < 0.35
             for r in reqs for p in range(len(truth[r.rid]) + K + 2)}
    eng.spec.proposer = sp.ScriptedProposer(truth, lambda rid, p: wrong[rid, p], tiny.cfg.vocab_size)
    rows: dict = {}
    spy_rows(eng, rows)
    got = sp.drive(eng, reqs, check=True)
    sp.assert_same_outputs(got, plain)
    rejected_chunks = set()
    for r in reqs:
        seq = truth[r.rid]
        kept = [(p, row) for p, start, toks, row in rows[r.rid] if seq[start:p + 1] == toks]
        rejected_chunks |= {(start, start + len(toks) - 1) for p, start, toks, _ in rows[r.rid]
                            if seq[start:p + 1] != toks}
        positions = [p for p, _ in kept]
        assert set(range(len(r.prompt), len(seq) - 1)) <= set(positions)
        h.assert_rows_close(torch.stack([row for _, row in kept]), tiny.ref_logits(seq)[positions], positions,
                            f"request {r.rid} after rejected drafts")
    # verify chunks with a rejected draft wrote across each kind of boundary: a C4 close, a
    # C128 close, a new 256-token history page and a new 128-slot SWA page
    crossed = {b for lo, hi in rejected_chunks for b in (4, 64, 128, 256) if hi // b > lo // b}
    assert crossed == {4, 64, 128, 256}, f"rejected verify chunks crossed only multiples of {sorted(crossed)}"
