"""Verification of drafted tokens against the target model's logits, batched over rows
(docs/speculative.md has the math).

Row r of a verify chunk holds the target's logits after the request's tokens and the chunk's
drafts d_1 .. d_r; draft_ids[r] = d_{r+1}, the draft to check there (-1 on the chunk's last
row: nothing to check, the bonus token is drawn there). Per row, on the sampler's processed
logits (min_tokens mask and penalties, with the drafts before the row counted as output):

* greedy rows: emitted = argmax; the draft is accepted iff it equals it. Tokens are exactly
  those of decoding without drafts.
* sampling rows, target p (temperature, top-k, top-p, min-p: `Sampler.probs`), draft drawn from
  q: accepted with probability min(1, p(d) / q(d)); on rejection the emitted token is drawn
  from the residual max(p - q, 0) (normalised), on the last row from p. The emitted token of
  the first rejected row is then distributed exactly as p (docs/speculative.md has the proof
  and the sources), so a request's tokens have the distribution of decoding without drafts.

A chunk keeps the emitted tokens of its leading accepted rows and of the first row that is not
accepted (the correction or bonus token): 1 to k + 1 tokens per verify.
"""
from __future__ import annotations

import torch

from ..sampler import Sampler, SamplingBatch, exponential_noise


def accept_drafts(processed: torch.Tensor, batch: SamplingBatch, draft_ids: torch.Tensor,
                  draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """processed [R, V] fp32 (Sampler.processed_logits), draft_ids [R] long (-1: none),
    draft_probs [R, V] the distribution each sampling row's draft was drawn from (rows of greedy
    requests and rows without a draft are not read; None: every draft was an argmax, q one-hot)
    -> (emitted [R] long, accepted [R] bool)."""
    emitted = processed.argmax(dim=-1)
    accepted = (emitted == draft_ids) & (draft_ids >= 0)
    if not batch.random_rows:
        return emitted, accepted
    p = Sampler.probs(processed, batch)
    has = draft_ids >= 0
    d = draft_ids.clamp(min=0)[:, None]
    q = draft_probs if draft_probs is not None else torch.zeros_like(p).scatter_(1, d, 1.0)
    p_d, q_d = p.gather(1, d)[:, 0], q.gather(1, d)[:, 0]
    ok = has & (uniform_draws(batch, p.shape[0], p.device) * q_d < p_d)
    residual = torch.where(has[:, None], (p - q).clamp(min=0), p)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)   # p == q up to rounding
    drawn = (residual / exponential_noise(batch, residual.shape, residual.device)).argmax(dim=-1)
    sampled = torch.where(ok, draft_ids, drawn)
    return torch.where(batch.is_greedy, emitted, sampled), torch.where(batch.is_greedy, accepted, ok)


def uniform_draws(batch: SamplingBatch, rows: int, device) -> torch.Tensor:
    """[R] U[0, 1) draws for the sampling rows (seeded rows from their own generator, as
    `exponential_noise` draws; 1.0 on greedy rows)."""
    u = torch.ones(rows, device=device)
    if batch.shared_noise_rows is not None:
        shared = torch.empty(len(batch.shared_noise_rows), device=device)
        u[batch.shared_noise_rows] = shared.uniform_(generator=batch.shared_generator)
    for row, generator in batch.seeded_rows:
        u[row:row + 1].uniform_(generator=generator)
    return u


def sample_drafts(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's logits [R, V] -> (drafts [R] long, q [R, V] or None): argmax on greedy rows;
    on sampling rows a draw from q = Sampler.probs (the request's temperature and filters),
    returned for `accept_drafts`. None when every row is greedy."""
    logits = logits.float()
    drafts = logits.argmax(dim=-1)
    if not batch.random_rows:
        return drafts, None
    q = Sampler.probs(logits, batch)
    drawn = (q / exponential_noise(batch, q.shape, q.device)).argmax(dim=-1)
    return torch.where(batch.is_greedy, drafts, drawn), q


def leading_accepted(accepted: list[bool], first: int, count: int) -> int:
    """How many of rows [first, first + count) are accepted before the first one that is not."""
    n = 0
    while n < count and accepted[first + n]:
        n += 1
    return n
