"""Warm-up before READY (engine/cuda_graphs.py `graph_shapes`, ModelRunner.warmup): the shapes
it enumerates cover every uniform step the configuration can produce, each warm-up step is
exactly its shape, it touches no request's state (greedy tokens unchanged), and after it a
run meets no shape it did not warm. Here the padded steps run eagerly (capture=False); on a
GPU the same code captures each graph."""
import random

import torch

from dsv4.cache.addressing import Scratch, SeqChunk
from dsv4.config import EngineConfig
from dsv4.engine.cuda_graphs import BATCH_BUCKETS, StepGraphs, graph_shapes, warmup_seqs, width_bucket
from dsv4.engine.engine import LLMEngine
from dsv4.model.random_init import preset_config, random_state, save_checkpoint
from dsv4.sampling_params import SamplingParams

MAX_LEN = 600


def _engine(path, graphs: bool):
    eng = LLMEngine(path, EngineConfig(max_num_batched_tokens=64, max_num_seqs=6, num_pages=24, max_model_len=MAX_LEN))
    if graphs:
        eng.runner.graphs = StepGraphs(eng.model, eng.runner.storage, max_bs=8, capture=False, h2d=eng.runner.h2d)
    return eng


def _run(eng, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(prompts))]


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


def test_warmup_runs_every_shape_and_leaves_tokens_unchanged(tmp_path):
    torch.set_num_threads(1)
    cfg = preset_config("tiny")
    save_checkpoint(cfg, random_state(cfg, seed=3), str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (3, 120, 250, 61)]
    plain = _run(_engine(str(tmp_path), False), prompts, 20)

    eng = _engine(str(tmp_path), True)
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
    assert _run(eng, prompts, 20) == plain
    assert ran and set(ran) <= set(expected) and not eng.runner.graphs.late
