"""Warm-up before READY (engine/cuda_graphs.py `graph_shapes`, ModelRunner.warmup): the shapes
it enumerates cover every uniform step the configuration can produce, each warm-up step is
exactly its shape, it touches no request's state (greedy tokens unchanged), and after it a
run meets no shape it did not warm. Here the padded steps run eagerly (capture=False); on a
GPU the same code captures each graph."""
import random

import torch

from dsv4.cache.addressing import Scratch, SeqChunk
from dsv4.engine.cuda_graphs import BATCH_BUCKETS, StepGraphs, graph_shapes, warmup_seqs, width_bucket
from dsv4.engine.runner import ODD_FROM, eager_warmup_steps
from dsv4.model.random_init import preset_config

MAX_LEN = 600


def _engine(tiny, graphs: bool):
    eng = tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=24, max_model_len=MAX_LEN)
    if graphs:
        eng.runner.graphs = StepGraphs(eng.model, eng.runner.storage, max_bs=8, capture=False, h2d=eng.runner.h2d)
    return eng


def _run(h, eng, prompts, max_tokens):
    return [out.token_ids for out in h.greedy_outputs(eng, prompts, max_tokens)]


def test_graph_shapes_cover_every_uniform_step():
    """Any batch of up to max_bs sequences of q tokens ending at or before max_model_len has a
    shape in the enumeration, and each enumerated shape's warm-up batch has exactly that shape."""
    cfg = preset_config("tiny")
    graphs = StepGraphs.__new__(StepGraphs)
    graphs.layout, graphs.max_bs = type("L", (), {"cfg": cfg})(), 16
    scratch, rng = Scratch(7, 5, 3), random.Random(0)
    for q, max_len in ((1, 600), (3, 5000), (1, 20000)):
        shapes = graph_shapes(16, 16, max_len, q, cfg.sliding_window)
        assert len(set(shapes)) == len(shapes)
        assert {s.seqs for s in shapes} == {b for b in BATCH_BUCKETS if b <= 16}
        for shape in shapes:
            seqs = warmup_seqs(shape, scratch, max_len)
            assert graphs.shape(seqs) == shape and seqs[0].start + q <= max_len
        for _ in range(300):
            ends = [rng.randint(q, max_len) for _ in range(rng.randint(1, 16))]
            seqs = [SeqChunk(slot=0, start=e - q, token_ids=[1] * q, page_table=[], swa_table=[], logits=q)
                    for e in ends]
            assert graphs.shape(seqs) in set(shapes), ends


def test_width_buckets_stay_few_past_8192():
    widths = {width_bucket(n) for n in range(1 << 18)}
    assert all(width_bucket(n) >= n for n in (8193, 9000, 100_000, 262_143))
    assert max(width_bucket(n) / n for n in range(8193, 1 << 18, 97)) <= 1.0625
    assert len(widths) < 6 + 16 + 16 * 5


def test_warmup_runs_every_shape_and_leaves_tokens_unchanged(tiny, h, one_thread):
    cfg = tiny.cfg
    prompts = [tiny.ids(n, seed=n) for n in (3, 120, 250, 61)]
    plain = _run(h, _engine(tiny, False), prompts, 20)

    eng = _engine(tiny, True)
    before = {k: v.clone() for k, v in eng.runner.storage.kinds.items()}
    ran = []
    run = eng.runner.graphs.run
    eng.runner.graphs.run = lambda seqs, fill=None: ran.append(eng.runner.graphs.shape(seqs)) or run(seqs, fill)
    done = eng.warmup()
    expected = graph_shapes(8, 6, MAX_LEN, 1, cfg.sliding_window)
    assert max(s.seqs for s in expected) == 8      # 5 or 6 sequences pad to 8
    assert done["graph_shapes"] == len(expected) and ran == expected
    assert eng.runner.graphs.warmed == set(expected)
    for kind, t in eng.runner.storage.kinds.items():     # only the scratch units were written
        assert torch.equal(t[:-1], before[kind][:-1]), kind

    ran.clear()
    assert _run(h, eng, prompts, 20) == plain
    assert ran and set(ran) <= set(expected) and not eng.runner.graphs.late


def test_eager_warmup_steps_cover_every_power_of_two_size():
    """Each size 1, 2, 4, ... and the budget gets a prefill step (from ODD_FROM, one of a token
    less too, and one chunk ending at max_model_len where it fits twice) and (room permitting) a
    mixed one with decode rows at the furthest position; a budget past max_model_len takes several
    chunks; no step exceeds the budget, max_num_seqs or max_model_len."""
    scratch = Scratch(7, 5, 3)
    for max_len, seqs, budget in ((600, 6, 64), (2048, 256, 8192), (100, 2, 1000), (2, 1, 1)):
        steps = eager_warmup_steps(scratch, max_len, seqs, budget)
        sizes = [sum(len(c.token_ids) for c in step) for step in steps]
        top = min(budget, (max_len - 1) * seqs)
        want = {1 << i for i in range(top.bit_length()) if 1 << i < top} | {top}
        want |= {n - 1 for n in want if n >= ODD_FROM}      # (prefills: divisibility by 16 specialised)
        assert set(sizes) == want and max(sizes) == top
        for step in steps:
            assert len(step) <= seqs
            assert all(c.start + len(c.token_ids) <= max_len and c.slot == 3 for c in step)
            assert all(set(c.page_table) == {7} and set(c.swa_table) == {5} for c in step)
        deep = [step[0] for step in steps if len(step) == 1 and step[0].start > 0 and len(step[0].token_ids) > 1]
        assert sorted(len(c.token_ids) for c in deep) == sorted(n for n in want if n >= ODD_FROM and n & (n - 1) == 0
                                                                   and n <= min(budget, max_len - 1) and 2 * n <= max_len)
        assert all(c.start + len(c.token_ids) == max_len for c in deep)
        mixed = [step for step in steps if any(c.start > 0 and len(c.token_ids) == 1 for c in step)]
        for step in mixed:
            decode = [c for c in step if c.start > 0]
            assert all(c.start == max_len - 1 and len(c.token_ids) == 1 for c in decode)
            assert any(c.start == 0 for c in step) and len(decode) * 2 <= sum(len(c.token_ids) for c in step)
        assert bool(mixed) == (seqs > 1)
    steps = eager_warmup_steps(scratch, 2048, 256, 8192)
    assert [len(s) for s in steps if sum(len(c.token_ids) for c in s) == 8192] == [5, 251 + 4]  # 4 chunks: 7941
