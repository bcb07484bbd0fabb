"""Batched sampling of one next token per row, with vLLM's semantics.

Shapes: B rows (one per sequence being sampled this step), V vocabulary entries.
Per row, on fp32 logits:
  logit_bias (added to the listed tokens' logits)
  -> min_tokens mask (finishing tokens -> -inf while too few tokens were generated)
  -> penalties (repetition over prompt + output, then frequency and presence over output)
  -> greedy rows: argmax; other rows: temperature -> top-k -> top-p -> min-p -> sample.
Min-p keeps tokens whose probability is at least min_p times the top probability; that
ratio is unchanged by renormalising after top-k/top-p, so applying it last equals applying
it to the temperature-scaled distribution (vLLM applies it before top-k/top-p).

Sampling draws one Exp(1) variable per vocabulary entry and takes argmax(p / noise), which
picks token i with probability p_i. Each seeded row draws its noise from its own
generator, so its tokens depend only on its seed and its own history, never on the other
rows of the batch or on its row position. Unseeded rows share one generator.

Reported logprobs are "raw": log_softmax of the logits as the model produced them, before
any penalty, mask, temperature or filter.

Everything stays on the logits' device; the hot path never copies data to the host.
`SamplingBatch.build` does the per-request Python work (one pass over rows) up front.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.ops.backend import use_triton
from dsv4.sampling_params import SamplingParams
from dsv4.structured.masks import GrammarMask, keep_bits

NEG_INF = float("-inf")


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row."""
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far, not including this step's token
    generator: torch.Generator | None = None  # the request's own, when params.seed is set
    num_pending: int = 0  # generated tokens not in output_token_ids yet (still on the device)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for a seeded request (None for an unseeded one). Create it
    once per request and keep it for the request's lifetime, on the logits' device."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class Penalties:
    repetition: torch.Tensor  # [B] f32; 1.0 = off
    frequency: torch.Tensor  # [B] f32; 0.0 = off
    presence: torch.Tensor  # [B] f32; 0.0 = off
    prompt_mask: torch.Tensor  # [B, V] bool: token occurs in the row's prompt
    output_counts: torch.Tensor  # [B, V] f32: occurrences among the row's generated tokens


@dataclass
class SamplingBatch:
    """Per-row sampling state as device tensors, built once per step."""
    is_greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] f32; 1.0 on greedy rows
    top_k: torch.Tensor | None  # [B] long in [1, V], V = off; None: no row uses top-k/top-p
    top_p: torch.Tensor | None  # [B] f32 in (0, 1], 1.0 = off; None together with top_k
    min_p: torch.Tensor | None  # [B] f32 in [0, 1], 0.0 = off; None: no row uses min-p
    penalties: Penalties | None  # None: no row uses a penalty
    banned: tuple[torch.Tensor, torch.Tensor] | None  # ([N] rows, [N] token ids) -> -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # ([M] rows, [M] ids, [M] f32) added
    random_rows: list[int]  # rows that sample (not greedy); empty: all greedy
    shared_noise_rows: torch.Tensor | None  # [M] long: random rows without own generator
    seeded_rows: list[tuple[int, torch.Generator]]  # random rows with their own generator
    shared_generator: torch.Generator | None  # for unseeded rows; None: torch's global RNG
    max_num_logprobs: int  # most `logprobs` any row asked for; 0 if none
    wants_logprobs: bool = True  # some row asked for logprobs (else the chosen one is not computed)
    grammar: GrammarMask | None = None  # token bitmask of the rows under a grammar (structured/masks.py)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str,
              eos_token_id: int | None = None,
              shared_generator: torch.Generator | None = None) -> SamplingBatch:
        params = [row.params for row in rows]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        shared = [i for i in random_rows if rows[i].generator is None]
        top_k, top_p, min_p = _filter_tensors(params, random_rows, vocab_size, device)
        return cls(
            is_greedy=_tensor([p.is_greedy for p in params], torch.bool, device),
            temperature=_tensor([1.0 if p.is_greedy else p.temperature for p in params],
                                torch.float32, device),
            top_k=top_k, top_p=top_p, min_p=min_p,
            penalties=_build_penalties(rows, vocab_size, device),
            banned=_build_min_tokens_ban(rows, eos_token_id, device),
            bias=_build_logit_bias(params, device),
            random_rows=random_rows,
            shared_noise_rows=_tensor(shared, torch.long, device) if shared else None,
            seeded_rows=[(i, rows[i].generator) for i in random_rows
                         if rows[i].generator is not None],
            shared_generator=shared_generator,
            max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            wants_logprobs=any(p.logprobs is not None for p in params),
        )


def _tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _filter_tensors(params: list[SamplingParams], random_rows: list[int], vocab_size: int,
                    device: torch.device | str) -> tuple[torch.Tensor | None, ...]:
    """(top_k, top_p, min_p) as SamplingBatch holds them: None where no sampling row
    uses the filter; on greedy rows and rows without the filter, the "off" value."""
    def top_k_of(p: SamplingParams) -> int:
        return vocab_size if p.is_greedy or p.top_k <= 0 else min(p.top_k, vocab_size)

    def top_p_of(p: SamplingParams) -> float:
        return 1.0 if p.is_greedy else p.top_p

    def min_p_of(p: SamplingParams) -> float:
        return 0.0 if p.is_greedy else p.min_p

    sampling = [params[i] for i in random_rows]
    top_k = top_p = min_p = None
    if any(top_k_of(p) < vocab_size or top_p_of(p) < 1.0 for p in sampling):
        top_k = _tensor([top_k_of(p) for p in params], torch.long, device)
        top_p = _tensor([top_p_of(p) for p in params], torch.float32, device)
    if any(min_p_of(p) > 0.0 for p in sampling):
        min_p = _tensor([min_p_of(p) for p in params], torch.float32, device)
    return top_k, top_p, min_p


def _build_penalties(rows: Sequence[SamplingRow], vocab_size: int,
                     device: torch.device | str) -> Penalties | None:
    if not any(row.params.has_penalties for row in rows):
        return None
    # Token histories are only read for rows that use them.
    prompts = [row.prompt_token_ids if row.params.repetition_penalty != 1.0 else ()
               for row in rows]
    outputs = [row.output_token_ids if row.params.has_penalties else () for row in rows]
    return Penalties(
        repetition=_tensor([row.params.repetition_penalty for row in rows], torch.float32, device),
        frequency=_tensor([row.params.frequency_penalty for row in rows], torch.float32, device),
        presence=_tensor([row.params.presence_penalty for row in rows], torch.float32, device),
        prompt_mask=token_counts(prompts, vocab_size, device) > 0,
        output_counts=token_counts(outputs, vocab_size, device),
    )


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device | str) -> torch.Tensor:
    """[B, V] f32: how often each token id occurs in each row's list."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    # Pad with the out-of-vocabulary id V, counted in an extra column that is dropped.
    padded = [list(tokens) + [vocab_size] * (width - len(tokens)) for tokens in token_lists]
    ids = _tensor(padded, torch.long, device).view(len(token_lists), width)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]


def _build_min_tokens_ban(rows: Sequence[SamplingRow], eos_token_id: int | None,
                          device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs to mask: the finishing tokens of rows below min_tokens."""
    pairs = [(i, token) for i, row in enumerate(rows)
             if len(row.output_token_ids) + row.num_pending < row.params.min_tokens
             for token in row.params.finishing_token_ids(eos_token_id)]
    if not pairs:
        return None
    ban_rows, ban_tokens = zip(*pairs)
    return _tensor(list(ban_rows), torch.long, device), _tensor(list(ban_tokens), torch.long, device)


def _build_logit_bias(params: list[SamplingParams], device: torch.device | str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, token ids, biases) of every row's logit_bias; None when no row has one."""
    triples = [(i, token, bias) for i, p in enumerate(params) if p.logit_bias
               for token, bias in p.logit_bias.items()]
    if not triples:
        return None
    rows, tokens, biases = zip(*triples)
    return (_tensor(list(rows), torch.long, device), _tensor(list(tokens), torch.long, device),
            _tensor(list(biases), torch.float32, device))


def count_pending(penalties: Penalties, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Add tokens known only on the device to the output counts: row rows[i] generated
    token_ids[i] ([P] long each, on the counts' device)."""
    penalties.output_counts.index_put_((rows, token_ids), torch.ones_like(rows, dtype=torch.float32),
                                       accumulate=True)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """vLLM's formulas on [B, V] logits. For tokens seen in prompt or output, repetition
    penalty r divides positive logits by r and multiplies the others by r; then
    logit -= frequency * count_in_output + presence * (count_in_output > 0)."""
    seen_in_output = penalties.output_counts > 0
    seen = penalties.prompt_mask | seen_in_output
    r = penalties.repetition[:, None]
    repeated = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, repeated, logits)
    return (logits - penalties.frequency[:, None] * penalties.output_counts
            - penalties.presence[:, None] * seen_in_output)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside the row's top-k (ties with the k-th value stay),
    then outside the smallest set of most likely tokens whose probability, renormalised
    over the top-k survivors, reaches top_p. The most likely token always stays."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    kth_value = sorted_logits.gather(1, (top_k - 1)[:, None])
    drop = sorted_logits < kth_value
    probs = sorted_logits.masked_fill(drop, NEG_INF).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] probability of the better tokens
    drop |= (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop_in_vocab_order = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop_in_vocab_order, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, NEG_INF)



def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """Tokens a row's grammar does not allow -> -inf, in place: logits [B, V] fp32, mask.rows [R],
    mask.bitmask [R, ceil(V / 32)] int32 (bit t % 32 of word t // 32 = token t allowed), ANDed
    with mask.keep [ceil(V / 32)] when set. One test of each bit against its selector ANDed with
    keep (`mask.keep_bits`, made once by the caller, else here) and one masked fill over the R
    rows (in place, with no gather, when they are all B): three kernels. On CUDA with Triton: one
    launch (ops/triton/grammar_mask.py)."""
    if use_triton(logits) and logits.dtype == torch.float32 and logits.stride(1) == 1:
        from dsv4.ops.triton.grammar_mask import apply_grammar_mask as one_launch
        one_launch(logits, mask.rows, mask.bitmask, mask.keep, mask.covers_all)
        return
    select = mask.keep_bits if mask.keep_bits is not None else keep_bits(mask.keep, mask.bitmask.device)
    denied = ((mask.bitmask[:, :, None] & select) == 0).view(mask.bitmask.shape[0], -1)[:, :logits.shape[1]]
    if mask.covers_all and mask.bitmask.shape[0] == logits.shape[0]:
        logits.masked_fill_(denied, NEG_INF)
    else:
        logits[mask.rows] = logits[mask.rows].masked_fill(denied, NEG_INF)


def copy_takes_mask(logits: torch.Tensor, mask: GrammarMask) -> bool:
    """Whether the sampler's fp32 copy of `logits` takes `mask` in the same launch
    (ops/triton/grammar_mask.py `masked_copy`): Triton on CUDA, every row masked in order."""
    return (use_triton(logits) and mask.covers_all and mask.bitmask.shape[0] == logits.shape[0]
            and logits.stride(1) == 1)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] f32: raw logprob of the chosen token (all 0 when no row asked)
    top_ids: torch.Tensor  # [B, k] long, k = batch.max_num_logprobs; best first
    top_logprobs: torch.Tensor  # [B, k] f32: raw logprobs of top_ids


class Sampler:
    """Stateless: all per-request state lives in the SamplingBatch and its generators."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [B, V], any float dtype; computed in fp32 without modifying the input."""
        processed = self.processed_logits(logits, batch)
        token_ids = processed.argmax(dim=-1)
        if batch.random_rows:
            token_ids = torch.where(batch.is_greedy, token_ids, self._sample(processed, batch))
        if not batch.wants_logprobs:        # nobody reads them: skip the [B, V] log_softmax
            empty = logits.new_empty(logits.shape[0], 0, dtype=torch.float32)
            return SamplerOutput(token_ids, empty.new_zeros(logits.shape[0]), empty.long(), empty)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen, top_ids, top_logprobs = gather_logprobs(raw_logprobs, token_ids,
                                                        batch.max_num_logprobs)
        return SamplerOutput(token_ids, chosen, top_ids, top_logprobs)

    @staticmethod
    def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """fp32 [B, V] logits with logit_bias, the min_tokens mask and penalties applied (a new tensor
        whenever anything is applied; the input is never written): what greedy rows take the
        argmax of."""
        written = batch.banned is not None or batch.bias is not None or batch.grammar is not None
        grammar = batch.grammar
        if grammar is not None and copy_takes_mask(logits, grammar):   # the copy and the mask in one launch:
            from dsv4.ops.triton.grammar_mask import masked_copy   # -inf first is the same as -inf after
            logits, grammar = masked_copy(logits, grammar.bitmask, grammar.keep), None  # a bias or a ban
        else:
            logits = logits.to(torch.float32, copy=written)   # never written otherwise
        if batch.bias is not None:
            rows, tokens, biases = batch.bias
            logits.index_put_((rows, tokens), biases, accumulate=True)
        if batch.banned is not None:
            logits[batch.banned] = NEG_INF          # a scalar fill: no host-to-device copy
        if grammar is not None:
            apply_grammar_mask(logits, grammar)
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B, V] the distribution sampling rows draw from, given processed logits: temperature
        -> top-k -> top-p -> min-p -> softmax (meaningless on greedy rows)."""
        logits = logits / batch.temperature[:, None]
        if batch.top_k is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        return logits.softmax(dim=-1)

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B] sampled token ids (meaningless on greedy rows)."""
        probs = Sampler.probs(logits, batch)
        return (probs / exponential_noise(batch, probs.shape, probs.device)).argmax(dim=-1)


def exponential_noise(batch: SamplingBatch, shape: torch.Size,
                      device: torch.device) -> torch.Tensor:
    """[B, V] Exp(1) draws for the sampling rows (1.0 on greedy rows). A seeded row draws
    exactly V values from its own generator each step."""
    noise = torch.ones(shape, device=device)
    if batch.shared_noise_rows is not None:
        shared = torch.empty(len(batch.shared_noise_rows), shape[1], device=device)
        noise[batch.shared_noise_rows] = shared.exponential_(generator=batch.shared_generator)
    for row, generator in batch.seeded_rows:
        noise[row].exponential_(generator=generator)
    # Exp(1) can return 0; keep p / noise finite.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From [N, V] logprobs: the logprob of token_ids [N], and the num_top best
    ([N, k] ids, [N, k] logprobs, best first; k = min(num_top, V))."""
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    k = min(num_top, logprobs.shape[1])
    if k == 0:
        empty = logprobs.new_empty(logprobs.shape[0], 0)
        return chosen, empty.long(), empty
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return chosen, top_ids, top_logprobs


@dataclass
class PromptLogprobs:
    token_logprobs: torch.Tensor  # [T] f32: logprob of the actual next prompt token
    top_ids: torch.Tensor  # [T, k] long
    top_logprobs: torch.Tensor  # [T, k] f32


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor,
                            num_top: int, chunk_size: int = 1024) -> PromptLogprobs:
    """Raw logprobs for prompt positions. logits: [T, V], position t predicting
    next_token_ids[t] ([T] long). Works through T in chunks of `chunk_size` rows so the
    fp32 [chunk, V] log_softmax bounds the extra memory."""
    parts = []
    # At least one (possibly empty) chunk, so T = 0 yields correctly shaped empty tensors.
    for start in range(0, max(logits.shape[0], 1), chunk_size):
        rows = slice(start, start + chunk_size)
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        parts.append(gather_logprobs(logprobs, next_token_ids[rows], num_top))
    chosen, top_ids, top_logprobs = (torch.cat(column) for column in zip(*parts))
    return PromptLogprobs(chosen, top_ids, top_logprobs)
