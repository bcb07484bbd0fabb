"""The DSpark drafter (docs/speculative.md, "DSpark"; the math in model/dspark.py).

Per request after each step (`DraftWork`, shared with the MTP drafter):
* window: the committed positions of the step get their window keys (main_x of the step's
  target-layer taps, one key per draft stage) in the stages' SWA cache layers. A verify chunk's rows past the accepted ones are not committed and
  write nothing; the block reads positions up to the anchor only.
* block: for a drafting request, the block [x_{t+1}, noise x (B - 1)] at positions t+1 .. t+B
  (t = the last accepted position, the work's anchor row) runs through the stages; its keys stay
  in the forward (nothing of the block is cached: a rejected block needs no rollback at all).
  The Markov head draws the drafts left to right; the confidence head cuts them to the leading
  ones at or above `confidence_threshold`.
After a uniform verify step of greedy requests both replay one CUDA graph (dspark_graphs.py).
"""
from __future__ import annotations

import torch

from ...cache.addressing import SeqChunk, build_step
from ...model.dspark import markov_drafts, run_block, write_window
from ...ops.paged import dense_index
from ..upload import HostToDevice, upload_tree
from .mtp import DraftWork
from .verify import sample_drafts


class DSparkProposer:
    def __init__(self, model, storage, h2d: HostToDevice, confidence_threshold: float = 0.0, graphs=None):
        """graphs (dspark_graphs.DSparkGraphs): replays the draft of uniform greedy steps."""
        self.model, self.storage, self.h2d, self.graphs = model, storage, h2d, graphs
        self.layout = storage.layout
        self.threshold = confidence_threshold

    @torch.inference_mode()
    def propose(self, works: list[DraftWork], taps: torch.Tensor,
                batch_of) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """works: the step's drafting; taps [T, n_taps * H] the step's target-layer taps
        (StepLogits.taps); batch_of(reqs) -> the SamplingBatch drafts are drawn with. Returns,
        per work with num_drafts > 0 (in order), (drafts [n <= num_drafts] long on the device,
        q [n, V] or None: see verify.sample_drafts)."""
        works = [w for w in works if w.tokens]
        if not works:
            return []
        if self.graphs is not None and self.graphs.accepts(works):
            drafts, conf = self.graphs.run(works, taps)
            drafting = [i for i, w in enumerate(works) if w.num_drafts > 0]
            if len(drafting) < len(works):
                rows = self.h2d.upload([torch.tensor(drafting)])[0]
                drafts, conf = drafts[rows], conf[rows]
            return self._select([works[i] for i in drafting], drafts, [None] * drafts.shape[1], conf)
        self._write_window(works, taps)
        drafting = [w for w in works if w.num_drafts > 0]
        return self._draft(drafting, batch_of) if drafting else []

    def _write_window(self, works: list[DraftWork], taps: torch.Tensor) -> None:
        counts = [_committed(w) for w in works]
        seqs = [SeqChunk(w.slot, w.start, [0] * n, w.page_table, w.swa_table, logits=0)
                for w, n in zip(works, counts) if n]
        rows = torch.tensor([w.hidden_row + i for w, n in zip(works, counts) for i in range(n)])
        fb, rows = upload_tree((build_step(seqs, self.layout, self.storage.ring_slots), rows), self.h2d)
        write_window(self.model, taps[rows], fb.positions, fb.swa_write, self.storage.layers)

    def _draft(self, works: list[DraftWork], batch_of) -> list[tuple]:
        seqs = [SeqChunk(w.slot, w.start + w.anchor, [0], w.page_table, w.swa_table, logits=0) for w in works]
        anchors = torch.tensor([w.tokens[w.anchor] for w in works])
        anchor_pos = torch.tensor([w.start + w.anchor + 1 for w in works])
        fb, anchors, anchor_pos = upload_tree((build_step(seqs, self.layout, self.storage.ring_slots), anchors,
                                               anchor_pos), self.h2d)
        logits, x = run_block(self.model, anchors, anchor_pos, dense_index(fb.swa), self.storage.layers)
        batch = batch_of([w.request for w in works])
        drafts, qs, conf = markov_drafts(self.model, logits, x, anchors, max(w.num_drafts for w in works),
                                         lambda lg, i: self._sample(lg, i, works, batch))
        return self._select(works, drafts, qs, conf)

    def _select(self, works: list[DraftWork], drafts: torch.Tensor, qs: list, conf: torch.Tensor) -> list[tuple]:
        """drafts [R, n], qs [q_i [R, V] or None] per draft, conf [R, n] -> per work, its leading
        drafts to verify (`_keep`) and their q (None: argmaxes)."""
        keep = self._keep(conf, [w.num_drafts for w in works])
        out = []
        for r, (w, n) in enumerate(zip(works, keep)):
            greedy = w.request.params.is_greedy or qs[0] is None or n == 0
            out.append((drafts[r, :n], None if greedy else torch.stack([q[r] for q in qs[:n]])))
        return out

    def _sample(self, logits: torch.Tensor, i: int, works: list[DraftWork], batch):
        """Draft i of every work from its Markov-corrected logits [R, V] -> (drafts [R], q or None)."""
        return sample_drafts(logits, batch)

    def _keep(self, conf: torch.Tensor, wanted: list[int]) -> list[int]:
        """How many leading drafts each request verifies: those whose confidence probability
        sigmoid(conf) is at least the threshold, at most `wanted`."""
        if self.threshold <= 0:
            return wanted
        confident = (torch.sigmoid(conf) >= self.threshold).int().cumprod(dim=1).sum(dim=1).tolist()
        return [min(n, c) for n, c in zip(wanted, confident)]


def _committed(w: DraftWork) -> int:
    """Catch-up rows of `w` at committed positions: up to the anchor in a completing chunk."""
    return w.anchor + 1 if w.anchor >= 0 else len(w.tokens)
