"""Invariant 5 (path invariance, docs/architecture.md "Cache") on every prefix-cache path: a
request resumed from a checkpoint gives the logits (within the fp32 tolerance) of a cold engine
(no prefix cache, one whole prefill): hits at every page boundary, hits followed by a different
suffix, hits into prompts ending at every offset 1..255 past the boundary, hits admitted while
other requests prefill in the same step, and re-prefill after eviction. Teacher forcing
(tests/engine/conftest.py) keeps every logits row the runner produced."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def cold_rows(tiny, h, forcer, tokens: list[int]):
    """The cold engine's logits of every position of `tokens` (one whole prefill)."""
    eng = tiny.engine(max_num_batched_tokens=2048, max_num_seqs=2, num_pages=8, enable_prefix_caching=False)
    _, rows = forcer.run(eng, [h.Forced("cold", tokens)]).rows("cold")
    return rows


def tie_free_suffix(tiny, prefix: list[int], n: int, seed: int) -> list[int]:
    """`n` random tokens after `prefix` with no indexer near-tie anywhere in prefix + suffix."""
    for attempt in range(20):
        suffix = tiny.ids(n, seed + 7919 * attempt)
        if not tiny.ties(prefix + suffix):
            return suffix
    raise AssertionError("no tie-free suffix found")


def first_start(run, rid: str) -> int:
    return next(start for step in run.steps for r, start, _ in step if r == rid)


def checkpoint_ends(engine) -> list[int]:
    return sorted(n.end for n in engine.cache.prefix._lru if n.checkpoint is not None)


@pytest.mark.parametrize("model", ["tiny", "tiny_w128"])
def test_cold_vs_hit_at_every_page_boundary_and_different_suffixes(request, h, forcer, model):
    """A first request of 1000 tokens prefilled in chunks of 256 leaves checkpoints at 256, 512
    and 768. Then, per boundary L, a request of the same tokens to L + 37 and one whose tokens
    after L differ resume at L (their first chunk starts there) and decode 20 forced tokens:
    every logits row equals the cold engine's for its own sequence. W = 32 and V4's W = 128."""
    tiny = request.getfixturevalue(model)
    tokens = tiny.tie_free_ids(1000, seed=201)
    eng = tiny.engine(max_num_batched_tokens=256, max_num_seqs=8, num_pages=40)
    forcer.run(eng, [h.Forced("first", tokens, all_logits=False)])
    assert checkpoint_ends(eng) == [256, 512, 768]
    specs, sequences = [], {}
    for L in (256, 512, 768):
        sequences[f"same{L}"] = tokens[:L + 57]
        sequences[f"diff{L}"] = tokens[:L] + tie_free_suffix(tiny, tokens[:L], 57, seed=300 + L)
    for rid, seq in sequences.items():
        L = int(rid[4:])
        specs.append(h.Forced(rid, seq[:L + 37], seq[L + 37:], all_logits=False))
    run = forcer.run(eng, specs)
    for spec in specs:
        L = int(spec.rid[4:])
        assert first_start(run, spec.rid) == L, f"{spec.rid} did not resume at {L}"
        positions, rows = run.rows(spec.rid)
        assert positions == list(range(L + 36, L + 57))
        h.assert_rows_close(rows, cold_rows(tiny, h, forcer, sequences[spec.rid])[positions], positions,
                            f"{spec.rid} vs cold")
    h.assert_cache_accounting(eng)


def test_hit_into_prompts_ending_at_every_offset_past_the_boundary(tiny, h, forcer):
    """255 requests of the first 512 + k tokens of one sequence (k = 1..255: every offset mod 4
    and mod 128 past the page boundary, so the prompt ends inside every kind of open group),
    all resumed from the one checkpoint at 512 in the same steps: the logits of each one's last
    prompt position equal the cold engine's."""
    tokens = tiny.tie_free_ids(800, seed=211)
    eng = tiny.engine(max_num_batched_tokens=8192, max_num_seqs=64, num_pages=80)
    forcer.run(eng, [h.Forced("first", tokens[:600], all_logits=False)])
    assert checkpoint_ends(eng) == [512]
    specs = [h.Forced(f"k{k}", tokens[:512 + k], all_logits=False) for k in range(1, 256)]
    run = forcer.run(eng, specs)
    assert len(run.steps) <= 8, "the hits did not run side by side"
    cold = cold_rows(tiny, h, forcer, tokens[:767])
    got = []
    for k in range(1, 256):
        assert first_start(run, f"k{k}") == 512
        positions, rows = run.rows(f"k{k}")
        assert positions == [512 + k - 1]
        got.append(rows[0])
    import torch
    h.assert_rows_close(torch.stack(got), cold[512:767], range(512, 767), "offsets past 512 vs cold")
    h.assert_cache_accounting(eng)


def test_hits_admitted_while_other_requests_prefill(tiny, h, forcer):
    """Two requests that resume at 512 join a step in which two cold requests (other tokens) are
    in the middle of their chunked prefills, under a 600-token budget: all four match the cold
    engine, the cold ones at every position."""
    tokens = tiny.tie_free_ids(760, seed=221)
    others = [tiny.tie_free_ids(700, seed=222 + i) for i in range(2)]
    eng = tiny.engine(max_num_batched_tokens=600, max_num_seqs=8, num_pages=40)
    forcer.run(eng, [h.Forced("first", tokens[:600], all_logits=False)])
    specs = [h.Forced("c0", others[0][:650], others[0][650:], arrival=0),
             h.Forced("c1", others[1][:600], others[1][600:], arrival=0),
             h.Forced("h0", tokens[:700], tokens[700:760], arrival=1, all_logits=False),
             h.Forced("h1", tokens[:530], tokens[530:560], arrival=1, all_logits=False)]
    run = forcer.run(eng, specs)
    mixed = [step for step in run.steps
             if any(r.startswith("h") and s == 512 for r, s, _ in step)
             and any(r.startswith("c") and s + n <= 650 and n > 1 for r, s, n in step)]
    assert mixed, f"no step mixed a resume with a cold prefill: {run.steps[:6]}"
    for spec in specs:
        positions, rows = run.rows(spec.rid)
        h.assert_rows_close(rows, cold_rows(tiny, h, forcer, spec.tokens)[positions], positions,
                            f"{spec.rid} vs cold")


def test_eviction_then_re_prefill(tiny, h, forcer):
    """On a cache of 4 pages, a request's cached pages are evicted by a later one that needs the
    room; the same prompt sent again is computed cold (no hit left) and matches the cold engine."""
    a, b = tiny.tie_free_ids(700, seed=231), tiny.tie_free_ids(1000, seed=232)
    eng = tiny.engine(max_num_batched_tokens=512, max_num_seqs=2, num_pages=4)
    forcer.run(eng, [h.Forced("a", a[:650], a[650:680], all_logits=False)])
    assert checkpoint_ends(eng) == [256, 512] and eng.cache.prefix.num_pages == 2
    forcer.run(eng, [h.Forced("b", b[:900], b[900:1000], all_logits=False)])
    assert not eng.cache.prefix.match(a[:650], 649), "a's pages were not evicted"
    run = forcer.run(eng, [h.Forced("a2", a[:650], a[650:680], all_logits=False)])
    assert first_start(run, "a2") == 0
    positions, rows = run.rows("a2")
    h.assert_rows_close(rows, cold_rows(tiny, h, forcer, a[:680])[positions], positions, "re-prefill vs cold")
    h.assert_cache_accounting(eng)
