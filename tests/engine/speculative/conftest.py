"""Helpers of the speculative-decoding tests.

* `sp.Req`, `sp.drive`, `sp.assert_same_outputs`: tests/engine/conftest.py's, for these tests.
* `ScriptedProposer`: replaces the MTP drafter with drafts read from known continuations
  (wrong where a rule says so), so that accepted runs of every length happen on a random tiny
  model whose own MTP block almost never guesses right.
* `CharTokenizer`: a tokenizer whose text is one letter per token, for stop strings.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
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


class CharTokenizer:
    """Token t reads as one letter (t mod 26): stop strings over token boundaries."""
    eos_id = 1

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@dataclass
class Demo:
    path: str
    model: object
    prompts: list[list[int]]    # the held-out prompts, tokenized


@pytest.fixture(scope="session")
def demo() -> Demo:
    """The bundled trained demo model (one trained MTP layer), fp32 on the CPU."""
    import json
    import os

    from dsv4.assets import DEMO_DIR
    from dsv4.model.weights import load_model
    from dsv4.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO_DIR)
    with open(os.path.join(DEMO_DIR, "heldout.json"), encoding="utf-8") as f:
        prompts = [tok.encode(p["prompt"]) for p in json.load(f)["prompts"]]
    return Demo(DEMO_DIR, load_model(DEMO_DIR), prompts)


@pytest.fixture(scope="session")
def sp(h):
    import types
    return types.SimpleNamespace(Req=h.Req, drive=h.drive, assert_same_outputs=h.assert_same_outputs,
                                 ScriptedProposer=ScriptedProposer, CharTokenizer=CharTokenizer, spec=spec)
