"""The sampler's per-row inputs on the device, kept between steps (docs/architecture.md, "Engine").

A `SamplingBatch` is a function of the rows' requests: their parameters and generators, and —
only for penalties, the min_tokens ban and grammar masks — their tokens so far. When a step
samples the same requests in the same order as the previous one and none of those per-step
parts is in use, the previous step's batch (already on the device, never written by the
sampler) is the batch this step would build: it is reused, with no Python pass over the rows
and no upload. A plain greedy row (`Request.plain_greedy`: greedy and nothing else) is the
same whichever request it belongs to, so such requests joining and leaving in place of one
another change nothing (a served batch of greedy requests, whose members change every few
steps). Any other join, leave or reorder, any penalty or ban rebuilds it. A grammar mask is
per step too, but lives apart from the rest: a reused batch takes the step's mask, uploaded alone.
"""
from __future__ import annotations

import dataclasses

import torch

from ..sampling_params import SamplingParams
from ..structured.masks import GrammarMask, keep_bits, words
from .request import Request
from .sampler import (Sampler, SamplingBatch, SamplingRow, apply_grammar_mask, copy_takes_mask, count_pending,
                      make_generator)
from .upload import HostToDevice, upload_tree


class SamplingInputs:
    def __init__(self, vocab_size: int, eos_token_id: int | None, generator: torch.Generator,
                 h2d: HostToDevice):
        self.vocab_size, self.eos_token_id, self.generator, self.h2d = vocab_size, eos_token_id, generator, h2d
        self._reqs: tuple[Request, ...] = ()      # the requests of `_batch`'s rows, in order
        self._batch: SamplingBatch | None = None  # on the device; None: nothing to reuse
        self.builds = 0                           # batches built so far (how often reuse failed)
        self._keep: tuple[torch.Tensor, ...] | None = None   # a mask's `keep`: (host, device, its keep_bits)
        self._plain: SamplingBatch | None = None   # plain greedy rows, as many as seen at most (`_plain_rows`)
        self._bitmask_dev: torch.Tensor | None = None   # page-locked masks' device copy (`_device_bitmask`)
        self._rows_dev: torch.Tensor | None = None      # 0..n-1 on the device (`_device_rows`)

    def batch(self, reqs: list[Request], rows: list[int], masks=None
              ) -> tuple[SamplingBatch, torch.Tensor | None, torch.Tensor | None]:
        """(the batch on the device, `rows` on the device or None when rows == range(len(rows)),
        the (row, pending row) pairs whose pending token counts toward penalties as [P, 2] on
        the device, or None when there are none). `masks`: the rows' grammar masks being filled
        (structured/masks.PendingMask; None: no row is under a grammar), waited for once the
        batch is built (at once when the previous step's batch is reused)."""
        key = tuple([None if r.plain_greedy else r for r in reqs])   # plain greedy rows are interchangeable
        plain = rows == list(range(len(rows)))
        if masks is None and reqs and not any(key):          # every row plain greedy: any count of them
            rows_t = None if plain else self.h2d.upload([torch.tensor(rows)])[0]
            return self._plain_rows(reqs), rows_t, None
        if self._batch is not None and key == self._reqs:
            mask = None if masks is None else masks.result()     # (None: no row constrained after all)
            if mask is None:
                rows_t = None if plain else self.h2d.upload([torch.tensor(rows)])[0]
                return self._batch, rows_t, None
            grammar, rows_t = self._upload_mask(mask, None if plain else rows)
            return dataclasses.replace(self._batch, grammar=grammar), rows_t, None
        self.builds += 1
        batch = SamplingBatch.build(
            [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.generator, r.num_pending) for r in reqs],
            self.vocab_size, "cpu", self.eos_token_id, self.generator)
        if masks is not None:
            batch.grammar = masks.result()
        pending = [(j, r.pending_row) for j, r in enumerate(reqs) if r.num_pending and r.params.has_penalties]
        batch, rows_t, pending_t = upload_tree((batch, torch.tensor(rows), torch.tensor(pending).view(-1, 2)), self.h2d)
        reusable = batch.penalties is None and batch.banned is None
        kept = batch if batch.grammar is None else dataclasses.replace(batch, grammar=None)   # the mask: the step's own
        self._reqs, self._batch = (key, kept) if reusable else ((), None)
        return batch, None if plain else rows_t, pending_t if pending else None

    def _plain_rows(self, reqs: list[Request]) -> SamplingBatch:
        """The batch of len(reqs) plain greedy rows: the first rows of one built for the most
        such rows seen so far (a batch of them differs only in its [B] `is_greedy` and
        `temperature`, constant along B)."""
        n = len(reqs)
        if self._plain is None or self._plain.is_greedy.shape[0] < n:
            self.builds += 1
            rows = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.generator, r.num_pending) for r in reqs]
            self._plain = upload_tree(SamplingBatch.build(rows, self.vocab_size, "cpu", self.eos_token_id,
                                                          self.generator), self.h2d)
        full = self._plain
        if full.is_greedy.shape[0] == n:
            return full
        return dataclasses.replace(full, is_greedy=full.is_greedy[:n], temperature=full.temperature[:n])

    def _upload_mask(self, mask: GrammarMask, rows: list[int] | None) -> tuple[GrammarMask, torch.Tensor | None]:
        """The mask on the device, with `rows` (None: none to send), in one packed transfer; or,
        when its bitmask lies in page-locked memory (the grammar worker's buffer, on a GPU),
        the bitmask copied as it is into a device buffer kept between steps (no packing: the
        copy is queued before the step's sampling, which reads it, so the next step's copy
        cannot overwrite it early) and only the small rest packed. Its `keep` row, the same
        tensor from step to step, goes up once, with its bit selectors (masks.keep_bits) made
        there once."""
        direct = mask.page_locked
        packed = ([] if direct and mask.covers_all else [mask.rows]) + ([] if direct else [mask.bitmask])
        packed += [] if rows is None else [torch.tensor(rows)]
        sent = self.h2d.upload(packed) if packed else []
        n = mask.bitmask.shape[0]
        mask_rows = self._device_rows(n) if direct and mask.covers_all else sent.pop(0)
        bitmask = self._device_bitmask(mask.bitmask) if direct else sent.pop(0)
        keep = mask.keep
        if keep is not None and (self._keep is None or self._keep[0] is not keep):
            on_device = self.h2d.upload([keep])[0]
            self._keep = (keep, on_device, keep_bits(on_device, on_device.device))
        keep, bits = self._keep[1:] if keep is not None else (None, None)
        return GrammarMask(mask_rows, bitmask, mask.covers_all, keep, bits), None if rows is None else sent.pop(0)

    def _device_bitmask(self, bitmask: torch.Tensor) -> torch.Tensor:
        """bitmask [R, W] (page-locked) copied into the first R rows of the device buffer."""
        if self._bitmask_dev is None or self._bitmask_dev.shape[0] < bitmask.shape[0]:
            self._bitmask_dev = torch.empty(bitmask.shape, dtype=bitmask.dtype, device=self.h2d.device)
        out = self._bitmask_dev[:bitmask.shape[0]]
        out.copy_(bitmask, non_blocking=True)
        return out

    def _device_rows(self, n: int) -> torch.Tensor:
        """[n] long 0..n-1 on the device (a view of one kept from step to step)."""
        if self._rows_dev is None or self._rows_dev.shape[0] < n:
            self._rows_dev = torch.arange(n, device=self.h2d.device)
        return self._rows_dev[:n]

    @torch.inference_mode()
    def warmup(self, sampler: Sampler, device: torch.device | str) -> None:
        """Run the sampler's kernels once for each kind of row (greedy; seeded and unseeded
        random rows with top-k, top-p, min-p, penalties, a logit bias and logprobs) and read the
        results back, so the first request loads and runs none of them for the first time
        (docs/architecture.md, "Engine": warm-up). Draws from a generator of its own: the
        engine's shared one is left as it was."""
        kinds = [SamplingParams(temperature=0.0, logprobs=2),
                 SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                                presence_penalty=0.2, frequency_penalty=0.2, logit_bias={1: 1.0}, min_tokens=4, logprobs=2),
                 SamplingParams(temperature=1.0, top_p=0.95, seed=0)]
        rows = [SamplingRow(p, [1, 2], [3], make_generator(p.seed, device)) for p in kinds]
        shared = torch.Generator(device=device).manual_seed(0)
        for some in (rows[:1], rows):
            batch = upload_tree(SamplingBatch.build(some, self.vocab_size, "cpu", self.eos_token_id, shared), self.h2d)
            if batch.penalties is not None:
                count_pending(batch.penalties, torch.arange(len(some), device=device),
                              torch.zeros(len(some), dtype=torch.long, device=device))
            out = sampler(torch.zeros(len(some), self.vocab_size, device=device), batch)
            [t.cpu() for t in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)]
        self._warm_grammar_masks(device)

    def _warm_grammar_masks(self, device) -> None:
        """A grammar mask over every row and over some, with and without `keep`, in place and
        taken with the sampler's copy (the mask kernels' variants: ops/triton/grammar_mask.py)."""
        logits = torch.zeros(2, self.vocab_size, device=device)
        full = torch.full((2, words(self.vocab_size)), -1, dtype=torch.int32, device=device)
        for keep in (None, full[0]):
            for rows in (torch.arange(2, device=device), torch.arange(1, device=device)):
                mask = GrammarMask(rows, full[:len(rows)], len(rows) == 2, keep,
                                   keep_bits(keep, device) if keep is not None else None)
                apply_grammar_mask(logits, mask)
                if copy_takes_mask(logits, mask):
                    from ..ops.triton.grammar_mask import masked_copy
                    masked_copy(logits, mask.bitmask, mask.keep)
        logits.cpu()
