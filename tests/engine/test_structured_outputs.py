"""Structured outputs on the offline engine and the demo model (docs/architecture.md,
"Structured outputs"): every constraint kind yields output that parses and validates, 50
prompts each, with async scheduling on (sampling waits for the previous step's tokens) and
with MTP drafts checked against the grammar; unconstrained requests in the same batch keep
their tokens (invariant 5); a bad constraint fails its request alone."""
from __future__ import annotations

import json
import re
import threading
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{3,6}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]
EBNF = 'root ::= "(" [a-z]+ ("," [a-z]+)? ")"'
EBNF_RE = r"\([a-z]+(,[a-z]+)?\)"
KINDS = {"json": StructuredOutputs(json=json.dumps(SCHEMA)), "regex": StructuredOutputs(regex=REGEX),
         "choice": StructuredOutputs(choice=CHOICES), "grammar": StructuredOutputs(grammar=EBNF)}
N = 50


@pytest.fixture(scope="module")
def engine_of(demo_engines):
    return lambda **kw: demo_engines(max_num_seqs=256, **kw)


@pytest.fixture(scope="module")
def run(h):
    """run(engine, {request id: (prompt ids, params)}) -> request id -> output (all added at once)."""
    return lambda engine, requests: h.drive(engine, [h.Req(rid, ids, p) for rid, (ids, p) in requests.items()])


def prompts(engine: LLMEngine, n: int = N) -> list[list[int]]:
    return [engine.tokenizer.encode(f"Request {i}: describe item number {i * 7} briefly.") for i in range(n)]


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(EBNF_RE, text), text


def test_every_kind_validates_50_prompts_async(engine_of, run):
    eng = engine_of(async_scheduling="on")
    ps = prompts(eng)
    reqs = {f"{kind}-{i}": (p, SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.8, seed=i,
                                             structured=spec))
            for kind, spec in KINDS.items() for i, p in enumerate(ps)}
    done = run(eng, reqs)
    for rid, out in done.items():
        kind = rid.split("-")[0]
        assert out.finish_reason == "stop", (rid, out.text)
        check(kind, out.text)
    assert len(eng.grammars) == 0                          # every matcher dropped at finish


def test_json_object_is_an_object(engine_of, run):
    """Any JSON object: the demo model may nest forever, so outputs cut by max_tokens are left
    out; every finished one parses as an object."""
    eng = engine_of(async_scheduling="on")
    reqs = {f"o-{i}": (p, SamplingParams(max_tokens=32, temperature=1.0, seed=i,
                                         structured=StructuredOutputs(json_object=True)))
            for i, p in enumerate(prompts(eng))}
    done = run(eng, reqs)
    finished = [o for o in done.values() if o.finish_reason == "stop"]
    assert len(finished) >= N // 5
    for out in finished:
        assert isinstance(json.loads(out.text), dict), out.text


def test_unconstrained_requests_keep_their_tokens(engine_of, run):
    """Invariant 5: greedy requests without a constraint, batched with constrained ones, give the
    tokens of a run without any; constrained greedy tokens are the same with async on and off."""
    sync, async_ = engine_of(async_scheduling="off"), engine_of(async_scheduling="on")
    ps = prompts(sync, 4)
    plain = {f"p{i}": (p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for i, p in enumerate(ps)}
    alone = run(sync, plain)
    mixed = dict(plain)
    mixed.update({f"c{i}": (p, SamplingParams(max_tokens=30, temperature=0.0, structured=KINDS["json"]))
                  for i, p in enumerate(ps)})
    for eng in (sync, async_):
        got = run(eng, mixed)
        for rid in plain:
            assert got[rid].token_ids == alone[rid].token_ids, rid
        if eng is sync:
            constrained = {rid: got[rid].token_ids for rid in got if rid.startswith("c")}
    got = run(async_, {rid: v for rid, v in mixed.items() if rid.startswith("c")})
    assert {rid: o.token_ids for rid, o in got.items()} == constrained


def test_speculative_drafts_follow_the_grammar(engine_of, run):
    """MTP drafts are verified under the grammar (row j masked after drafts 1..j, the matcher
    rolled back): outputs validate, and greedy tokens equal those without speculation."""
    spec = engine_of(speculative_config='{"method": "mtp", "num_speculative_tokens": 3}')
    plain = engine_of(async_scheduling="off")
    ps = prompts(spec, 3)
    reqs = {f"{kind}-{i}": (p, SamplingParams(max_tokens=40, temperature=0.0, structured=s))
            for kind, s in KINDS.items() for i, p in enumerate(ps)}
    sampled = {f"{kind}-s{i}": (p, SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=s))
               for kind, s in KINDS.items() if kind in ("json", "regex") for i, p in enumerate(ps)}   # p/q
    with_drafts, without = run(spec, {**reqs, **sampled}), run(plain, reqs)
    for rid, out in with_drafts.items():
        assert out.finish_reason == "stop", (rid, out.text)
        check(rid.split("-")[0], out.text)
        if rid in reqs:
            assert out.token_ids == without[rid].token_ids, rid
    assert spec.spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("mode", ["off", "on"])     # on: the gate takes the token in masks.accept_batch
def test_thinking_gate_starts_the_constraint_after_think_end(engine_of, run, mode):
    eng = engine_of(async_scheduling=mode)
    think_end = eng.tokenizer.token_to_id("</think>")
    spec = StructuredOutputs(choice=CHOICES, after_think=True)
    # the logit bias makes the model close its reasoning at once: </think> then one of the choices
    out = run(eng, {"t": (prompts(eng, 1)[0], SamplingParams(max_tokens=20, temperature=0.0, structured=spec,
                                                             logit_bias={think_end: 100.0},
                                                             skip_special_tokens=False))})["t"]
    assert out.token_ids[0] == think_end
    assert out.text.split("</think>", 1)[1].replace("<｜end▁of▁sentence｜>", "") in CHOICES


def test_stop_string_ends_a_constrained_request(engine_of, run):
    """A stop string may cut the constrained output (the client asked for it); the matcher goes."""
    eng = engine_of(async_scheduling="on")
    ps = prompts(eng, 2)
    free = run(eng, {f"f{i}": (p, SamplingParams(max_tokens=30, temperature=0.0, structured=KINDS["json"]))
                     for i, p in enumerate(ps)})
    cut = run(eng, {f"f{i}": (p, SamplingParams(max_tokens=30, temperature=0.0, structured=KINDS["json"],
                                                stop=['"age"'])) for i, p in enumerate(ps)})
    for rid, out in cut.items():
        assert out.finish_reason == "stop" and out.stop_reason == '"age"'
        assert free[rid].text.startswith(out.text) and '"age"' in free[rid].text
    assert len(eng.grammars) == 0


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputs(regex="a("), "regex"), (StructuredOutputs(json='{"type": "object", "not": {}}'), "not"),
    (StructuredOutputs(grammar="root ::= foo"), "grammar"), (StructuredOutputs(json="{"), "JSON")])
def test_bad_constraint_fails_alone(engine_of, run, spec, words):
    eng = engine_of(async_scheduling="off")
    with pytest.raises(ValueError, match=words):
        eng.add_request("bad", prompts(eng, 1)[0], SamplingParams(max_tokens=4, structured=spec))
    assert "bad" not in eng.requests and eng.grammars.get("bad") is None
    out = run(eng, {"good": (prompts(eng, 1)[0], SamplingParams(max_tokens=8, structured=KINDS["choice"]))})
    assert out["good"].text in CHOICES


def test_grammar_cache_is_a_bounded_lru(engine_of):
    from dsv4.structured.compiler import GrammarCache
    eng = engine_of(async_scheduling="off")
    cache = GrammarCache(eng.tokenizer, eng.cfg.vocab_size, eng.eos_token_id, capacity=2)
    a, b, c = (StructuredOutputs(choice=[w]) for w in ("a", "b", "c"))
    first = cache.get(a)
    assert cache.get(a) is first and cache.hits == 1
    cache.get(b), cache.get(c)
    assert len(cache) == 2 and cache.get(a) is not first       # a was evicted, compiled again


def step_mask(grammars, rid: str) -> torch.Tensor:
    with torch.inference_mode():
        return grammars.step_masks([rid]).result().bitmask.clone()


def test_draft_masks_roll_the_matcher_back(engine_of):
    eng = engine_of(async_scheduling="off")
    grammars = eng._grammars()
    grammars.add("x", StructuredOutputs(regex="ab+c"))
    ids = [eng.tokenizer.encode(ch)[0] for ch in "abbc"]
    before = step_mask(grammars, "x")
    mask = grammars.verify_masks([("x", ids[:3] + [ids[0]])])   # the last draft ("a") is refused
    assert mask.rows.tolist() == [0, 1, 2, 3]                          # row 4 (past the refused draft): free
    after_ab = mask.bitmask[2]
    assert not (after_ab[ids[0] // 32] >> (ids[0] % 32)) & 1            # "a" not allowed after "ab"
    assert torch.equal(step_mask(grammars, "x"), before)               # state rolled back
    grammars.drop("x")


def test_masked_fill_matches_xgrammar_on_the_rows_it_names():
    """apply_grammar_mask reads xgrammar's bit layout: the same -inf entries as xgrammar's own
    apply on the masked rows; the other rows are untouched."""
    import xgrammar
    from dsv4.engine.sampler import apply_grammar_mask
    from dsv4.structured.masks import GrammarMask
    vocab = 100                                       # not a multiple of 32: the last word is partial
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(3, vocab)
    ours = logits.clone()
    apply_grammar_mask(ours, GrammarMask(torch.tensor([0, 2]), bitmask))
    theirs = logits[[0, 2]].clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
    assert torch.equal(ours[[0, 2]], theirs) and torch.equal(ours[1], logits[1])
    assert torch.isinf(ours[[0, 2]]).any()


def test_masked_fill_ands_the_special_token_filter_in():
    """With `keep` (the special-token filter), given as the bit selectors made once
    (masks.keep_bits) or made in the call: the same -inf entries as xgrammar's apply of
    bitmask & keep, in place and on named rows."""
    import xgrammar
    from dsv4.engine.sampler import apply_grammar_mask
    from dsv4.structured.masks import GrammarMask, keep_bits
    vocab, gen = 100, torch.Generator().manual_seed(2)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    keep = torch.randint(-2**31, 2**31 - 1, (4,), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab)
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask & keep, vocab_size=vocab)
    for bits in (None, keep_bits(keep, "cpu")):
        for rows, covers_all in ((torch.arange(3), True), (torch.tensor([0, 2]), False)):
            ours = logits.clone()
            apply_grammar_mask(ours, GrammarMask(rows, bitmask[rows], covers_all, keep, bits))
            assert torch.equal(ours[rows], theirs[rows]), (bits is None, covers_all)
            assert covers_all or torch.equal(ours[1], logits[1])


def test_ignore_eos_after_the_grammar_ends_allows_eos_only(engine_of, run):
    """A grammar that has ended (its EOS taken) masks to EOS alone: with ignore_eos the request
    runs to max_tokens on EOS (xgrammar itself refuses to fill a terminated matcher)."""
    eng = engine_of(async_scheduling="on")
    reqs = {f"e{i}": (p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, structured=KINDS["choice"]))
            for i, p in enumerate(prompts(eng, 3))}
    for rid, out in run(eng, reqs).items():
        assert out.finish_reason == "length" and out.text in CHOICES, (rid, out.text)
        first_eos = out.token_ids.index(eng.eos_token_id)
        assert set(out.token_ids[first_eos:]) == {eng.eos_token_id} and len(out.token_ids) == 8


def test_mask_fill_overlaps_the_step(engine_of, monkeypatch, run):
    """Order of the host's work in a decode step with async scheduling: the next step is
    scheduled and its launch begins (inputs built and uploaded); when its forward first reads the
    step in flight's tokens, the fill started by the step before is joined and the step in flight
    sampled, then that forward is launched (it takes those tokens on the device); the previous step's tokens
    are read back and taken by the gates, the fill of the launched step's mask starts (on the
    fill threads for a batch of THREAD_MIN_ROWS or more, whose matchers accept those tokens first)
    and the tokens are appended while it runs, and it keeps running through the next schedule.
    Tokens equal a run with async scheduling off."""
    from dsv4.structured import masks
    from dsv4.structured.matcher import RequestGrammar
    monkeypatch.setattr(masks, "HANDOFF_WAIT_S", None)      # wait for the worker: no inline fallback
    eng = engine_of(async_scheduling="on")
    n = masks.THREAD_MIN_ROWS
    reqs = {f"o{i}": (p, SamplingParams(max_tokens=6, temperature=0.0, structured=KINDS["json"]))
            for i, p in enumerate(prompts(eng, n))}
    run(eng, {"warm": reqs["o0"]})                     # eng.grammars exists from here on
    events, fill_threads, accept_threads = [], [], []

    def record(name, fn):
        def wrapped(*a, **kw):
            events.append(name)
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(eng.scheduler, "schedule", record("schedule", eng.scheduler.schedule))
    monkeypatch.setattr(eng.runner, "execute", record("execute", eng.runner.execute))
    monkeypatch.setattr(eng, "_append", record("append", eng._append))
    monkeypatch.setattr(eng, "sampler", record("sample", eng.sampler))
    monkeypatch.setattr(RequestGrammar, "accept", record("accept-one", RequestGrammar.accept))
    monkeypatch.setattr(masks, "owed_tokens", record("gates", masks.owed_tokens))

    def batch_accept(fn):
        def accept(*a):
            accept_threads.append(threading.current_thread().name)
            return fn(*a)
        return accept
    monkeypatch.setattr(masks, "_batch_accept", batch_accept(masks._batch_accept))
    filler = eng.grammars.masks
    monkeypatch.setattr(filler, "start", record("fill-start", filler.start))
    monkeypatch.setattr(masks.PendingMask, "result", record("fill-join", masks.PendingMask.result))

    def recorded(batch_fill):
        def fill(*a):
            fill_threads.append(threading.current_thread().name)
            return batch_fill(*a)
        return SimpleNamespace(batch_fill_next_token_bitmask=fill)
    monkeypatch.setattr(filler, "batches", [recorded(b.batch_fill_next_token_bitmask) for b in filler.batches])
    got = run(eng, reqs)

    steady = ["schedule", "execute", "fill-join", "sample", "fill-start", "gates"] + ["append"] * n
    text = " ".join(events)
    assert text.count(" ".join(steady)) >= 3, text      # the decode steps between prefill and the end
    assert fill_threads and all(name.startswith("dsv4-grammar-masks") for name in fill_threads)
    on_threads = [name.startswith("dsv4-grammar-masks") for name in accept_threads]
    assert sum(on_threads) >= 3                 # the decode steps: the matchers accept on the fill threads
    monkeypatch.undo()
    sync = run(engine_of(async_scheduling="off"), reqs)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in sync.items()}


@pytest.mark.parametrize("handoff,fill_threads", [(None, 1), (0.0, 1), (None, 3), (0.0, 3)])
def test_mask_filler_reuses_one_buffer_and_matches_xgrammar(engine_of, monkeypatch, handoff, fill_threads):
    """Threaded and inline fills give xgrammar's own per-matcher masks (with the special-token
    filter the sampler ANDs in) in one buffer reused from step to step; no constrained row -> no
    mask at all. handoff None: the fill threads always fill; 0: a slice no thread has begun is
    taken back by result(). fill_threads: threads filling a slice of the rows each (3: three
    slices of at least THREAD_MIN_ROWS rows)."""
    from dsv4.structured import masks
    from dsv4.structured.masks import THREAD_MIN_ROWS
    monkeypatch.setattr(masks, "HANDOFF_WAIT_S", handoff)
    monkeypatch.setattr(masks, "FILL_THREADS", fill_threads)
    eng = engine_of(async_scheduling="off")
    grammars = eng._grammars()
    ids = [f"m{i}" for i in range(3 * THREAD_MIN_ROWS + 2)]
    for i, rid in enumerate(ids):
        grammars.add(rid, KINDS["json"] if i % 2 else KINDS["regex"])
    for i, rid in enumerate(ids):                       # matchers in different states
        for t in eng.tokenizer.encode('{"name"' if i % 2 else "abc")[:i % 3 + 1]:
            grammars.get(rid).accept(t)
    try:
        with torch.inference_mode():
            assert grammars.step_masks(["none", "other"]) is None
            pointers = set()
            for rows in (ids, [None, *ids[:3]], ids):          # threaded, inline (with a free row), threaded
                mask = grammars.step_masks(rows).result()
                live = [r for r in rows if r is not None]
                want = torch.zeros(len(live), mask.bitmask.shape[1], dtype=torch.int32)
                for n, rid in enumerate(live):
                    grammars.get(rid).matcher.fill_next_token_bitmask(want, n)
                assert torch.equal(mask.bitmask, want) and mask.keep is grammars.keep
                assert mask.rows.tolist() == [i for i, r in enumerate(rows) if r is not None]
                assert mask.covers_all == (None not in rows)
                pointers.add(mask.bitmask.data_ptr())
            assert len(pointers) == 1
    finally:
        for rid in ids:
            grammars.drop(rid)


def test_owed_tokens_reach_every_matcher_through_the_fill_threads(engine_of, monkeypatch):
    """A step's tokens are accepted by the fill threads for the rows they fill, on the caller for
    a grammar outside the step, and on the caller for every row when one is the stop token (its
    grammar ends: an EOS-only row)."""
    from dsv4.structured import masks
    monkeypatch.setattr(masks, "HANDOFF_WAIT_S", None)      # the fill threads take every slice
    eng = engine_of(async_scheduling="off")
    grammars = eng._grammars()
    ids = [f"owed{i}" for i in range(2 * masks.THREAD_MIN_ROWS)]
    for rid in ids:
        grammars.add(rid, KINDS["choice"])
    may, be = eng.tokenizer.encode("maybe")
    gs = [grammars.get(rid) for rid in ids]

    def allows(mask_row, token):
        return bool((int(mask_row[token // 32]) >> (token % 32)) & 1)
    try:
        with torch.inference_mode():
            first = grammars.step_masks(ids).result().bitmask.clone()
            assert not allows(first[0], be)
            slices, back = grammars.masks.slices, grammars.masks.taken_back
            mask = grammars.step_masks(ids[1:], [(g, may) for g in gs]).result()    # ids[0] is not in the step
            assert grammars.masks.slices > slices and grammars.masks.taken_back == back
            assert all(allows(row, be) for row in mask.bitmask)
            alone = torch.zeros(1, first.shape[1], dtype=torch.int32)
            gs[0].fill(alone, 0)
            assert allows(alone[0], be)                             # accepted on the caller
            grammars.step_masks(ids, [(g, be) for g in gs]).result()
            ended = grammars.step_masks(ids, [(g, eng.eos_token_id) for g in gs]).result()
            assert all(g.finished for g in gs)
            assert all(torch.equal(row, grammars.end_row) for row in ended.bitmask)
    finally:
        for rid in ids:
            grammars.drop(rid)


def test_masked_fill_in_place_when_every_row_has_a_grammar():
    import xgrammar
    from dsv4.engine.sampler import apply_grammar_mask
    from dsv4.structured.masks import GrammarMask
    vocab = 100
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(3, vocab)
    ours, theirs = logits.clone(), logits.clone()
    apply_grammar_mask(ours, GrammarMask(torch.arange(3), bitmask, covers_all=True))
    xgrammar.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab)
    assert torch.equal(ours, theirs) and torch.isinf(ours).any()


def test_deferred_sampling_through_ends_aborts_and_stops(engine_of, monkeypatch, h):
    """With async scheduling a constrained step is sampled only once the next one is scheduled,
    its mask filled on the worker meanwhile. Through that order: requests ending by their grammar
    (EOS) while their next row is already launched, grammars ended under ignore_eos (EOS-only
    masks), parallel copies of one prompt (n > 1), a stop string, unconstrained neighbours and an
    abort while the aborted request's row is launched but not sampled: the same outputs as with
    async scheduling off, every grammar dropped and every page freed."""
    from dsv4.structured import masks
    monkeypatch.setattr(masks, "HANDOFF_WAIT_S", None)      # the worker fills every large mask
    ps = prompts(engine_of(async_scheduling="off"), 6)
    choice = SamplingParams(max_tokens=12, temperature=0.0, structured=KINDS["choice"])
    reqs = [h.Req(f"choice-{i}", p, choice) for i, p in enumerate(ps)]
    reqs += [h.Req(f"json-{i}", ps[0], SamplingParams(max_tokens=30, temperature=0.9, seed=i, structured=KINDS["json"]))
             for i in range(3)]                                                  # n = 3 copies of one prompt
    reqs += [h.Req(f"ended-{i}", p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                   structured=KINDS["choice"])) for i, p in enumerate(ps[:2])]
    reqs += [h.Req("stopped", ps[1], SamplingParams(max_tokens=20, temperature=0.0, stop=["-"],
                                                    structured=KINDS["regex"]))]
    reqs += [h.Req(f"plain-{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
             for i, p in enumerate(ps[:3])]
    reqs += [h.Req("aborted", ps[2], SamplingParams(max_tokens=30, temperature=0.0, structured=KINDS["json"]))]
    outs = {}
    eos = engine_of(async_scheduling="on").eos_token_id
    for mode in ("off", "on"):
        eng = engine_of(async_scheduling=mode)
        outs[mode] = h.drive(eng, reqs, check=True, abort_at=("aborted", 4))
        assert len(eng.grammars) == 0 and eng.cache.available_pages() == eng.plan.num_pages
    h.assert_same_outputs(outs["off"], outs["on"])
    done = outs["on"]
    assert "aborted" not in done and len(done) == len(reqs) - 1
    for i in range(len(ps)):
        assert done[f"choice-{i}"].finish_reason == "stop"
        check("choice", done[f"choice-{i}"].text)
    for i in range(2):
        out = done[f"ended-{i}"]
        end = out.token_ids.index(eos)
        assert len(out.token_ids) == 10 and set(out.token_ids[end:]) == {eos}
    assert done["stopped"].finish_reason == "stop" and done["stopped"].stop_reason == "-"
    assert len({tuple(done[f"json-{i}"].token_ids) for i in range(3)}) > 1     # the copies sample apart


def test_batch_accept_through_xgrammars_public_call_gives_the_same_outputs(engine_of, run, monkeypatch):
    """masks.accept_batch uses xgrammar's private core when it has one; without it (a release that
    moves it) the public batch call advances the matchers alike: same tokens, same texts."""
    import xgrammar.base
    eng = engine_of(async_scheduling="on")
    reqs = {f"j{i}": (p, SamplingParams(max_tokens=30, temperature=0.0, structured=KINDS["json"]))
            for i, p in enumerate(prompts(eng, 2))}
    private = run(eng, reqs)
    monkeypatch.delattr(xgrammar.base, "_core")
    public = run(eng, reqs)
    assert {r: o.token_ids for r, o in public.items()} == {r: o.token_ids for r, o in private.items()}
    for rid, out in public.items():
        check("json", out.text)


def test_masks_filled_in_slices_on_several_threads(engine_of, run, monkeypatch):
    """Three fill threads, a slice of the rows each (THREAD_MIN_ROWS lowered so 12 constrained
    rows make three slices), async scheduling on: every output validates, the constrained tokens
    equal an inline fill's, and unconstrained greedy rows in the same batch give the tokens of a
    run without any constraint (invariant 5)."""
    from dsv4.structured import masks
    eng = engine_of(async_scheduling="on")
    ps = prompts(eng, 12)
    plain = {f"p{i}": (p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)) for i, p in enumerate(ps[:4])}
    alone = run(eng, plain)
    mixed = dict(plain)
    mixed.update({f"c{i}": (p, SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.8, seed=i,
                                              structured=KINDS["json" if i % 3 else "regex"]))
                  for i, p in enumerate(ps)})
    grammars = eng._grammars()
    monkeypatch.setattr(masks, "THREAD_MIN_ROWS", 4)
    monkeypatch.setattr(masks, "HANDOFF_WAIT_S", None)      # every slice on its thread
    outs = {}
    for threads in (3, 0):                                  # 0: every fill inline
        grammars.masks.close()
        monkeypatch.setattr(grammars, "masks", masks.MaskFiller(eng.cfg.vocab_size, grammars.keep, threads=threads or None))
        if threads == 0:
            grammars.masks.thread_min_rows = 1 << 30
        outs[threads] = run(eng, mixed)
        assert grammars.masks.slices >= (3 if threads else 0) and grammars.masks.taken_back == 0
    grammars.masks.close()
    assert {r: o.token_ids for r, o in outs[3].items()} == {r: o.token_ids for r, o in outs[0].items()}
    for rid, out in outs[3].items():
        if rid.startswith("p"):
            assert out.token_ids == alone[rid].token_ids, rid
        else:
            assert out.finish_reason == "stop", (rid, out.text)
            check("json" if int(rid[1:]) % 3 else "regex", out.text)
