"""One speculative step after the target's forward: verify every completing chunk's rows,
then draft the next step's tokens (docs/architecture.md, "Speculative decoding").

A decoding request with drafts d_1..d_k is scheduled as one chunk of k + 1 tokens (its last
token and the drafts, every row with logits), mixed with other requests' prefill chunks and
plain decodes. Here, per completing chunk (rows = its last 1 + drafts rows):
1. verify (verify.accept_drafts): the rows' tokens are sampled as a plain decode would sample
   them after the drafts before them; the leading accepted rows and the next row's token are
   emitted (1 .. k + 1 tokens);
2. rewind: the chunk's `num_rejected` = drafts not accepted; the engine adds only
   num_tokens - num_rejected to num_computed (invariant 1: the rejected positions' keys,
   entries and ring rows are overwritten when those positions are computed again);
3. draft (MTPProposer): the next drafts, at most what max_tokens leaves room for; their
   positions reserved in the cache (fewer drafts when pages are short).
Speculative steps run synchronously (the engine turns async scheduling off): the emitted
tokens are needed on the host before the drafts can be scheduled. One read-back a step: the
verified tokens and acceptance flags together. Plain greedy requests' drafts are not read back
(device_drafts.py: the next verify takes them from the device), and their verify needs no
sampling batch (`_verify_greedy`).
"""
from __future__ import annotations

import dataclasses

import torch

from ...cache.layout import PAGE_TOKENS
from ..inflight import HostCopy
from ..request import Request
from ..runner import StepLogits
from ..sampler import Sampler, SamplingBatch, SamplingRow, gather_logprobs
from ..scheduler import ScheduledChunk
from ..upload import upload_tree
from .device_drafts import DeviceDrafts
from .draft_graphs import DraftGraphs
from .mtp import DraftWork, MTPProposer
from .stats import SpecStats
from .verify import accept_drafts, leading_accepted


class SpeculativeDecoder:
    def __init__(self, spec_config, model, runner, cache, eos_token_id: int | None, generator: torch.Generator):
        self.k = spec_config.num_speculative_tokens
        self.model, self.runner, self.cache = model, runner, cache
        self.vocab, self.window = model.cfg.vocab_size, model.cfg.sliding_window
        self.eos_token_id, self.generator = eos_token_id, generator
        self.dspark = spec_config.method == "dspark"
        graphs = None
        if self.dspark:
            from .dspark import DSparkProposer
            from .dspark_graphs import DSparkGraphs
            if runner.graphs is not None:      # CUDA graphs on: the drafts of uniform steps replay too
                graphs = DSparkGraphs(model, runner.storage, runner.graphs.max_bs, self.k + 1, capture=True,
                                      h2d=runner.h2d)
            self.proposer = DSparkProposer(model, runner.storage, runner.h2d, spec_config.confidence_threshold,
                                           graphs)
        else:
            if runner.graphs is not None:
                graphs = DraftGraphs(model, runner.storage, runner.graphs.max_bs, self.k + 1, capture=True,
                                     h2d=runner.h2d)
            self.proposer = MTPProposer(model, runner.storage, runner.h2d, graphs)
        self.stats = SpecStats()
        self.device_drafts = DeviceDrafts()     # drafts of plain greedy requests, not read back
        self._draft_probs: dict[str, tuple[Request, torch.Tensor]] = {}   # rid -> (request, q [k, V])
        # [(request, drafts)] per verified chunk -> structured.masks.GrammarMask of its rows, or None
        # (set by the engine: drafts are checked against a request's grammar like any token)
        self.grammar_mask = None

    @torch.inference_mode()
    def step(self, chunks: list[ScheduledChunk], step: StepLogits):
        """-> (sampled: chunk index once per emitted token, in row order; the emitted tokens [N]
        on the device; their HostCopy of (tokens, logprobs, top ids, top logprobs)). Sets each
        chunk's num_rejected and each completing request's next drafts."""
        self._draft_probs = {rid: v for rid, v in self._draft_probs.items() if not v[0].is_finished}
        self.device_drafts.prune()
        done = [i for i, c in enumerate(chunks) if c.completes]
        if not done:
            self._draft(chunks, step, {})
            return [], None, None
        drafts = {i: self._drafts_in(chunks[i]) for i in done}
        rows, draft_ids, targets = [], [], []       # targets: (request, its first verify row, drafts)
        for i in done:
            last = step.first_row[i] + step.num_rows[i]
            targets.append((chunks[i].request, len(draft_ids), len(drafts[i])))
            rows += range(last - len(drafts[i]) - 1, last)
            draft_ids += drafts[i] + [-1]
        ids_t = self.device_drafts.ids(draft_ids, targets, self.runner.h2d)    # (held drafts: from the device)
        mask = self.grammar_mask([(chunks[i].request, drafts[i]) for i in done]) if self.grammar_mask else None
        if mask is None and all(_plain_greedy(chunks[i].request) for i in done):
            emitted, accepted, lps = self._verify_greedy(step.logits, rows, ids_t)
        else:
            emitted, accepted, lps = self._verify(step.logits, rows, self._sampling_rows(chunks, done, drafts),
                                                  ids_t, self._q_rows(chunks, done, drafts), draft_ids, mask)
        emitted_host, accepted_host = torch.stack((emitted, accepted.to(emitted.dtype))).tolist()   # one read-back
        sampled, keep, emitted_of, first = [], [], {}, 0
        for i in done:
            n = len(drafts[i])
            a = leading_accepted(accepted_host, first, n)
            chunks[i].num_rejected = n - a
            self.stats.record(n, a)
            sampled += [i] * (a + 1)
            keep += range(first, first + a + 1)
            emitted_of[i] = emitted_host[first:first + n + 1]
            first += n + 1
        if len(keep) < len(rows):         # (every draft accepted: every row is kept, no gather)
            keep_t = self.runner.h2d.upload([torch.tensor(keep)])[0]
            emitted, lps = emitted[keep_t], tuple(t[keep_t] for t in lps)
        values = [emitted, *lps]
        self._draft(chunks, step, emitted_of)
        return sampled, emitted, HostCopy(values)

    def draft_fills(self, chunks: list[ScheduledChunk]) -> list:
        """The fills (runner.PendingFill) of the step's verify rows whose drafts are still on the
        device (device_drafts.py), for runner.execute before the forward."""
        targets, row = [], 0
        for c in chunks:
            n = len(self._drafts_in(c))
            targets.append((c.request, row + c.num_tokens - n, n))     # the drafts: the chunk's last n rows
            row += c.num_tokens
        return self.device_drafts.fills(targets)

    def drafts_of(self, req: Request) -> list[int]:
        """A request's drafts (read back from the device if they are still there)."""
        return self.device_drafts.values(req)

    # ---- verify -------------------------------------------------------------------------
    def _drafts_in(self, c: ScheduledChunk) -> list[int]:
        """The drafts a completing chunk carries (the tokens past the request's known ones)."""
        req = c.request
        return req.spec_token_ids[:req.num_computed + c.num_tokens - req.num_tokens]

    def _sampling_rows(self, chunks: list[ScheduledChunk], done: list[int], drafts: dict) -> list[SamplingRow]:
        """Per verify row, what the sampler knows: the drafts before the row count as output."""
        rows = []
        for i in done:
            req, d = chunks[i].request, drafts[i]
            rows += [SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids + d[:j], req.generator)
                     for j in range(len(d) + 1)]
        return rows

    def _q_rows(self, chunks: list[ScheduledChunk], done: list[int], drafts: dict) -> list[torch.Tensor | None]:
        """Per verify row, the distribution its draft was drawn from (None: an argmax or no draft)."""
        out = []
        for i in done:
            entry, n = self._draft_probs.get(chunks[i].request.request_id), len(drafts[i])
            out += [entry[1][j] if entry is not None and j < n else None for j in range(n + 1)]
        return out

    def _verify_greedy(self, logits, rows, ids_t):
        """`_verify` for rows of plain greedy requests (`_plain_greedy`): the processed logits are
        the raw ones, so emitted = their argmax; no sampling batch, no logprobs."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            target = logits[rows[0]:rows[0] + len(rows)]
        else:
            target = logits[self.runner.h2d.upload([torch.tensor(rows)])[0]]
        emitted = target.argmax(dim=-1)
        empty = target.new_empty(len(rows), 0, dtype=torch.float32)
        return emitted, (emitted == ids_t) & (ids_t >= 0), (empty.new_zeros(len(rows)), empty.long(), empty)

    def _verify(self, logits, rows, sampling, ids_t, q_rows, draft_ids, mask=None):
        """Target logits rows `rows` of the step, ids_t [R] the drafts to check on the device
        (draft_ids: on the host, -1 where a greedy request's is on the device) -> (emitted [R],
        accepted [R], raw logprobs of the emitted tokens: chosen [R], top ids [R, n], top
        logprobs [R, n])."""
        batch = SamplingBatch.build(sampling, self.vocab, "cpu", self.eos_token_id, self.generator)
        batch.grammar = mask
        batch, rows_t = upload_tree((batch, torch.tensor(rows)), self.runner.h2d)
        target = logits[rows_t]
        processed = Sampler.processed_logits(target, batch)
        emitted, accepted = accept_drafts(processed, batch, ids_t, self._draft_q(batch, q_rows, draft_ids, target))
        if batch.wants_logprobs:
            lps = gather_logprobs(torch.log_softmax(target.float(), dim=-1), emitted, batch.max_num_logprobs)
        else:
            empty = target.new_empty(len(rows), 0, dtype=torch.float32)
            lps = (empty.new_zeros(len(rows)), empty.long(), empty)
        return emitted, accepted, lps

    def _draft_q(self, batch: SamplingBatch, q_rows: list, draft_ids: list[int], target: torch.Tensor):
        """[R, V] the distribution each row's draft was drawn from (one-hot at an argmax draft),
        or None when no sampling row has a stored one."""
        if not batch.random_rows or all(r is None for r in q_rows):
            return None
        q = torch.zeros(len(q_rows), self.vocab, device=target.device)
        for n, (row, d) in enumerate(zip(q_rows, draft_ids)):
            if row is not None:
                q[n] = row
            elif d >= 0:
                q[n, d] = 1.0
        return q

    # ---- draft --------------------------------------------------------------------------
    def _draft(self, chunks: list[ScheduledChunk], step: StepLogits, emitted_of: dict[int, list[int]]) -> None:
        works, hidden_row = [], 0
        for i, c in enumerate(chunks):
            work = self._work(c, hidden_row, emitted_of.get(i))
            hidden_row += c.num_tokens
            if i in emitted_of:
                c.request.spec_token_ids = []
                self._draft_probs.pop(c.request.request_id, None)
                self.device_drafts.drop(c.request)
            if work is not None:
                works.append(work)
        if not works:
            return
        proposals = self.proposer.propose(works, step.taps if self.dspark else step.hidden, self._draft_batch)
        drafting = [w for w in works if w.num_drafts > 0]
        # plain greedy requests' drafts stay on the device (the next verify takes them from there,
        # device_drafts.py); the others' are read back: their verify needs them on the host. (A
        # DSpark confidence threshold cuts the drafts by values on the device: read back already.)
        on_device = not self.dspark or self.proposer.threshold <= 0
        stay = [on_device and _plain_greedy(w.request) for w in drafting]
        held = [(w.request, d) for w, (d, _), s in zip(drafting, proposals, stay) if s]
        if held:
            self.device_drafts.hold(*map(list, zip(*held)))
        back = [(w, d, q) for w, (d, q), s in zip(drafting, proposals, stay) if not s]
        host = torch.cat([d for _, d, _ in back]).tolist() if back else []
        first = 0
        for w, d, q in back:
            w.request.spec_token_ids = host[first:first + len(d)]
            first += len(d)
            if q is not None:
                self._draft_probs[w.request.request_id] = (w.request, q)

    def _work(self, c: ScheduledChunk, hidden_row: int, emitted: list[int] | None) -> DraftWork | None:
        """The catch-up (and, for a completing chunk with `emitted` = its rows' tokens, the
        chain) of one chunk; None if the request will never draft again or no position of the
        chunk is in a later draft's window."""
        req = c.request
        known = req.num_tokens                      # tokens known before this step's emission
        start, end = req.num_computed, req.num_computed + c.num_tokens
        emitted_now = len(emitted) - c.num_rejected if emitted is not None else 1
        room = req.params.max_tokens - len(req.output_token_ids) - emitted_now   # tokens still to come
        # DSpark: every position (a prefix-cache checkpoint then holds the drafter's window keys too);
        # MTP: the positions this request's later drafts read, and the window before the page
        # boundary a checkpoint of this chunk may pack (another request resumes from it)
        own = max(start, known - self.window) if room > 1 else end
        lo = start if self.dspark else min(own, self._checkpoint_window(start, end))
        if lo >= end:
            return None                             # nothing a draft's window reads
        n_known = max(0, min(end, known - 1) - lo)  # positions t whose x_{t+1} was known before the step
        tokens = req.known_tokens(lo + 1, n_known) + (emitted[:end - lo - n_known] if emitted else [])
        anchor_pos, k = -1, 0
        if emitted is not None:
            anchor_pos = known - 2 + emitted_now     # the last accepted position
            k = max(0, self._reserve_chain(req, min(self.k, room - 1), anchor_pos, end))
        held = self.cache.seq(req)
        return DraftWork(req, held.slot, held.pages, held.swa_pages, lo, tokens, hidden_row + lo - start,
                         anchor=anchor_pos - lo if emitted is not None else -1, num_drafts=k)

    def _checkpoint_window(self, start: int, end: int) -> int:
        """The first position of chunk [start, end) inside the window [L - W, L) of the last page
        boundary L whose window it reaches (the boundary a prefix-cache checkpoint packs the SWA
        layers, the MTP ones included, before: docs/architecture.md, "Cache"); `end` if none."""
        L = (end - 1 + self.window) // PAGE_TOKENS * PAGE_TOKENS
        return max(start, L - self.window) if self.cache.prefix is not None and L > start else end

    def _reserve_chain(self, req: Request, k: int, anchor_pos: int, end: int) -> int:
        """Reserve the chain's positions (anchor_pos + 1 .. anchor_pos + k - 1); fewer drafts when
        the cache cannot hold them (the step already holds positions up to `end`)."""
        while k > 1 and anchor_pos + k > end and not self.cache.reserve(req, anchor_pos + k - req.num_computed):
            k -= 1
        return k

    def _draft_batch(self, reqs: list[Request]) -> SamplingBatch:
        """How drafts are drawn: each request's temperature and filters, no penalties or masks
        (any q is exact as long as verification uses the same one)."""
        rows = [SamplingRow(_draft_params(r.params), (), (), r.generator) for r in reqs]
        batch = SamplingBatch.build(rows, self.vocab, "cpu", None, self.generator)
        return upload_tree(batch, self.runner.h2d)


def _plain_greedy(req: Request) -> bool:
    """Greedy with nothing that changes the logits (penalties, logit_bias, a grammar, a min_tokens
    ban on any verify row) and no logprobs: its rows' tokens are the raw logits' argmax, and its
    drafts' values matter only to the verify forward and the acceptance test."""
    p = req.params
    return (p.is_greedy and not p.has_penalties and not p.logit_bias and p.logprobs is None
            and p.structured is None and len(req.output_token_ids) >= p.min_tokens)


def _draft_params(params):
    return dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                               min_tokens=0, logprobs=None, prompt_logprobs=None)

