"""Acceptance of the engine against transformers' DeepseekV4ForCausalLM (docs/architecture.md, Engine).

Teacher forcing: dsv4's per-step logits of a prompt + a known continuation (the tokens fed
instead of sampled ones) must equal the reference's full-sequence logits within 1e-4 of the
reference's scale, whatever the chunking and whatever else is in the batch (docs/architecture.md, "Cache").
Free run: greedy tokens equal the reference's greedy decoding wherever its top-2 margin exceeds
1e-3. Sequences are checked free of indexer top-k near-ties (see conftest.py: where two
compressed entries score equal at the top-k boundary, which one is kept is arbitrary, in the
reference too).
"""
from __future__ import annotations

import pytest

from dsv4.config import CSA_RATIO, HCA_RATIO
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, CONTINUATION = 40, 400
TOTAL = PROMPT + CONTINUATION


def assert_long_enough(cfg, total: int) -> None:
    """The sequence crosses many C4 and several C128 groups, and the window many times."""
    assert cfg.index_n_heads >= 8, "fewer indexer heads make top-k ties (transformers disagrees with itself)"
    assert set(cfg.compress_ratios) >= {0, CSA_RATIO, HCA_RATIO}
    assert total // HCA_RATIO >= 3, "fewer than 3 C128 groups close"
    assert total // CSA_RATIO >= 100 and total // CSA_RATIO > 2 * cfg.index_topk, "top-k hardly selects"
    assert total // cfg.sliding_window >= 10, "the window is crossed fewer than 10 times"
    assert total > 256, "the sequence stays on one history page"


def compare_to_reference(tiny, h, run, spec, what: str) -> float:
    positions, ours = run.rows(spec.rid)
    ref = tiny.ref_logits(spec.tokens)
    # every position from the first one logits were asked for up to the last one is covered
    first = 0 if spec.all_logits else len(spec.prompt) - 1
    assert positions == list(range(first, len(spec.tokens))), f"{what}: missing logits rows"
    return h.assert_rows_close(ours, ref[positions], positions, what)


@pytest.fixture(scope="module")
def sequence(tiny):
    ids = tiny.tie_free_ids(TOTAL, seed=7)
    assert_long_enough(tiny.cfg, TOTAL)
    return ids


def test_teacher_forced_whole_prefill(tiny, h, forcer, sequence):
    """All 440 tokens in one prefill chunk: every position's logits."""
    spec = h.Forced("whole", sequence)
    run = forcer.run(tiny.engine(max_num_batched_tokens=512, max_num_seqs=2, num_pages=4), [spec])
    assert run.steps == [[("whole", 0, TOTAL)]]
    compare_to_reference(tiny, h, run, spec, "whole prefill")


def test_teacher_forced_decode_after_whole_prefill(tiny, h, forcer, sequence):
    """Prompt of 40 in one chunk, then 400 decode steps of one forced token each."""
    spec = h.Forced("decode", sequence[:PROMPT], sequence[PROMPT:])
    run = forcer.run(tiny.engine(max_num_batched_tokens=512, max_num_seqs=2, num_pages=4), [spec])
    assert run.steps[0] == [("decode", 0, PROMPT)]
    assert [s for step in run.steps[1:] for _, _, s in step] == [1] * CONTINUATION
    compare_to_reference(tiny, h, run, spec, "decode after whole prefill")


@pytest.mark.parametrize("chunk", [1, 3, 37, 129])
def test_teacher_forced_chunked_prefill(tiny, h, forcer, sequence, chunk):
    """A 300-token prompt prefilled in chunks of `chunk` tokens (every alignment the chunk size
    produces), then forced decode steps past the next C128 close (at 384) and 8 more."""
    prompt, end = 300, 3 * HCA_RATIO + 8
    spec = h.Forced("chunked", sequence[:prompt], sequence[prompt:end])
    run = forcer.run(tiny.engine(max_num_batched_tokens=chunk, max_num_seqs=2, num_pages=4), [spec])
    prefill = [(start, n) for step in run.steps for _, start, n in step if start < prompt]
    want = [(a, min(chunk, prompt - a)) for a in range(0, prompt, chunk)]
    assert prefill == want, "the scheduler did not split the prompt into chunks of the budget"
    compare_to_reference(tiny, h, run, spec, f"chunked prefill ({chunk})")


@pytest.mark.parametrize("spec_slots", [0, 3])
def test_teacher_forced_real_window(tiny_w128, h, forcer, spec_slots):
    """V4's window of 128 (one SWA page; W + S spans two or three): chunked prefill of 300 in
    chunks of 37, then 300 forced decode steps."""
    tiny = tiny_w128
    ids = tiny.tie_free_ids(600, seed=9)
    assert tiny.cfg.sliding_window == 128 and len(ids) // 128 >= 4
    spec = h.Forced("w128", ids[:300], ids[300:])
    run = forcer.run(tiny.engine(max_num_batched_tokens=37, max_num_seqs=2, num_pages=4, spec_slots=spec_slots),
                     [spec])
    compare_to_reference(tiny, h, run, spec, f"window 128, S={spec_slots}")


MIXED_PROMPTS = [3, 17, 40, 64, 100, 129, 200, 257]
MIXED_TOTALS = [300, 280, 320, 260, 350, 290, 380, 440]
MIXED_ARRIVALS = [0, 0, 2, 5, 9, 14, 20, 27]


def test_teacher_forced_mixed_batch(tiny, h, forcer):
    """8 requests of different lengths arriving at different steps, under a 64-token budget:
    steps mix decodes with prefill chunks of changing sizes and alignments. Each request's
    logits equal its own reference's."""
    assert len(set(MIXED_TOTALS)) == 8 and sum(n > 2 * HCA_RATIO for n in MIXED_TOTALS) >= 6
    specs = []
    for i, (p, n, t) in enumerate(zip(MIXED_PROMPTS, MIXED_TOTALS, MIXED_ARRIVALS)):
        ids = tiny.tie_free_ids(n, seed=100 + i)
        # odd ones without prompt logits: their prefill chunks ask the runner for no rows but the last
        specs.append(h.Forced(f"r{i}", ids[:p], ids[p:], arrival=t, all_logits=i % 2 == 0))
    run = forcer.run(tiny.engine(max_num_batched_tokens=64, max_num_seqs=8, num_pages=16), specs)

    prompt_of = {s.rid: len(s.prompt) for s in specs}
    mixed = [st for st in run.steps
             if any(start >= prompt_of[r] for r, start, _ in st) and any(start < prompt_of[r] for r, start, _ in st)]
    assert len(mixed) >= 5, "too few steps mixed decodes with prefill chunks"
    assert max(len(st) for st in run.steps) == 8, "never all 8 requests in one step"
    split = {r for st in run.steps for r, start, n in st if 0 < start < prompt_of[r]}
    assert len(split) >= 3, "too few prompts were prefilled in more than one chunk"
    for s in specs:
        compare_to_reference(tiny, h, run, s, f"mixed batch {s.rid}")


def run_greedy(engine, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request("g", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens = []
    for _ in range(max_tokens + len(prompt) + 10):
        for out in engine.step():
            tokens = out.token_ids
            if out.finished:
                assert out.finish_reason == "length"
                return tokens
    raise AssertionError("greedy run did not finish")


def test_greedy_free_run_matches_reference(tiny, h, sequence):
    """400 greedy tokens after a 40-token prompt (chunked prefill, batched decode): each one
    is the reference's greedy choice given the same prefix, wherever its top-2 margin > 1e-3."""
    prompt = sequence[:PROMPT]
    tokens = run_greedy(tiny.engine(max_num_batched_tokens=16, max_num_seqs=2, num_pages=4), prompt, CONTINUATION)
    assert len(tokens) == CONTINUATION
    ties = tiny.ties(prompt + tokens)   # the free run's tokens are the model's: ties are not avoidable
    compared = h.check_greedy_against_reference(tokens, tiny.ref_logits(prompt + tokens), PROMPT,
                                                ties[0] if ties else None)
    assert compared >= 300, f"only {compared} greedy tokens compared before a near-tie"


def test_greedy_equals_reference_generate(tiny, h, sequence):
    """The engine's greedy tokens equal transformers' `generate` (its own cached decoding) for
    150 tokens after a 120-token prompt: decode crosses the C128 closes at 128 and 256 and the
    window several times."""
    prompt, new = sequence[:120], 150
    want = tiny.ref_generate(prompt, new)
    got = run_greedy(tiny.engine(max_num_batched_tokens=32, max_num_seqs=2, num_pages=4), prompt, new)
    assert len(got) == new
    if len(want) < new:   # transformers stops at EOS; the engine ignores it (ignore_eos)
        assert want[-1] == tiny.cfg.eos_token_id
        got = got[:len(want)]
    new = len(want)
    ties = tiny.ties(prompt + want)
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), new)
    if same < new:   # allowed only at a near-tie of the reference, after which the runs part
        pos = len(prompt) - 1 + same
        row = tiny.ref_logits(prompt + want)[pos]
        assert h.top2_margin(row) <= h.MARGIN or (ties and ties[0] <= pos), \
            f"token {same}: engine {got[same]}, reference generate {want[same]}"
    assert same >= 100, f"only {same} tokens compared"
