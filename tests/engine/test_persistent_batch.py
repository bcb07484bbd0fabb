"""The persistent batch (cache/batch_tables.py, engine/decode_rows.py): page tables kept by
slot between steps and synced incrementally give the same ForwardBatch as a fresh build from the
chunks' lists, over random sequences of requests joining, leaving, growing, trimming and
swapping pages, plain and padded to a CUDA-graph shape; an unchanged table is never rewritten.
In an engine, the persistent batch (engine/slot_state.py) follows every request after every step
(`SlotState.check`: plain decode, async scheduling on and off, preemption, prefix-cache hits,
n > 1 copies, aborts, MTP verify steps), decode rows read from it give the same step inputs
(rows, token rows on the device, ForwardBatch) as a SeqChunk per chunk, and the same outputs
(invariant 5); each request is read from its fields once a stay."""
import dataclasses
import random

import numpy as np
import pytest
import torch

from dsv4.cache.addressing import Scratch, SeqChunk, StepShape, build_step, step_widths
from dsv4.cache.batch_tables import PersistentTables
from dsv4.cache.layout import CacheLayout
from dsv4.cache.step_rows import StepRows, as_rows
from dsv4.engine.cuda_graphs import StepGraphs, batch_bucket, width_bucket
from dsv4.engine.runner import pending_fill
from dsv4.model.random_init import preset_config
from dsv4.sampling_params import SamplingParams

SLOTS = 9


def assert_same(a, b, path="fb"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, path


class FakeRequest:
    """A request's record as the cache manager keeps it: n positions written, its tables."""

    def __init__(self, rng, slot):
        self.slot, self.n = slot, rng.randint(0, 900)
        self.pages = [rng.randrange(0, 500) for _ in range(self.n // 256 + 2)]
        self.swa = [rng.randrange(0, 300) for _ in range(self.n // 128 + 2)]

    def chunk(self, rng, tokens):
        return SeqChunk(slot=self.slot, start=self.n, token_ids=[rng.randrange(100) for _ in range(tokens)],
                        page_table=self.pages, swa_table=self.swa, logits=tokens)

    def advance(self, rng, tokens, window):
        self.n += tokens
        while len(self.pages) < self.n // 256 + 2:
            self.pages.append(rng.randrange(0, 500))
        while len(self.swa) < self.n // 128 + 2:
            self.swa.append(rng.randrange(0, 300))
        keep_from = max(self.n - window - 8, 0) // 128          # trimmed SWA pages, in place
        self.swa[:keep_from] = [-1] * keep_from
        if rng.random() < 0.2 and self.n >= 256:                 # the prefix cache swaps in a shared page
            self.pages[rng.randrange(self.n // 256)] = rng.randrange(500, 600)


def test_random_joins_and_leaves_build_the_same_batch():
    cfg = preset_config("tiny")
    layout, rng = CacheLayout(cfg), random.Random(0)
    W = cfg.sliding_window
    tables, running, free = PersistentTables(SLOTS, columns=2), {}, list(range(SLOTS - 1))
    for step in range(300):
        for slot in [s for s in running if rng.random() < 0.15]:           # leave
            del running[slot]
            free.append(slot)
        while free and rng.random() < 0.5:                                 # join (a fresh record in a used slot)
            slot = free.pop(rng.randrange(len(free)))
            running[slot] = FakeRequest(rng, slot)
        if not running:
            continue
        uniform = rng.random() < 0.5
        reqs = rng.sample(list(running.values()), rng.randint(1, len(running)))
        chunks = [r.chunk(rng, 1 if uniform else rng.randint(1, 40)) for r in reqs]
        for c in chunks:
            tables.sync(c.slot, c.page_table, c.swa_table)
        assert_same(build_step(chunks, layout, SLOTS), build_step(chunks, layout, SLOTS, tables=tables))
        if uniform:
            e4, e128, _ = step_widths(chunks, W)
            shape = StepShape(batch_bucket(len(chunks), 16), 1, width_bucket(e4), width_bucket(e128), (W - 1) // 128 + 2)
            scratch = Scratch(600, 300, SLOTS - 1)
            assert_same(build_step(chunks, layout, SLOTS, shape, scratch),
                        build_step(chunks, layout, SLOTS, shape, scratch, tables))
        for r, c in zip(reqs, chunks):
            r.advance(rng, len(c.token_ids), W)


def test_unchanged_tables_are_not_rewritten():
    tables = PersistentTables(4)
    pages, swa = [3, 4], [-1, 7, 8]
    tables.sync(1, pages, swa)
    writes = tables.writes
    for _ in range(5):
        tables.sync(1, pages, swa)
    assert tables.writes == writes == 2
    pages.append(9)                          # the same list object, changed in place
    tables.sync(1, pages, swa)
    assert tables.writes == 3 and tables.history[1, :3].tolist() == [3, 4, 9]


def test_sync_rows_rewrites_only_changed_rows_and_keeps_a_shared_slot_in_order():
    tables, pages = PersistentTables(4), [[1, 2], [3], [4, 5]]
    chunks = [SeqChunk(slot=s, start=0, token_ids=[0], page_table=p, swa_table=[s]) for s, p in enumerate(pages)]
    tables.sync_rows(as_rows(chunks))
    assert tables.writes == 6 and tables.history[2, :2].tolist() == [4, 5]
    pages[1].append(9)                       # one row grows: one row rewritten
    tables.sync_rows(as_rows(chunks))
    assert tables.writes == 7 and tables.history[1, :2].tolist() == [3, 9]
    shared = [SeqChunk(slot=3, start=0, token_ids=[0], page_table=p, swa_table=[7]) for p in ([6], [8, 8])]
    tables.sync_rows(as_rows(shared))        # a slot given twice: the last tables, as `sync` in order
    assert tables.history[3, :2].tolist() == [8, 8]


def _params(i: int, stop: int | None) -> SamplingParams:
    kinds = [dict(temperature=0.0, max_tokens=9, ignore_eos=True),
             dict(temperature=0.9, top_k=20, seed=7, max_tokens=12, ignore_eos=True, logprobs=1),
             dict(temperature=0.0, max_tokens=14, stop_token_ids=[stop] if stop is not None else None),
             dict(temperature=0.0, max_tokens=7, ignore_eos=True, prompt_logprobs=1),
             dict(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2)]
    return SamplingParams(**kinds[i % len(kinds)])


def _check_step_inputs(runner, counts):
    """Wrap runner.step_inputs: every step built from the persistent batch must equal the
    SeqChunk path's (StepRows, token rows on the device, ForwardBatch)."""
    step_inputs = runner.step_inputs

    def both(chunks, prev):
        rows, fill, slots = step_inputs(chunks, prev)
        seqs = [runner.seq_chunk(c) for c in chunks]
        ref_fill = pending_fill(chunks, seqs, prev)
        if slots is not None:
            counts["batched"] += 1
            counts["verify"] += any(c.num_logits for c in chunks)
            held = [runner.cache.seqs[c.request.request_id].slot for c in chunks]
            assert slots.slot_list == slots.slots.tolist() == held
            assert slots.lens.tolist() == [c.num_tokens for c in chunks]
        if isinstance(rows, StepRows):
            counts["gathered"] += 1
            counts["mixed"] += bool((rows.lens > 1).any())
            counts["decode_only"] += bool((rows.lens == 1).all() and (rows.logits == 1).all())
            counts["verify_beside"] += any(c.num_logits for c in chunks)     # verify chunks beside decode rows
            assert_same(StepRows.of(seqs), rows, "rows")
            assert (fill is None) == (ref_fill is None)
            if fill is not None:
                counts["in_order"] += fill.in_order
                order = torch.argsort(ref_fill.dst)
                assert torch.equal(fill.dst, ref_fill.dst[order]) and torch.equal(fill.src, ref_fill.src[order])
            ring = runner.storage.ring_slots
            assert_same(build_step(seqs, runner.layout, ring), build_step(rows, runner.layout, ring, tables=None))
            if graphs.accepts(rows):            # padded to a CUDA-graph shape, as a uniform step on a GPU
                counts["uniform"] += 1
                shape, scratch = graphs.shape(rows), graphs.scratch
                assert_same(build_step(seqs, runner.layout, ring, shape, scratch),
                            build_step(rows, runner.layout, ring, shape, scratch))
        return rows, fill, slots
    graphs = StepGraphs(runner.model, runner.storage, 16, capture=False, h2d=runner.h2d)
    runner.step_inputs = both


def _batch_checked(eng, counts):
    """After every step: the persistent batch agrees with every request (SlotState.check)."""
    def on_step(engine, step):
        live = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        engine.runner.batch.check(live, engine.cache.seqs)
        counts["checked"] += 1
    return on_step


def _run(tiny, h, reqs, batched: bool, abort_at=None, prepare=None, **config):
    """Drive `reqs` on an engine with the persistent batch in every step (batched; its steps and
    state checked) or never (the plain path): (outputs, counts, engine). `prepare(engine)` first."""
    eng = tiny.engine(**config)
    if prepare is not None:
        prepare(eng)
    counts = dict.fromkeys(["batched", "gathered", "mixed", "decode_only", "uniform", "verify", "verify_beside",
                            "in_order", "checked", "preempted"], 0)
    if batched:
        eng.runner.gather_min_rows = 1          # (steps of a few requests)
        _check_step_inputs(eng.runner, counts)
    else:
        eng.runner.batch = None
    preempt = eng.scheduler.preempt
    eng.scheduler.preempt = lambda req: counts.__setitem__("preempted", counts["preempted"] + 1) or preempt(req)
    outs = h.drive(eng, reqs, check=True, abort_at=abort_at, on_step=_batch_checked(eng, counts) if batched else None)
    assert sum(eng.scheduler.counts()) == 0 and eng.cache.available_pages() == eng.plan.num_pages
    return outs, counts, eng


_MEMO: dict = {}     # plain-path results that do not depend on a test's parameter


@pytest.mark.parametrize("mode", ["off", "on"])
def test_gathered_decode_rows_equal_the_seqchunk_path(tiny, h, one_thread, mode):
    """Requests join at random steps, leave (max tokens, a stop token, an abort), grow across SWA
    and history pages, get preempted (few pages) and share pages through the prefix cache;
    n > 1 copies of a prompt run side by side (sharing its prefill); requests with prompt
    logprobs and penalties ride along (their rows take the SeqChunk path)."""
    rng = random.Random(5)
    base = tiny.ids(300, seed=3)
    prompts = [base[:rng.randint(1, 300)] + tiny.ids(rng.randint(1, 40), seed=i) for i in range(12)]
    arrivals = sorted(rng.randrange(0, 30) for _ in prompts)

    shared = base + tiny.ids(30, seed=99)       # its copies resume from its prefill (prefix-cache hits)

    def reqs(stop):
        out = [h.Req(str(i), p, _params(i, stop), arrivals[i]) for i, p in enumerate(prompts)]
        copies = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
        return out + [h.Req(f"n{k}", shared, dataclasses.replace(copies, seed=11 + k), 2 if k == 0 else 5)
                      for k in range(3)]

    config = dict(max_num_batched_tokens=96, max_num_seqs=6, num_pages=7, async_scheduling=mode,
                  enable_prefix_caching=True)
    if "stop" not in _MEMO:     # request 2's 4th greedy token (the same in both modes, invariant 5)
        first, _, _ = _run(tiny, h, reqs(None), False, ("4", 12), **config)
        _MEMO["stop"] = first["2"].token_ids[3]
    stop = _MEMO["stop"]
    plain, _, _ = _run(tiny, h, reqs(stop), False, ("4", 12), **config)
    assert plain["2"].finish_reason == "stop" and plain["2"].stop_reason == stop, plain["2"]
    batched, counts, eng = _run(tiny, h, reqs(stop), True, ("4", 12), **config)
    h.assert_same_outputs(plain, batched)
    assert counts["gathered"] >= 20 and counts["mixed"] >= 3 and counts["decode_only"] >= 5, counts
    assert counts["uniform"] >= 5, counts
    assert counts["preempted"] >= 1 and eng.prefix_stats()[1] > 0, (counts, eng.prefix_stats())
    assert (counts["in_order"] >= 5) == (mode == "on"), counts      # rows taking the tokens in flight in place
    # each request is read from its fields once a stay in the batch (admission, resumption)
    assert eng.runner.batch.joins <= len(prompts) + 3 + counts["preempted"], (eng.runner.batch.joins, counts)


class _TruthDrafts:
    """A drafter whose drafts are a plain run's tokens (`truth`: request id -> prompt + output),
    wrong at every third position: verifies accept runs of several tokens (several tokens of one
    request read back in one step) and reject some."""

    def __init__(self, truth: dict[str, list[int]]):
        self.truth = truth

    def propose(self, works, hidden, batch_of):
        out = []
        for w in [w for w in works if w.num_drafts > 0]:
            seq, first = self.truth[w.request.request_id], w.start + w.anchor + 2
            drafts = [seq[p] if p < len(seq) and p % 3 else 0 for p in range(first, first + w.num_drafts)]
            out.append((torch.tensor(drafts), None))
        return out


@pytest.mark.parametrize("scripted", [False, True])
def test_speculative_steps_keep_the_batch(tiny, h, one_thread, scripted):
    """MTP verify steps (k = 3): drafts verified in SeqChunk rows beside decode rows read from the
    batch (requests with no room left to draft), several tokens a request read back at once,
    rejected drafts rewound; greedy tokens equal the plain engine's (invariant 5)."""
    prompts = [tiny.ids(n, seed=40 + n) for n in (5, 40, 70, 130, 17, 66)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 25, 18, 16, 14, 15)]
    reqs = [h.Req(str(i), p, params[i], arrival=i // 2) for i, p in enumerate(prompts)]
    config = dict(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16)
    if "spec_plain" not in _MEMO:   # the plain engine's run: the same for both drafters
        _MEMO["spec_plain"] = _run(tiny, h, reqs, False, **config)[0]
    plain = _MEMO["spec_plain"]
    truth = {r.rid: r.prompt + plain[r.rid].token_ids for r in reqs}

    def scripted_drafts(eng):
        if scripted:
            eng.spec.proposer = _TruthDrafts(truth)
    got, counts, eng = _run(tiny, h, reqs, True, prepare=scripted_drafts,
                            speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **config)
    h.assert_same_outputs(plain, got)
    assert counts["gathered"] >= 2 and counts["verify"] >= 5 and counts["verify_beside"] >= 1, counts
    assert (eng.spec.stats.num_accepted_tokens >= 20) == scripted, eng.spec.stats.num_accepted_tokens


def test_check_names_a_field_the_batch_missed(tiny, h, one_thread):
    """A change of a request's field made behind the batch's back is caught by `check`."""
    eng = tiny.engine(max_num_seqs=4)
    eng.runner.gather_min_rows = 1
    for i in range(3):
        eng.add_request(str(i), tiny.ids(9 + i, seed=i), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        eng.step()
    live = list(eng.scheduler.running)
    eng.runner.batch.check(live, eng.cache.seqs)
    assert all(r.batch_row >= 0 for r in live) and len(live) == 3
    live[1].output_token_ids.append(5)          # (no engine path appends without the batch following)
    with pytest.raises(AssertionError, match="request 1: num_tokens"):
        eng.runner.batch.check(live, eng.cache.seqs)
    live[1].output_token_ids.pop()
    live[2].num_computed -= 1
    with pytest.raises(AssertionError, match="request 2: position"):
        eng.runner.batch.check(live, eng.cache.seqs)
