"""The engine's side of structured outputs (docs/architecture.md, "Structured outputs"): the
grammars' registry made on the first constrained request, the background compiles taken
between steps (a request is scheduled once its grammar is made), the matchers advanced by each step's
tokens, the next step's masks started, the verify rows' masks, and the constrained requests
failed when the grammar worker is gone. A mixin of `LLMEngine` (engine.py), whose state it
uses: `grammars`, `config`, `cfg`, `tokenizer`, `eos_token_id`, `runner`, `requests`, `failed`,
`_compiling`, and its `abort` and `make_output`."""
from __future__ import annotations

import torch

from .inflight import StepInFlight
from .request import Request
from .scheduler import ScheduledChunk

# How long a step with nothing to schedule but compiling requests waits for a compile to finish
# before returning (so the caller takes new requests meanwhile)
COMPILE_WAIT_S = 0.01


class GrammarSteps:
    def _grammars(self):
        if self.grammars is None:
            if self.config.grammar_process:
                from ..structured.remote import WorkerGrammars
                self.grammars = WorkerGrammars(self.tokenizer, self.cfg.vocab_size, self.eos_token_id,
                                               self.config.max_num_seqs * self.config.data_parallel_size,
                                               page_lock=self.runner.h2d.on_cuda)
            else:
                from ..structured.registry import Grammars
                self.grammars = Grammars(self.tokenizer, self.cfg.vocab_size, self.eos_token_id)
        return self.grammars

    def _settle_compiles(self) -> list:
        """Take the finished background compiles: a request whose grammar is made may be
        scheduled from now on; one whose constraint was refused is aborted and recorded in
        `failed` with the GrammarError (-> its last output, finished, "abort"). Then, if the
        grammar worker is gone, fail every constrained request (those compiling too)."""
        outputs = []
        for rid, error in self.grammars.compiled():
            req = self._compiling.pop(rid, None)
            if req is None:
                continue
            if error is None:
                req.grammar_pending = False
                continue
            self.abort(rid)
            self.failed.append((rid, error))
            out = self.make_output(req, [])
            if out is not None:
                outputs.append(out)
        if self.grammars.error is not None:
            outputs += self._fail_grammar_requests()
        return outputs

    def _fail_grammar_requests(self) -> list:
        """The grammar worker is gone (`grammars.error`): abort every constrained request, each
        recorded in `failed` with the reason, before any of its tokens sampled without a mask is
        appended; -> their last outputs (finished, "abort")."""
        why = self.grammars.error
        outputs = []
        for rid in [rid for rid in self.requests if self.grammars.get(rid) is not None]:
            req = self.requests[rid]
            self.abort(rid)
            self.failed.append((rid, why))
            out = self.make_output(req, [])
            if out is not None:
                outputs.append(out)
        return outputs

    def take_failed(self) -> list[tuple[str, str]]:
        failed, self.failed = self.failed, []
        return failed

    @torch.inference_mode()
    def _start_masks(self, chunks: list[ScheduledChunk], idx: list[int]):
        """The grammar masks of sampling rows `idx` (structured/masks.PendingMask), or None."""
        if not self.grammars:
            return None
        return self.grammars.step_masks([chunks[i].request.request_id for i in idx])

    def _advance_grammars(self, step: StepInFlight, tokens: list[int], following: StepInFlight | None) -> None:
        """Advance the matchers by the step's tokens, in row order (before `_append` runs). When
        `following` samples after the masks, they take them in one xgrammar batch call (one row
        per request in a non-speculative step) and its masks start filling right after; else
        one token at a time. Rows past a request's finishing token (speculative rows) may be
        taken too: its matcher is dropped when it finishes."""
        taken, get = [], self.grammars.get
        for row, i in enumerate(step.sampled):
            req = step.chunks[i].request
            grammar = None if req.is_finished else get(req.request_id)
            if grammar is not None:         # (a RequestGrammar, or a slot in the grammar worker)
                taken.append((grammar, tokens[row]))
        if following is not None and following.sample_later is not None:
            following.masks = self.grammars.step_masks(
                [following.chunks[i].request.request_id for i in following.sampled], taken)
            return
        self.grammars.accept(taken)

    def _grammar_waits(self, chunks: list[ScheduledChunk], idx: list[int]) -> bool:
        """Whether a row to sample is under a grammar while its last token is still on the
        device: its mask needs that token, so sampling waits for the previous step's read-back
        (the forward already runs on the GPU meanwhile)."""
        return bool(self.grammars) and any(
            chunks[i].request.num_pending and self.grammars.get(chunks[i].request.request_id) is not None
            for i in idx)

    def _verify_grammar_mask(self, chunks: list[tuple[Request, list[int]]]):
        """The verify rows' masks (per chunk, its request and drafts), or None."""
        if not self.grammars:
            return None
        return self.grammars.verify_masks([(r.request_id, d) for r, d in chunks])
