"""MTP drafts after a prefix-cache hit (invariant 5, docs/architecture.md "Cache"): a request
resumed at page boundary L drafts from the MTP layer's SWA keys of [L - W, L) that the
checkpoint packed, so the request that wrote the checkpoint must have computed them, even
when its prompt runs more than W past L or it never drafts itself (max_tokens 1). The resumed
request then drafts exactly what it drafts alone, and a seeded sampling request (whose
tokens depend on its drafts, docs/speculative.md) gives the same tokens."""
from __future__ import annotations

import pytest

from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
SPEC = {"method": "mtp", "num_speculative_tokens": 2}


def record_drafts(eng) -> dict[str, list[list[int]]]:
    """request id -> the drafts of each of its proposals."""
    seen, propose = {}, eng.spec.proposer.propose

    def spy(works, hidden, batch_of):
        out = propose(works, hidden, batch_of)
        for w, (drafts, _) in zip([w for w in works if w.num_drafts], out):
            seen.setdefault(w.request.request_id, []).append(drafts.tolist())
        return out
    eng.spec.proposer.propose = spy
    return seen


@pytest.mark.parametrize("writer_tokens", [1, 8], ids=["writer-never-drafts", "writer-drafts"])
@pytest.mark.parametrize("budget", [33, 2048], ids=["chunked", "whole"])
def test_resumed_request_drafts_as_alone(tiny, h, writer_tokens, budget):
    W = tiny.cfg.sliding_window
    prompt = tiny.ids(600, seed=7)            # the writer's prompt ends > W past the boundary 512
    resumed = prompt[:512 + W // 2]          # reads MTP keys of [512 - W // 2, 512) from the checkpoint
    params = {"greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              "seeded": SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)}
    cfg = dict(max_num_batched_tokens=budget, max_num_seqs=2, num_pages=8, speculative_config=SPEC)

    eng = tiny.engine(**cfg)
    drafts = record_drafts(eng)
    writer = h.Req("writer", prompt, SamplingParams(temperature=0.0, max_tokens=writer_tokens, ignore_eos=True))
    got = h.drive(eng, [writer] + [h.Req(rid, resumed, p, arrival=200) for rid, p in params.items()], check=True)
    assert all(got[rid].num_cached_tokens == 512 for rid in params), "no prefix hit at 512"

    for rid, p in params.items():
        want_drafts, want = alone_run(tiny, h, cfg, rid, resumed, p)
        assert drafts[rid] == want_drafts, rid
        assert got[rid].token_ids == want.token_ids, rid


_ALONE: dict = {}


def alone_run(tiny, h, cfg: dict, rid: str, prompt: list[int], params: SamplingParams):
    """The request alone on a fresh engine of `cfg` without the prefix cache: (its drafts, its
    output). It does not depend on the writer, so the two writer cases of a budget share it."""
    key = (repr(sorted(cfg.items())), rid, tuple(prompt), repr(params))
    if key not in _ALONE:
        alone = tiny.engine(**cfg, enable_prefix_caching=False)
        alone_drafts = record_drafts(alone)
        want = h.drive(alone, [h.Req(rid, prompt, params)])[rid]
        _ALONE[key] = (alone_drafts[rid], want)
    return _ALONE[key]
