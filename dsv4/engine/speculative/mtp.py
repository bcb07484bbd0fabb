"""The MTP drafter (docs/architecture.md, "Speculative decoding").

The MTP block at position t reads the target's final residual streams h_t and the token
x_{t+1} and predicts x_{t+2} (model/mtp.py). Its sliding-window keys live in cache layer
`num_hidden_layers + j` (CacheLayout.with_mtp), in the request's SWA pages, addressed by
position like every other layer's, so a rejected draft's keys are simply overwritten later
(invariant 1).

After each step, per request (`DraftWork`):
* catch-up: the block runs over the step's positions [start, end) that the window of a later
  draft can reach, fed the tokens that follow them (the sampled ones past the known tokens).
  In a verify chunk every row runs: rows past the accepted ones write keys at positions that
  the chain or the next step overwrites before any query reads them.
* chain: from the catch-up row of the last accepted position ("anchor", whose output
  predicts the first draft), each draft is fed back with the block's own output streams as h,
  one position further: k drafts cost one catch-up and k - 1 one-token steps.
With several MTP blocks (later releases), chain step j runs block j mod L; the catch-up runs
block 0 only, so the blocks past the first see only the positions they drafted at.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.addressing import SeqChunk, build_swa_step
from ..upload import HostToDevice, upload_tree
from .verify import sample_drafts


@dataclass
class DraftWork:
    """One request's drafting after a step. Catch-up positions [start, start + len(tokens)), fed
    tokens[i] = x_{start + i + 1}, whose target streams are rows hidden_row + i of the step's
    hidden; `num_drafts` drafts chained from catch-up row `anchor`."""
    request: object
    slot: int
    page_table: list[int]
    swa_table: list[int]
    start: int
    tokens: list[int]
    hidden_row: int
    anchor: int = -1
    num_drafts: int = 0


class MTPProposer:
    def __init__(self, model, storage, h2d: HostToDevice, graphs=None):
        """graphs (draft_graphs.DraftGraphs): replays the draft of uniform greedy steps."""
        self.model, self.storage, self.h2d, self.graphs = model, storage, h2d, graphs
        self.layout = storage.layout
        self.blocks = list(model.mtp)

    @torch.inference_mode()
    def propose(self, works: list[DraftWork], hidden: torch.Tensor,
                batch_of) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """works: the step's drafting; hidden [T, N, H] the step's target streams; batch_of(reqs)
        -> the SamplingBatch drafts of those requests are drawn with. Returns, per work with
        num_drafts > 0 (in order), (drafts [num_drafts] long on the device, q [num_drafts, V] or
        None: see verify.sample_drafts)."""
        works = [w for w in works if w.tokens]
        if not works:
            return []
        if self.graphs is not None and self.graphs.accepts(works):
            return self.graphs.run(works, hidden)
        streams = self._catch_up(works, hidden)
        drafting = [i for i, w in enumerate(works) if w.num_drafts > 0]
        if not drafting:
            return []
        offsets = _offsets([len(w.tokens) for w in works])
        h = streams[[offsets[i] + works[i].anchor for i in drafting]]
        return self._chain([works[i] for i in drafting], h, batch_of)

    def _chain(self, works: list[DraftWork], h: torch.Tensor, batch_of) -> list[tuple]:
        """h [R, N, H]: the block's streams at each anchor -> per work (drafts [n], q [n, V] or
        None); draft j comes from step j - 1's streams, one position further, fed draft j - 1."""
        tokens: list[list[torch.Tensor]] = [[] for _ in works]
        probs: list[list[torch.Tensor]] = [[] for _ in works]
        live, prev = list(range(len(works))), None
        for j in range(max(w.num_drafts for w in works)):
            block = self.blocks[j % len(self.blocks)]
            if j > 0:
                keep = [n for n, i in enumerate(live) if works[i].num_drafts > j]
                live, h, prev = [live[n] for n in keep], h[keep], prev[keep]
                h = self._chain_step(block, [works[i] for i in live], j, prev, h)
            reqs = [works[i].request for i in live]
            if all(r.params.is_greedy for r in reqs):      # argmaxes: no sampling batch to build
                prev, q = block.logits(self.model, h).argmax(dim=-1), None
            else:
                prev, q = sample_drafts(block.logits(self.model, h), batch_of(reqs))
            for n, i in enumerate(live):
                tokens[i].append(prev[n])
                if not works[i].request.params.is_greedy:      # (then q is not None)
                    probs[i].append(q[n])
        return [(torch.stack(t), torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _catch_up(self, works: list[DraftWork], hidden: torch.Tensor) -> torch.Tensor:
        """Block 0 over every work's catch-up positions -> its output streams [T', N, H]."""
        seqs = [SeqChunk(w.slot, w.start, w.tokens, w.page_table, w.swa_table, logits=0) for w in works]
        rows = torch.tensor([w.hidden_row + i for w in works for i in range(len(w.tokens))])
        fb, rows = upload_tree((build_swa_step(seqs, self.layout), rows), self.h2d)
        return self.blocks[0].draft(self.model, hidden[rows], fb, self.storage.layers)

    def _chain_step(self, block, works: list[DraftWork], j: int, tokens: torch.Tensor,
                    h: torch.Tensor) -> torch.Tensor:
        """One token per work at position start + anchor + j, fed the previous draft (on the
        device) and the block's previous output streams h [R, N, H] -> new streams [R, N, H]."""
        seqs = [SeqChunk(w.slot, w.start + w.anchor + j, [0], w.page_table, w.swa_table, logits=0) for w in works]
        fb = upload_tree(build_swa_step(seqs, self.layout), self.h2d)
        fb.token_ids.copy_(tokens)
        return block.draft(self.model, h, fb, self.storage.layers)


def _offsets(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out
