"""The request-state invariants (docs/architecture.md, "Cache"), each by name, on the real engine objects.

1. positions, not histories: position-addressed rollback of up to S speculative positions;
3. chunks keep what they read: a chunk boundary at every offset mod 4 and mod 128;
5. path invariance: a request's logits do not depend on the rest of the batch;
plus §5/§7: abort and preemption free every page, and a request that can never fit the
cache is rejected with a clear error instead of hanging.
"""
from __future__ import annotations

import random

import pytest
import torch

from dsv4.config import CSA_RATIO, HCA_RATIO
from dsv4.engine.request import Status
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

S = 4   # speculative slots of the rollback tests


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_to_completion(engine, h) -> dict[str, list[int]]:
    """engine.step() until idle, checking page accounting after every step."""
    return h.token_ids(h.drive(engine, check=True))


# ---- invariant 1: positions, not histories ------------------------------------------------
@pytest.mark.parametrize("n, ratio", [(66, CSA_RATIO), (254, HCA_RATIO), (158, CSA_RATIO)],
                         ids=["c4-boundary", "c128-boundary", "swa-page-boundary"])
def test_position_addressed_rollback(tiny, h, stepper, n, ratio):
    """Write S extra positions [n, n+S) with wrong tokens (a rejected draft), rewind to n and
    continue with the right ones: the logits equal those of a run that never wrote them, and
    the reference's. The extra positions close a group of `ratio` (and the C4 group before a
    C128 close); the continuation runs past the next C128 close. At n = 158 the window behind
    n + S starts on a later SWA page than the window behind n: that page must be kept (W + S)."""
    assert any((p + 1) % ratio == 0 for p in range(n, n + S)), "the extra positions close no group"
    if n == 158:
        W = tiny.cfg.sliding_window
        assert (n - W + 1) // 128 < (n + S - W) // 128
    close = next(p for p in range(n + S, n + S + HCA_RATIO) if (p + 1) % HCA_RATIO == 0)
    tokens = tiny.tie_free_ids(close + 1 + 2 * S, seed=11 + n)   # decode steps up to the close and a little past
    assert any((p + 1) % HCA_RATIO == 0 for p in range(n + S, len(tokens))), "no C128 close after the rewind"
    wrong = [(t + 1 + i) % tiny.cfg.vocab_size for i, t in enumerate(tokens[n:n + S])]
    rest = [S] + [1] * (len(tokens) - n - S)     # the corrected draft, then decode steps

    eng = tiny.engine(spec_slots=S, max_num_batched_tokens=512, max_num_seqs=2, num_pages=4)
    req = stepper.request(tokens[:n] + wrong)
    stepper.run(eng, req, [n])
    stepper.step(eng, [(req, S)])                 # writes ring rows, SWA keys and closed entries
    req.num_computed = n                          # rewind
    req.prompt_token_ids = list(tokens)
    rolled = stepper.run(eng, req, rest)

    clean_eng = tiny.engine(spec_slots=S, max_num_batched_tokens=512, max_num_seqs=2, num_pages=4)
    clean_req = stepper.request(tokens)
    stepper.run(clean_eng, clean_req, [n])
    clean = stepper.run(clean_eng, clean_req, rest)

    positions = range(n, len(tokens))
    h.assert_rows_close(rolled, clean, positions, "rollback vs never written")
    h.assert_rows_close(rolled, tiny.ref_logits(tokens)[n:], positions, "rollback vs reference")


def test_speculative_rollback_loop(tiny, h, stepper):
    """Speculative decoding's access pattern for 260 positions: every step writes S+1 positions
    (the last token and S drafts), keeps a random number of drafts and rewinds over the
    rejected ones (never more than S). Every kept position's logits equal the reference's."""
    tokens = tiny.tie_free_ids(300, seed=21)
    prompt, rng = 40, random.Random(0)
    eng = tiny.engine(spec_slots=S, max_num_batched_tokens=512, max_num_seqs=2, num_pages=4)
    req = stepper.request(tokens[:prompt])
    kept = {p: row for p, row in zip(range(prompt), stepper.run(eng, req, [prompt]))}
    rewinds = []
    while req.num_computed < len(tokens):
        n = req.num_computed
        width = min(S + 1, len(tokens) - n)
        accept = rng.randint(0, width - 1)           # drafts kept after the first (true) token
        drafts = [t if i <= accept else (t + 7) % tiny.cfg.vocab_size
                  for i, t in enumerate(tokens[n:n + width])]
        req.prompt_token_ids = tokens[:n] + drafts
        rows = stepper.step(eng, [(req, width)])[0]
        kept.update({n + i: rows[i] for i in range(accept + 1)})
        req.num_computed = n + accept + 1             # rewind over the rejected drafts
        rewinds.append(width - accept - 1)
    assert max(rewinds) == S and sum(r > 0 for r in rewinds) >= 30
    positions = sorted(kept)
    assert positions == list(range(len(tokens)))
    h.assert_rows_close(torch.stack([kept[p] for p in positions]), tiny.ref_logits(tokens), positions,
                        "speculative loop")


# ---- invariant 3: chunks keep what they read ---------------------------------------------
def test_chunk_boundaries_at_every_offset_mod_4_and_mod_128(tiny, h, stepper):
    """128 requests of the same 260 tokens, request r prefilled as [0, 128 + r) then
    [128 + r, 260): a chunk boundary at every offset mod 128 (hence mod 4) inside the second
    C128 group, with the C128 and C4 groups around it closed by the second chunk from ring
    rows plus fresh rows. All logits equal the reference's."""
    tokens = tiny.tie_free_ids(260, seed=31)
    ref = tiny.ref_logits(tokens)
    firsts = [HCA_RATIO + r for r in range(HCA_RATIO)]
    assert sorted(b % HCA_RATIO for b in firsts) == list(range(HCA_RATIO))
    group = 32
    eng = tiny.engine(max_num_batched_tokens=len(tokens) * group, max_num_seqs=group, num_pages=2 * group)
    worst = 0.0
    for g in range(0, len(firsts), group):
        reqs = [stepper.request(tokens) for _ in firsts[g:g + group]]
        first = stepper.step(eng, list(zip(reqs, firsts[g:g + group])))
        second = stepper.step(eng, [(r, len(tokens) - b) for r, b in zip(reqs, firsts[g:g + group])])
        for b, a, z in zip(firsts[g:g + group], first, second):
            rows = torch.cat([a, z])
            worst = max(worst, h.assert_rows_close(rows, ref, range(len(tokens)), f"boundary at {b}"))
        for r in reqs:
            eng.cache.release(r)
    assert eng.cache.pages.num_free == eng.plan.num_pages


# ---- invariant 5: path invariance (batch) ------------------------------------------------
def test_batch_invariance(tiny, h, stepper):
    """A request's logits are the same alone and in the middle of a batch of 7 others (other
    tokens, lengths and chunk sizes, joining and leaving), with its own chunks unchanged."""
    tokens = tiny.tie_free_ids(300, seed=41)
    mine = [37, 37, 26] + [1] * 200
    cfg = dict(max_num_batched_tokens=4096, max_num_seqs=8, num_pages=32)

    eng = tiny.engine(**cfg)
    alone_req = stepper.request(tokens)
    alone = [stepper.step(eng, [(alone_req, n)])[0] for n in mine]

    eng = tiny.engine(**cfg)
    rng = random.Random(1)
    me = stepper.request(tokens)
    others = [stepper.request(tiny.ids(rng.randint(120, 330), seed=500 + i)) for i in range(7)]
    batched = []
    for n in mine:
        live = [o for o in others if o.num_computed < o.num_tokens]
        work = [(o, min(rng.choice([1, 1, 2, 5, 17, 40]), o.num_tokens - o.num_computed)) for o in live]
        k = len(work) // 2
        rows = stepper.step(eng, work[:k] + [(me, n)] + work[k:])
        batched.append(rows[k])
        for o in live:
            if o.num_computed == o.num_tokens:
                eng.cache.release(o)
    positions = range(len(tokens))
    h.assert_rows_close(torch.cat(batched), torch.cat(alone), positions, "batched vs alone")
    h.assert_rows_close(torch.cat(batched), tiny.ref_logits(tokens), positions, "batched vs reference")


# ---- abort and preemption free every page ------------------------------------------------
def test_abort_frees_every_page(tiny, h):
    """Abort a waiting request, one in the middle of its prefill and one decoding: each holds
    nothing right after, the others carry on unchanged, and once idle the allocators are back
    at their initial free counts."""
    eng = tiny.engine(max_num_batched_tokens=48, max_num_seqs=4, num_pages=8)
    initial = h.free_counts(eng)
    ids = tiny.tie_free_ids(300, seed=51)
    eng.add_request("waiting", ids[:30], greedy(20))
    eng.abort("waiting")
    assert h.free_counts(eng) == initial and not eng.has_unfinished()

    eng.add_request("decoding", ids[:8], greedy(50))
    eng.add_request("keep", ids[100:112], greedy(40))
    eng.add_request("prefilling", ids[:290], greedy(5))
    reqs = {r.request_id: r for r in eng.scheduler.waiting}
    for _ in range(3):
        eng.step()
    assert reqs["decoding"].output_token_ids and 0 < reqs["prefilling"].num_computed < 290
    held = {rid: eng.cache.seq(r) for rid, r in reqs.items()}
    assert held["decoding"].pages and held["prefilling"].pages and held["prefilling"].swa_pages
    for rid in ("decoding", "prefilling"):
        eng.abort(rid)
        r = reqs[rid]
        assert r.status is Status.ABORTED and r.finish_reason == "abort"
        assert eng.cache.seq(r).holds_nothing
        h.assert_cache_accounting(eng)
    eng.abort("prefilling")        # twice, and unknown ids: no-ops
    eng.abort("no-such-request")
    done = run_to_completion(eng, h)
    assert set(done) == {"keep"}
    assert h.free_counts(eng) == initial

    solo = tiny.engine(max_num_batched_tokens=48, max_num_seqs=4, num_pages=8)
    solo.add_request("keep", ids[100:112], greedy(40))
    assert run_to_completion(solo, h)["keep"] == done["keep"]


def test_preemption_frees_every_page(tiny, h):
    """Three requests that need 6 history pages together on a cache of 4: the newest are
    preempted (by recompute) and hold nothing while they wait; all finish with the reference's
    greedy tokens and the allocators end at their initial free counts."""
    eng = tiny.engine(max_num_batched_tokens=64, max_num_seqs=4, num_pages=4)
    initial = h.free_counts(eng)
    prompts = [tiny.tie_free_ids(150, seed=61 + i) for i in range(3)]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(250))
    reqs = list(eng.scheduler.waiting)
    done = run_to_completion(eng, h)     # checks after each step that waiting requests hold nothing
    assert sum(r.num_preemptions for r in reqs) >= 1, "the test did not exercise preemption"
    assert reqs[0].num_preemptions == 0, "the oldest request was preempted"
    assert h.free_counts(eng) == initial
    compared = 0
    for i, p in enumerate(prompts):
        tokens = done[f"r{i}"]
        assert len(tokens) == 250
        ties = tiny.ties(p + tokens)    # greedy tokens are the model's own: ties can occur
        compared += h.check_greedy_against_reference(tokens, tiny.ref_logits(p + tokens), len(p),
                                                     ties[0] if ties else None)
    assert compared >= 500, f"only {compared} of 750 greedy tokens compared before a tie"
