"""Drafts read from known continuations, for speculative-decoding tests on a random tiny model
(whose own MTP block almost never guesses right): accepted runs of every length happen."""
from __future__ import annotations

import torch


class ScriptedProposer:
    """Drafts the token at position p from `truth[rid][p]` (the request's whole sequence of a
    plain run), replaced by the next token id where `wrong(rid, p)` (and past the truth's end)."""

    def __init__(self, truth: dict[str, list[int]], wrong, vocab: int):
        self.truth, self.wrong, self.vocab = truth, wrong, vocab
        self.calls = 0

    def propose(self, works, hidden, batch_of):
        self.calls += 1
        out = []
        for w in works:
            if w.num_drafts == 0:
                continue
            seq, first = self.truth[w.request.request_id], w.start + w.anchor + 2
            drafts = []
            for p in range(first, first + w.num_drafts):
                t = seq[p] if p < len(seq) else 0
                drafts.append((t + 1) % self.vocab if p >= len(seq) or self.wrong(w.request.request_id, p) else t)
            out.append((torch.tensor(drafts), None))
        return out
