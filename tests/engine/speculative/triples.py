"""The chi-square harness of the sampling tests of speculative decoding (docs/speculative.md):
a tiny model samples 3 tokens (temperature 1.5, top-k 3) for many requests of one prompt with
drafts; the 27 token triples must follow the exact distribution of sampling without drafts,
p(x1) p(x2 | x1) p(x3 | x1, x2)."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dsv4.engine.oneshot import full_logits
from dsv4.engine.sampler import Sampler, SamplingBatch, SamplingRow
from dsv4.sampling_params import SamplingParams

TOP_K, TEMPERATURE = 3, 1.5


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expecting fewer than `min_expected`
    observations are pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi_square_bound(dof: int) -> float:
    """A bound the statistic exceeds with probability < 1e-5 under the null (Wilson-Hilferty)."""
    z = 4.27
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


class Exact(NamedTuple):
    prompt: list[int]
    target: object                 # target(prefix tuple) -> fp32 [vocab]: what sampling draws from after it
    triples: list[tuple[int, int, int]]
    probs: torch.Tensor            # float64 [27], the exact probability of each triple


def exact_triples(model, vocab_size: int, prompt: list[int]) -> Exact:
    """The exact distribution of the 27 token triples sampling can give after `prompt`
    (target probabilities cached per prefix)."""
    batch = SamplingBatch.build([SamplingRow(sampling(), (), ())], vocab_size, "cpu")
    known: dict[tuple, torch.Tensor] = {}

    def target(prefix: tuple) -> torch.Tensor:
        if prefix not in known:
            known[prefix] = Sampler.probs(full_logits(model, list(prefix))[-1:], batch)[0]
        return known[prefix]

    triples, probs = [], []
    p0 = target(tuple(prompt))
    for x1 in p0.nonzero().flatten().tolist():
        p1 = target(tuple(prompt) + (x1,))
        for x2 in p1.nonzero().flatten().tolist():
            p2 = target(tuple(prompt) + (x1, x2))
            for x3 in p2.nonzero().flatten().tolist():
                triples.append((x1, x2, x3))
                probs.append(float(p0[x1] * p1[x2] * p2[x3]))
    assert len(triples) == TOP_K ** 3
    return Exact(list(prompt), target, triples, torch.tensor(probs, dtype=torch.float64))


def sampling(max_tokens: int | None = None) -> SamplingParams:
    if max_tokens is None:
        return SamplingParams(temperature=TEMPERATURE, top_k=TOP_K)
    return SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=max_tokens, ignore_eos=True)


def count_triples(outputs, exact: Exact) -> torch.Tensor:
    """How often each triple starts the outputs' tokens: float64 [27], in `exact.triples` order."""
    counts = torch.zeros(len(exact.triples), dtype=torch.float64)
    index = {t: i for i, t in enumerate(exact.triples)}
    for out in outputs:
        counts[index[tuple(out.token_ids[:3])]] += 1
    return counts
