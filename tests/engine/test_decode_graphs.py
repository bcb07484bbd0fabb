"""Decode steps padded to CUDA-graph shapes (batch bucket, bucketed entry widths, scratch
targets for the padding rows) give the same results as the unpadded step. Here the padded
step runs eagerly (capture=False); on a GPU the same padded step is captured and replayed."""
import pytest

from dsv4.engine.cuda_graphs import StepGraphs, batch_bucket, end_widths, width_bucket


def _engine(tiny, padded: bool, async_scheduling: str = "off"):
    eng = tiny.engine(max_num_batched_tokens=64, max_num_seqs=6, num_pages=24, async_scheduling=async_scheduling)
    if padded:
        eng.runner.graphs = StepGraphs(eng.model, eng.runner.storage, max_bs=8, capture=False)
    return eng


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_padded_decode_steps_equal_plain_ones(tiny, h, one_thread, monkeypatch, async_scheduling):
    # lengths put decode positions across C4 and C128 group ends and SWA page ends
    prompts = [tiny.ids(n, seed=n) for n in (3, 120, 126, 250, 61)]
    plain = h.greedy_outputs(_engine(tiny, False), prompts, 24, logprobs=0)
    padded_engine = _engine(tiny, True, async_scheduling)
    calls = []
    graphs = padded_engine.runner.graphs
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda seqs, fill=None: calls.append(
        (len(seqs), fill is not None, graphs.shape(seqs))) or run(seqs, fill))
    padded = h.greedy_outputs(padded_engine, prompts, 24, logprobs=0)
    assert calls and max(n for n, _, _ in calls) == 5, "the padded path ran for decode steps of the whole batch"
    # async: decode steps take the previous step's tokens from the device
    assert any(f for _, f, _ in calls) == (async_scheduling == "on")
    # one device buffer per shape, refilled by every later step of that shape
    assert set(graphs.buffers) == {shape for _, _, shape in calls} and len(graphs.buffers) < len(calls)
    for a, b in zip(plain, padded):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            (ta, va), (tb, vb) = next(iter(la.items())), next(iter(lb.items()))
            assert ta == tb and abs(va - vb) < 1e-4
    assert padded_engine.cache.available_pages() == padded_engine.plan.num_pages


def test_buckets():
    assert [batch_bucket(n, 256) for n in (1, 3, 9, 256)] == [1, 4, 16, 256]
    assert batch_bucket(257, 256) is None and batch_bucket(5, 4) is None
    assert [width_bucket(n) for n in (0, 1, 16, 17, 100, 512, 513, 4098)] == [16, 16, 16, 32, 128, 512, 1024, 4608]


def test_end_widths_are_every_ends_pair_once():
    """end_widths walks the runs of equal (E4, E128) buckets: the same pairs as every end's,
    across the bucket rules' changes (powers of two, multiples of 512, 16 an octave past 8192)."""
    for first, last in ((1, 40_000), (4, 40_000), (3, 3), (5, 4)):
        every = sorted({(width_bucket(e // 4), width_bucket(e // 128)) for e in range(first, last + 1)})
        assert end_widths(first, last) == every, (first, last)


def test_graphs_are_kept_for_the_engines_life():
    """A captured shape is never evicted (warm-up captured them all before READY)."""
    graphs = StepGraphs.__new__(StepGraphs)
    graphs.graphs = {}
    captured = []
    graphs._capture = lambda static: captured.append(static) or (static,)
    keys = [f"shape{i}" for i in range(100)]
    for key in keys + keys:
        assert graphs._graph(key, key)[0] == key
    assert captured == keys and list(graphs.graphs) == keys
