import itertools
import math

import pytest
import torch

from dsv4.engine.sampler import (Sampler, SamplingBatch, SamplingRow, apply_min_p,
                                 apply_top_k_top_p, compute_prompt_logprobs, make_generator)
from dsv4.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EOS = 0
sampler = Sampler()


def row(prompt=(5, 6), output=(), device="cpu", **params):
    p = SamplingParams(**params)
    return SamplingRow(p, list(prompt), list(output), make_generator(p.seed, device))


def sample(logits, rows, shared_generator=None):
    batch = SamplingBatch.build(rows, logits.shape[1], logits.device, EOS, shared_generator)
    return sampler(logits, batch)


def random_logits(rows, vocab, seed=0, scale=3.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_argmax(device, dtype):
    logits = random_logits(6, 300, device=device).to(dtype)
    rows = [row(temperature=t, device=device) for t in (0.0, 5e-6, 0.0, 0.0, 1e-6, 0.0)]
    out = sample(logits, rows)
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))


def test_top_k_1_equals_greedy():
    logits = random_logits(64, 300, seed=1, scale=0.5)
    out = sample(logits, [row(temperature=2.0, top_k=1) for _ in range(64)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_equals_greedy():
    logits = random_logits(64, 300, seed=2, scale=0.5)
    out = sample(logits, [row(temperature=2.0, top_p=1e-6) for _ in range(64)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def _mixed_rows(device):
    """The rows under test (each seeded or greedy) and unseeded filler rows."""
    targets = [
        dict(temperature=0.0, logprobs=3),
        dict(temperature=0.8, top_k=20, top_p=0.9, seed=11, logprobs=5),
        dict(temperature=1.3, min_p=0.05, seed=12, repetition_penalty=1.3,
             frequency_penalty=0.4, presence_penalty=0.2, min_tokens=4),
    ]
    fillers = [dict(temperature=0.7, top_k=5), dict(temperature=1.0, logprobs=2),
               dict(temperature=0.0, presence_penalty=1.0)]
    return targets, fillers


@pytest.mark.parametrize("device", DEVICES)
def test_batch_invariance(device):
    vocab = 500
    targets, fillers = _mixed_rows(device)
    histories = [((7, 8, 9), (1, 2, 2)), ((3,), (4, 4)), ((10, 11), (EOS, 12, 13))]
    target_logits = random_logits(len(targets), vocab, seed=3, device=device)
    filler_logits = random_logits(len(fillers), vocab, seed=4, device=device)

    def run(order):
        """Sample targets + fillers, rows placed in `order`; per target: its results."""
        specs = [("t", i) for i in range(len(targets))] + [("f", i) for i in range(len(fillers))]
        specs = [specs[i] for i in order]
        rows, logits = [], []
        for kind, i in specs:
            if kind == "t":
                prompt, output = histories[i]
                rows.append(row(prompt, output, device, **targets[i]))
                logits.append(target_logits[i])
            else:
                rows.append(row(device=device, **fillers[i]))
                logits.append(filler_logits[i])
        out = sample(torch.stack(logits), rows)
        return {i: (out.token_ids[pos], out.logprobs[pos],
                    out.top_logprobs[pos, :targets[i].get("logprobs", 0)])
                for pos, (kind, i) in enumerate(specs) if kind == "t"}

    alone = {}
    for i in range(len(targets)):
        prompt, output = histories[i]
        out = sample(target_logits[i:i + 1], [row(prompt, output, device, **targets[i])])
        alone[i] = (out.token_ids[0], out.logprobs[0],
                    out.top_logprobs[0, :targets[i].get("logprobs", 0)])
    n = len(targets) + len(fillers)
    orders = [list(range(n)), list(reversed(range(n)))] + [
        list(p) for p in itertools.islice(itertools.permutations(range(n)), 7, None, 97)]
    for order in orders:
        for i, (token, logprob, top) in run(order).items():
            assert token == alone[i][0], (order, i)
            if targets[i].get("logprobs") is not None:   # defined for rows that ask for them
                torch.testing.assert_close(logprob, alone[i][1], rtol=0, atol=1e-6)
            torch.testing.assert_close(top, alone[i][2], rtol=0, atol=1e-6)


def _generate(seed, steps=24, vocab=200, device="cpu"):
    """Token sequence of a seeded request fed its own samples back (penalties see them)."""
    params = SamplingParams(temperature=1.0, seed=seed, frequency_penalty=0.1)
    generator = make_generator(seed, device)
    logits = random_logits(1, vocab, seed=5, scale=0.3, device=device)
    output = []
    for _ in range(steps):
        batch = SamplingBatch.build([SamplingRow(params, [1, 2], output, generator)],
                                    vocab, device, EOS)
        output.append(int(sampler(logits, batch).token_ids[0]))
    return output


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproducibility(device):
    first = _generate(seed=1234, device=device)
    assert first == _generate(seed=1234, device=device)
    assert first != _generate(seed=1235, device=device)
    assert len(set(first)) > 5  # genuinely random, not stuck on one token


def test_top_k_top_p_masks_on_small_example():
    probs = torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15]])
    logits = probs.log()

    def kept(top_k, top_p):
        masked = apply_top_k_top_p(logits, torch.tensor([top_k]), torch.tensor([top_p]))
        return set(torch.nonzero(masked[0].isfinite()).flatten().tolist())

    assert kept(5, 1.0) == {0, 1, 2, 3, 4}
    assert kept(2, 1.0) == {1, 3}
    assert kept(5, 0.65) == {1, 3}  # 0.5 < 0.65 <= 0.5 + 0.2
    assert kept(5, 0.75) == {1, 3, 4}
    # top-p over the top-k survivors, renormalised: 0.5 / 0.7 = 0.714 >= 0.7
    assert kept(2, 0.7) == {1}
    assert kept(2, 0.72) == {1, 3}


def test_min_p_filters():
    probs = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]])
    masked = apply_min_p(probs.log(), torch.tensor([0.3]))  # threshold 0.3 * 0.4 = 0.12
    assert masked[0].isfinite().tolist() == [True, True, True, False, False]

    draws = 4000
    logits = probs.log().expand(draws, -1)
    out = sample(logits, [row(min_p=0.3) for _ in range(draws)], torch.Generator().manual_seed(0))
    assert set(out.token_ids.tolist()) == {0, 1, 2}


def test_penalties_change_logits_as_the_formulas_say():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]] * 2)
    rows = [row(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0,
                frequency_penalty=0.5, presence_penalty=0.25),
            row(prompt=[0, 1], output=[2, 2, 3])]
    batch = SamplingBatch.build(rows, 6, "cpu", EOS)
    processed = Sampler.processed_logits(logits, batch)
    expected = torch.tensor([
        2.0 / 2,                      # in prompt, positive: divided by r
        -1.0 * 2,                     # in prompt, negative: multiplied by r
        0.5 / 2 - 0.5 * 2 - 0.25,     # twice in output: r, frequency x2, presence
        -0.5 * 2 - 0.5 * 1 - 0.25,    # once in output
        3.0,                          # unseen
        1.0,
    ])
    torch.testing.assert_close(processed[0], expected)
    torch.testing.assert_close(processed[1], logits[1])  # no penalties on this row
    assert logits[0, 0] == 2.0  # the input is not modified


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0]] * 4)  # EOS (0) best, then 2, then 3
    rows = [row(output=[9], temperature=0.0, min_tokens=2, stop_token_ids=[2]),
            row(output=[9, 9], temperature=0.0, min_tokens=2, stop_token_ids=[2]),
            row(output=[9], temperature=0.0, min_tokens=2, ignore_eos=True),
            row(output=[9], temperature=1.0, min_tokens=2, stop_token_ids=[2], seed=1)]
    out = sample(logits, rows)
    assert out.token_ids.tolist()[:3] == [3, EOS, EOS]
    assert out.token_ids[3] not in (EOS, 2)


def _chi_square(counts, expected):
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("params, keep", [
    (dict(temperature=0.7), [0, 1, 2, 3, 4, 5]),
    (dict(temperature=1.5, top_k=3), [1, 3, 4]),
])
def test_sampling_distribution_matches_softmax(params, keep):
    vocab, draws = 6, 30000
    logits = torch.tensor([0.1, 1.0, -0.5, 0.6, 0.8, -1.0])
    target = torch.zeros(vocab)
    target[keep] = torch.softmax(logits[keep] / params["temperature"], dim=0)
    out = sample(logits.expand(draws, -1), [row(**params) for _ in range(draws)],
                 torch.Generator().manual_seed(7))
    counts = torch.bincount(out.token_ids, minlength=vocab).float()
    assert counts[target == 0].sum() == 0
    # chi-square with len(keep) - 1 degrees of freedom; 25 is beyond the 0.999 quantile.
    assert _chi_square(counts[keep], draws * target[keep]) < 25


def test_logprobs_equal_log_softmax():
    logits = random_logits(3, 50, seed=8).to(torch.bfloat16)
    rows = [row(temperature=0.5, logprobs=4, repetition_penalty=1.5, output=[1, 2]),
            row(temperature=0.0, logprobs=0, min_tokens=3),
            row(temperature=1.0)]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    top_logprobs, top_ids = raw.topk(4, dim=-1)
    assert out.top_ids.shape == (3, 4) and out.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.top_logprobs, top_logprobs)
    torch.testing.assert_close(raw.gather(1, out.top_ids), top_logprobs)


def test_no_logprobs_requested_gives_empty_top():
    out = sample(random_logits(2, 10), [row(), row(temperature=0.0)])
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    assert out.logprobs.shape == (2,) and out.token_ids.dtype == torch.long


def test_prompt_logprobs():
    logits = random_logits(7, 30, seed=9)
    next_ids = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    result = compute_prompt_logprobs(logits, next_ids, num_top=3, chunk_size=3)
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(result.token_logprobs, raw[torch.arange(7), next_ids])
    top_logprobs, top_ids = raw.topk(3, dim=-1)
    torch.testing.assert_close(result.top_logprobs, top_logprobs)
    assert torch.equal(result.top_ids, top_ids)

    empty = compute_prompt_logprobs(logits[:0], next_ids[:0], num_top=2)
    assert empty.token_logprobs.shape == (0,) and empty.top_ids.shape == (0, 2)


def test_hot_path_stays_on_device(monkeypatch):
    """No host round trip in the sampler itself: every tensor-to-Python conversion fails
    while it runs, and all outputs live on the logits' device."""
    rows = [row(temperature=0.0, logprobs=2, presence_penalty=0.5, output=[1]),
            row(temperature=0.9, top_k=10, top_p=0.8, min_p=0.01, seed=3, min_tokens=5),
            row(temperature=1.1)]
    logits = random_logits(3, 64, seed=10)
    batch = SamplingBatch.build(rows, 64, logits.device, EOS)

    def forbidden(*args, **kwargs):
        raise AssertionError("host sync in the sampler hot path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = sampler(logits, batch)
    monkeypatch.undo()
    for tensor in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs):
        assert tensor.device == logits.device
    assert math.isfinite(float(out.logprobs.sum()))


def test_logprobs_skipped_when_nobody_asks_and_tokens_unchanged():
    """Without any logprobs request the [B, V] log_softmax is skipped (logprobs 0, no top
    columns); the sampled tokens are those of the same rows asking for logprobs."""
    logits = random_logits(4, 300, seed=9)
    kinds = [dict(temperature=0.0), dict(temperature=0.9, seed=3), dict(temperature=0.7, top_k=9, seed=4),
             dict(temperature=0.0, min_tokens=3)]
    bare = sample(logits, [row(**k) for k in kinds])
    asked = sample(logits, [row(**k, logprobs=2) for k in kinds])
    assert bare.token_ids.tolist() == asked.token_ids.tolist()
    assert bare.logprobs.tolist() == [0.0] * 4 and bare.top_ids.shape == (4, 0)
    assert (asked.logprobs < 0).all() and asked.top_ids.shape == (4, 2)
