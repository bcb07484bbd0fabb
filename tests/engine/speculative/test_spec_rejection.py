"""Rejection sampling keeps the target distribution (docs/speculative.md).

Unit level (`verify.accept_drafts`): drafts drawn from a q unlike the target p (temperature,
top-k, top-p applied) are accepted at rate sum(min(p, q)) and the emitted token is
distributed as p (chi-square over many rows); the same test rejects the common wrong rule
(accept with probability p(d), resample from p). Engine level: a tiny model samples 3 tokens
(temperature 1.5, top-k 3) for thousands of requests with 2 drafts per verify drawn from a
known q; the empirical distribution of the 27 token triples matches the exact one of
sampling without drafts, p(x1) p(x2 | x1) p(x3 | x1, x2); a wrong acceptance rule fails."""
from __future__ import annotations

import math

import pytest
import torch

import dsv4.engine.speculative.decoder as decoder_module
from dsv4.engine.sampler import Sampler, SamplingBatch, SamplingRow, exponential_noise
from dsv4.engine.speculative.verify import accept_drafts
from dsv4.sampling_params import SamplingParams
from triples import Exact, chi_square, chi_square_bound, count_triples, exact_triples, sampling

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- unit level ----------------------------------------------------------------------------
ROWS, V = 40000, 8
PARAMS = SamplingParams(temperature=0.8, top_k=5, top_p=0.95)


def _batch(params: SamplingParams, rows: int, seed: int) -> SamplingBatch:
    return SamplingBatch.build([SamplingRow(params, (), ())] * rows, V, "cpu", None,
                               torch.Generator().manual_seed(seed))


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=gen) * 1.5
    batch = _batch(PARAMS, ROWS, seed)
    processed = logits.expand(ROWS, V).contiguous()
    p = Sampler.probs(processed[:1], _batch(PARAMS, 1, 0))[0]
    q = torch.softmax(torch.randn(V, generator=gen), -1)            # a draft distribution unlike p
    drafts = torch.multinomial(q, ROWS, replacement=True, generator=gen)
    return processed, batch, p, q, drafts


def test_emitted_tokens_are_distributed_as_the_target():
    processed, batch, p, q, drafts = _setup()
    emitted, accepted = accept_drafts(processed, batch, drafts, q.expand(ROWS, V))
    stat, dof = chi_square(torch.bincount(emitted, minlength=V).double(), p.double())
    assert stat < chi_square_bound(dof), (stat, dof)
    assert bool((p[emitted] > 0).all()), "a token outside top-k / top-p was emitted"
    rate, want = float(accepted.double().mean()), float(torch.minimum(p, q).sum())
    assert abs(rate - want) < 5 * math.sqrt(want * (1 - want) / ROWS), (rate, want)
    assert bool((emitted[accepted] == drafts[accepted]).all())


def test_one_hot_drafts_and_rows_without_drafts_keep_the_target():
    processed, batch, p, _, drafts = _setup(1)
    for draft_ids in (drafts, torch.full((ROWS,), -1)):
        emitted, accepted = accept_drafts(processed, batch, draft_ids, None)
        stat, dof = chi_square(torch.bincount(emitted, minlength=V).double(), p.double())
        assert stat < chi_square_bound(dof), (stat, dof)
    assert not bool(accepted.any())


def _wrong_rule(processed, batch, draft_ids, draft_probs):
    """Accept with probability p(d), else resample from p: ignores q, biased toward q."""
    p = Sampler.probs(processed, batch)
    u = torch.rand(p.shape[0], generator=batch.shared_generator)
    ok = (draft_ids >= 0) & (u < p.gather(1, draft_ids.clamp(min=0)[:, None])[:, 0])
    drawn = (p / exponential_noise(batch, p.shape, p.device)).argmax(dim=-1)
    return torch.where(ok, draft_ids, drawn), ok


def test_the_chi_square_test_rejects_a_wrong_rule():
    processed, batch, p, q, drafts = _setup()
    emitted, _ = _wrong_rule(processed, batch, drafts, q.expand(ROWS, V))
    stat, dof = chi_square(torch.bincount(emitted, minlength=V).double(), p.double())
    assert stat > 2 * chi_square_bound(dof), (stat, dof)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    batch = SamplingBatch.build([SamplingRow(SamplingParams(temperature=0.0), (), ())] * 6, V, "cpu")
    best = logits.argmax(-1)
    drafts = torch.where(torch.arange(6) % 2 == 0, best, (best + 1) % V)
    drafts[5] = -1
    emitted, accepted = accept_drafts(logits, batch, drafts, None)
    assert emitted.tolist() == best.tolist()
    assert accepted.tolist() == [True, False, True, False, True, False]


# ---- engine level --------------------------------------------------------------------------
REQUESTS = 2000


class MixtureProposer:
    """Draws each draft from a q unlike the target p = target(prefix) (the exact distribution
    after the committed prefix), and returns q: 0.2 p + 0.6 on p's least likely token + 0.2 on a
    token p never samples."""

    def __init__(self, target, vocab: int, seed: int):
        self.target, self.vocab = target, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def q(self, prefix: tuple) -> torch.Tensor:
        p = self.target(prefix)
        q = 0.2 * p
        q[int(torch.where(p > 0, p, 2.0).argmin())] += 0.6
        q[int((p == 0).nonzero()[0])] += 0.2
        return q

    def propose(self, works, hidden, batch_of):
        out = []
        for w in works:
            if w.num_drafts == 0:
                continue
            prefix = tuple(w.request.known_tokens(0, w.start + 1) + w.tokens[:w.anchor + 1])
            drafts, qs = [], []
            for _ in range(w.num_drafts):
                q = self.q(prefix)
                d = int(torch.multinomial(q, 1, generator=self.gen))
                drafts.append(d)
                qs.append(q)
                prefix += (d,)
            out.append((torch.tensor(drafts), torch.stack(qs)))
        return out


@pytest.fixture(scope="module")
def exact(tiny) -> Exact:
    return exact_triples(tiny.model, tiny.cfg.vocab_size, tiny.ids(6, seed=77))


def _sample_triples(tiny, sp, exact, wrong: bool, monkeypatch) -> tuple[torch.Tensor, object]:
    eng = tiny.engine(speculative_config=sp.spec(2), max_num_seqs=512, max_num_batched_tokens=4096,
                      num_pages=520, seed=5)
    eng.spec.proposer = MixtureProposer(exact.target, tiny.cfg.vocab_size, seed=11)
    if wrong:
        monkeypatch.setattr(decoder_module, "accept_drafts", _wrong_rule)
    params = sampling(max_tokens=4)
    outs = sp.drive(eng, [sp.Req(str(i), exact.prompt, params) for i in range(REQUESTS)])
    return count_triples(outs.values(), exact), eng.spec.stats


def test_engine_samples_the_target_distribution_with_drafts(tiny, sp, exact, monkeypatch):
    counts, stats = _sample_triples(tiny, sp, exact, False, monkeypatch)
    stat, dof = chi_square(counts, exact.probs)
    assert stat < chi_square_bound(dof), (stat, dof)
    assert 0.2 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9, "drafts rarely or always accepted"
    assert stats.accepted_per_pos[1] > 0


def test_engine_with_a_wrong_acceptance_rule_fails_the_test(tiny, sp, exact, monkeypatch):
    counts, _ = _sample_triples(tiny, sp, exact, True, monkeypatch)
    stat, dof = chi_square(counts, exact.probs)
    assert stat > chi_square_bound(dof), (stat, dof)
