"""Teacher-forced top-1 of the demo's DSpark drafter per block row on held-out code
(docs/demo-model.md "DSpark drafter"): every anchor t of a few 512-token windows of the held-out
files, row i's Markov-corrected argmax (fed the true previous token, as in training) against
x_{t+2+i} — with the window, with no window keys (-1 rows), and the Markov head alone. Rows
that stay level across i mean the stage has not learned what tells the next token from later
ones; a gap between "window" and "no window" is what the stage reads from the target's taps.

    python -m scripts.demo.eval_dspark [--draft DIR] [--windows 4]
"""
from __future__ import annotations

import argparse
import os

import torch

from dsv4.engine.oneshot import OneSequence
from dsv4.model.dspark import run_block, stages, write_window
from dsv4.model.kv import LayerKV
from dsv4.ops.backend import set_backend

MODES = ("window", "no window", "markov only")


def heldout_tokens(tokenizer, max_files: int) -> torch.Tensor:
    from scripts.demo import corpus
    return torch.tensor(corpus.code_token_stream(tokenizer, held_out=True, max_files=max_files), dtype=torch.long)


@torch.no_grad()
def row_hits(model, one: OneSequence, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One window ids [P] -> {mode: right drafts per row [B]} over every anchor t < P - B - 1."""
    cfg, P = model.cfg, ids.shape[0]
    W, B = cfg.sliding_window, cfg.dspark_block_size
    taps = []
    model(one.batch(ids.tolist()), one.storage.layers, taps=taps)
    kv = [LayerKV(swa=torch.zeros(P, cfg.head_dim)) for _ in range(cfg.num_hidden_layers + len(model.mtp))]
    positions = torch.arange(P)
    write_window(model, torch.cat(taps, -1), positions, positions, kv)
    t = torch.arange(P - B - 1)                                     # the last committed position
    window = t[:, None] - W + 1 + torch.arange(W)
    window = torch.where(window >= 0, window, -1)
    out = {}
    for mode in MODES:
        logits, _ = run_block(model, ids[t + 1], t + 1, window if mode == "window" else torch.full_like(window, -1), kv)
        hits = torch.zeros(B)
        for i in range(B):
            bias, _ = stages(model)[-1].markov_head(ids[t + 1 + i])
            row = bias if mode == "markov only" else logits[:, i] + bias
            hits[i] = (row.argmax(-1) == ids[t + 2 + i]).sum()
        out[mode] = hits
    return out


def main(argv=None) -> int:
    from dsv4.assets import DEMO_DIR
    from dsv4.engine.speculative import DSPARK_DRAFT_DIR
    from dsv4.model.draft import load_dspark_draft
    from dsv4.model.weights import load_model
    from dsv4.text.tokenizer import Tokenizer
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=os.path.join(DEMO_DIR, DSPARK_DRAFT_DIR), help="a DSpark draft folder")
    p.add_argument("--windows", type=int, default=4, help="512-token windows of held-out code")
    args = p.parse_args(argv)
    set_backend("reference")
    model = load_model(DEMO_DIR)
    load_dspark_draft(model, args.draft)
    stream = heldout_tokens(Tokenizer.from_dir(DEMO_DIR), 6)
    P = 512
    one = OneSequence(model, P)
    totals, anchors = {m: 0.0 for m in MODES}, 0
    for s in range(0, min(stream.numel() - P, args.windows * P), P):
        hits = row_hits(model, one, stream[s:s + P])
        totals = {m: totals[m] + hits[m] for m in MODES}
        anchors += P - model.cfg.dspark_block_size - 1
    for m in MODES:
        print(f"{m:<12} top-1 per row {[round(v, 3) for v in (totals[m] / anchors).tolist()]} ({anchors} anchors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
