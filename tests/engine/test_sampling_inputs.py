"""The sampler's inputs kept on the device between steps (engine/sampling_inputs.py): reused
only while the sampled requests and everything the batch depends on are unchanged, and an
engine that reuses them gives exactly the tokens, logprobs and finish reasons of one that
rebuilds every step (invariant 5), through joins, leaves, seeded and unseeded sampling, logit
bias, min_tokens bans and penalties."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.engine.request import Request
from dsv4.engine.sampling_inputs import SamplingInputs
from dsv4.engine.upload import HostToDevice
from dsv4.sampling_params import SamplingParams
from dsv4.structured.masks import GrammarMask

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, EOS = 64, 0


def _req(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params), arrival=0)


class Filled:
    """A grammar mask already filled (what structured/masks.PendingMask.result() gives)."""

    def __init__(self, mask: GrammarMask):
        self.mask = mask

    def result(self) -> GrammarMask:
        return self.mask


def _inputs() -> SamplingInputs:
    return SamplingInputs(VOCAB, EOS, torch.Generator().manual_seed(0), HostToDevice("cpu"))


def test_reused_only_while_the_same_requests_sample_in_the_same_order():
    si = _inputs()
    a, b = _req("a", temperature=0), _req("b", temperature=0.7, top_k=5, seed=3, logprobs=2)
    first, rows_t, pending = si.batch([a, b], [0, 1])
    assert rows_t is None and pending is None and si.builds == 1
    turn = si.h2d.turn
    again, _, _ = si.batch([a, b], [0, 1])
    assert again is first and si.builds == 1 and si.h2d.turn == turn       # no build, no upload
    _, rows_t, _ = si.batch([a, b], [2, 5])                                 # other logits rows: only they go up
    assert rows_t.tolist() == [2, 5] and si.builds == 1
    swapped, _, _ = si.batch([b, a], [0, 1])
    assert swapped is not first and si.builds == 2 and swapped.is_greedy.tolist() == [False, True]
    c = _req("c", temperature=0)
    joined, _, _ = si.batch([b, a, c], [0, 1, 2])
    assert si.builds == 3 and joined.is_greedy.tolist() == [False, True, True]
    grammar = GrammarMask(torch.tensor([0]), torch.full((1, 2), -1, dtype=torch.int32))
    masked, _, _ = si.batch([b, a, c], [0, 1, 2], Filled(grammar))          # the rest reused, the mask its own
    assert torch.equal(masked.grammar.bitmask, grammar.bitmask) and si.builds == 3
    assert masked.is_greedy is joined.is_greedy and joined.grammar is None
    other = GrammarMask(torch.tensor([2]), torch.zeros((1, 2), dtype=torch.int32))
    remasked, rows_t, _ = si.batch([b, a, c], [0, 1, 3], Filled(other))
    assert si.builds == 3 and remasked.grammar.rows.tolist() == [2] and rows_t.tolist() == [0, 1, 3]
    keep = torch.tensor([-1, 5], dtype=torch.int32)                          # the filter goes up once
    kept = [si.batch([b, a, c], [0, 1, 2], Filled(GrammarMask(torch.tensor([1]), other.bitmask, keep=keep)))[0]
            for _ in range(2)]
    assert kept[0].grammar.keep is kept[1].grammar.keep and kept[0].grammar.keep.tolist() == [-1, 5]
    assert kept[0].grammar.keep_bits is kept[1].grammar.keep_bits                  # its bit selectors made once
    assert kept[0].grammar.keep_bits[1].tolist() == [1, 0, 4] + [0] * 29             # 5 = bits 0 and 2
    assert si.batch([b, a, c], [0, 1, 2])[0] is joined and si.builds == 3  # no mask: none kept from before
    si.batch([c, b], [0, 1], Filled(grammar))
    assert si.batch([c, b], [0, 1])[0].grammar is None and si.builds == 4    # a batch built with a mask, kept without


def test_penalties_and_active_min_tokens_bans_rebuild_every_step():
    si = _inputs()
    pen = _req("p", temperature=0, repetition_penalty=1.2)
    for n in range(3):
        batch, _, _ = si.batch([pen], [0])
        assert batch.penalties is not None and si.builds == n + 1
    banned = _req("m", temperature=0, min_tokens=2)
    for n in range(2):
        batch, _, _ = si.batch([banned], [0])
        assert batch.banned is not None
        banned.output_token_ids.append(5)
    assert si.builds == 5
    lifted, _, _ = si.batch([banned], [0])
    assert lifted.banned is None and si.builds == 6
    assert si.batch([banned], [0])[0] is lifted and si.builds == 6


def _params(i: int) -> SamplingParams:
    kinds = [dict(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2),
             dict(temperature=0.9, top_k=20, seed=7, max_tokens=12, ignore_eos=True),
             dict(temperature=0.8, max_tokens=10, ignore_eos=True),                    # the shared generator
             dict(temperature=0.0, max_tokens=14, ignore_eos=True, logit_bias={5: 2.0}),
             dict(temperature=0.7, top_p=0.9, seed=11, max_tokens=11, min_tokens=6, ignore_eos=True),
             dict(temperature=0.0, max_tokens=6, ignore_eos=True, frequency_penalty=0.3)]
    return SamplingParams(**kinds[i % len(kinds)])


def _drive(engine, prompts, arrivals):
    done, step = {}, 0
    while step < 500:
        for i, p in enumerate(prompts):
            if arrivals[i] == step:
                engine.add_request(str(i), p, _params(i))
        if step > max(arrivals) and not engine.has_unfinished():
            return done
        done.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    raise AssertionError("engine still busy")


def test_reusing_engine_equals_rebuilding_engine(tiny):
    prompts = [tiny.ids(n, seed=300 + n) for n in (6, 33, 12, 20, 9, 15)]
    arrivals = [0, 0, 1, 4, 4, 12]          # the penalty request joins after the others settled
    reuse = tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16)
    rebuild = tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=16)
    si = rebuild.sampling_inputs
    plain = si.batch
    si.batch = lambda *args: (setattr(si, "_batch", None), plain(*args))[1]       # never reuse
    a, b = _drive(reuse, prompts, arrivals), _drive(rebuild, prompts, arrivals)
    assert sorted(a) == sorted(b) == [str(i) for i in range(len(prompts))]
    for rid in a:
        x, y = a[rid], b[rid]
        assert x.token_ids == y.token_ids and (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert x.logprobs == y.logprobs, rid
    assert 0 < reuse.sampling_inputs.builds < si.builds, (reuse.sampling_inputs.builds, si.builds)


def test_warmup_runs_every_row_kind_and_leaves_the_shared_generator_and_reuse_alone():
    """The start-up pass over the sampler (engine warm-up) draws from a generator of its own: the
    engine's shared generator gives the same draws afterwards, and no batch is kept for reuse."""
    from dsv4.engine.sampler import Sampler
    si = _inputs()
    before = si.generator.get_state()
    si.warmup(Sampler(), "cpu")
    assert torch.equal(si.generator.get_state(), before)
    assert si.builds == 0 and si._batch is None
    a = _req("a", temperature=0.9)
    batch, _, _ = si.batch([a], [0])
    assert si.builds == 1 and batch.random_rows == [0]


def test_plain_greedy_requests_replace_one_another_without_a_rebuild():
    """Rows that are greedy and nothing else are interchangeable: requests of that kind
    joining and leaving keep the batch (fewer of them take its first rows, more rebuild it);
    any other kind of row rebuilds."""
    si = _inputs()
    a, b, c = (_req(x, temperature=0, max_tokens=8) for x in "abc")
    first, _, _ = si.batch([a, b], [0, 1])
    assert si.batch([c, a], [0, 1])[0] is first and si.builds == 1
    three, _, rows_t = si.batch([a, b, c], [0, 1, 2])
    assert three is not first and si.builds == 2
    for n in (1, 2):
        part, rows_t, _ = si.batch([c, b][:n], [0, 3][:n])
        fresh = SamplingInputs(VOCAB, EOS, si.generator, HostToDevice("cpu")).batch([a, b][:n], [0, 1][:n])[0]
        assert si.builds == 2 and (rows_t is None) == (n == 1)
        for f in dataclasses.fields(part):
            got, want = getattr(part, f.name), getattr(fresh, f.name)
            assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want, f.name
    for kw in (dict(temperature=0.5), dict(temperature=0, logprobs=0), dict(temperature=0, logit_bias={3: 1.0}),
               dict(temperature=0, min_tokens=1), dict(temperature=0, presence_penalty=0.5)):
        si.batch([a, b], [0, 1])
        builds = si.builds
        other = _req("x", max_tokens=8, **kw)
        assert not other.plain_greedy
        batch, _, _ = si.batch([a, other], [0, 1])
        assert si.builds == builds + 1 and batch.is_greedy.tolist() == [True, other.params.is_greedy]


@pytest.mark.parametrize("covers_all", [True, False])
@pytest.mark.parametrize("logit_rows", [[0, 1, 2], [0, 1, 3]])
def test_page_locked_mask_goes_up_as_it_is_and_equals_the_packed_one(covers_all, logit_rows):
    """A mask in page-locked memory (the grammar worker's registered buffer) crosses without
    packing, into a device buffer kept between steps: the same rows, bitmask and logits rows as
    the packed upload, and a later, smaller mask reuses the buffer without touching its rows."""
    reqs = [_req("a", temperature=0), _req("b", temperature=0.7, seed=1), _req("c", temperature=0)]
    rows = torch.arange(3) if covers_all else torch.tensor([0, 2])
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), 2), dtype=torch.int32)
    packed, locked = _inputs(), _inputs()
    for si in (packed, locked):
        si.batch(reqs, logit_rows)              # built: the masked steps below reuse it, as decode steps do
    masks = [GrammarMask(rows, bitmask, covers_all, page_locked=p) for p in (False, True)]
    (want, want_rows, _), (got, got_rows, _) = (si.batch(reqs, logit_rows, Filled(m))
                                                for si, m in zip((packed, locked), masks))
    assert packed.builds == locked.builds == 1
    assert torch.equal(got.grammar.bitmask, want.grammar.bitmask) and torch.equal(got.grammar.rows, rows)
    assert got.grammar.covers_all == covers_all and got.grammar.bitmask.data_ptr() != bitmask.data_ptr()
    assert (got_rows is None) == (want_rows is None) and (got_rows is None or got_rows.tolist() == logit_rows)
    buffer = got.grammar.bitmask.data_ptr()
    smaller = GrammarMask(rows[:1], bitmask[:1] ^ 1, False, page_locked=True)
    again, _, _ = locked.batch(reqs, logit_rows, Filled(smaller))
    assert again.grammar.bitmask.data_ptr() == buffer and torch.equal(again.grammar.bitmask, bitmask[:1] ^ 1)
    assert again.grammar.rows.tolist() == [0]
