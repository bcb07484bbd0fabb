"""Helpers of the speculative-decoding tests.

* `sp.Req`, `sp.drive`, `sp.assert_same_outputs`: tests/engine/conftest.py's, for these tests.
* `ScriptedProposer` (tests/engine/scripted_drafts.py): replaces the MTP drafter with drafts
  read from known continuations (wrong where a rule says so).
* `CharTokenizer`: a tokenizer whose text is one letter per token, for stop strings.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from scripted_drafts import ScriptedProposer     # (tests/engine/scripted_drafts.py)


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
