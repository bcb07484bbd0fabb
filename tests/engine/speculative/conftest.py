"""Helpers of the speculative-decoding tests (issue 17).

* `drive`: runs an engine over requests that arrive at given steps (optionally aborting one),
  checking the cache accounting after every step; returns the finished outputs.
* `ScriptedProposer`: replaces the MTP drafter with drafts read from known continuations
  (wrong where a rule says so), so that accepted runs of every length happen on a random tiny
  model whose own MTP block almost never guesses right.
* `CharTokenizer`: a tokenizer whose text is one letter per token, for stop strings.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsv4.sampling_params import SamplingParams

MAX_STEPS = 3000


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0


def drive(engine, reqs: list[Req], h=None, abort_at: tuple[str, int] | None = None, on_step=None) -> dict:
    """Add each request at step `arrival`; abort request abort_at[0] before step abort_at[1]."""
    done, step = {}, 0
    last = max(r.arrival for r in reqs)
    while step < MAX_STEPS:
        for r in reqs:
            if r.arrival == step:
                engine.add_request(r.rid, list(r.prompt), r.params)
        if abort_at is not None and step == abort_at[1]:
            engine.abort(abort_at[0])
        if step > last and not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if h is not None:
            h.assert_cache_accounting(engine)
        if on_step is not None:
            on_step(engine, step)
        step += 1
    raise AssertionError("engine still busy")


def assert_same_outputs(a: dict, b: dict, rids=None) -> None:
    """Same tokens, finish and stop reasons, text, and logprobs (to fp32 rounding of different batches)."""
    if rids is None:
        assert sorted(a) == sorted(b)
        rids = sorted(a)
    for rid in rids:
        x, y = a[rid], b[rid]
        assert x.token_ids == y.token_ids, (rid, x.token_ids, y.token_ids)
        assert (x.finish_reason, x.stop_reason, x.text) == (y.finish_reason, y.stop_reason, y.text), rid
        assert (x.logprobs is None) == (y.logprobs is None), rid
        for dx, dy in zip(x.logprobs or [], y.logprobs or []):
            assert dx.keys() == dy.keys() and all(abs(dx[t] - dy[t]) < 1e-4 for t in dx), rid


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
def sp():
    import types
    return types.SimpleNamespace(Req=Req, drive=drive, assert_same_outputs=assert_same_outputs,
                                 ScriptedProposer=ScriptedProposer, CharTokenizer=CharTokenizer, spec=spec)
