"""scripts/demo/train_dspark.py (docs/speculative.md "DSpark"): a short run (3 steps of 64 tokens on
two training files: smaller than --smoke, the same code) trains DSpark stages on the frozen demo model through dsv4's own DSpark forward, and writes a checkpoint that loads as a
DSpark model (released names) and serves with DSpark drafts, greedy output unchanged."""
from __future__ import annotations

import json
import math
import os

import pytest
from safetensors import safe_open

from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.weights import load_model
from dsv4.ops.backend import get_backend, set_backend
from dsv4.sampling_params import SamplingParams
from dsv4.text.tokenizer import Tokenizer


STEPS = 3


@pytest.fixture
def trained(tmp_path):
    from scripts.demo import train_dspark       # the repository root is on sys.path (python -m pytest)
    backend = get_backend()
    try:
        assert train_dspark.main(["--out", str(tmp_path), "--device", "cpu", "--steps", str(STEPS), "--seq-len", "64",
                                  "--anchors", "8", "--max-files", "2"]) == 0
    finally:
        set_backend(backend)
    return str(tmp_path)


def test_train_dspark_smoke_writes_a_servable_dspark_checkpoint(trained):
    cfg = json.load(open(os.path.join(trained, "config.json")))
    assert (cfg["dspark_block_size"], cfg["dspark_target_layer_ids"], cfg["dspark_markov_rank"]) == (4, [3, 4, 5], 64)
    assert cfg["compress_ratios"][-3:] == [0, 0, 0]
    with safe_open(os.path.join(trained, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight",
            "mtp.2.confidence_head.proj.weight"} <= keys and "mtp.0.e_proj.weight" not in keys
    curve = json.load(open(os.path.join(trained, "dspark_train.json")))["curve"]
    assert len(curve) == STEPS and all(math.isfinite(loss) for loss, _ in curve)

    model = load_model(trained)
    prompt = Tokenizer.from_dir(trained).encode("def add(a, b):\n")
    outs = []
    for spec in (None, {"method": "dspark", "num_speculative_tokens": 3}):
        eng = LLMEngine(trained, EngineConfig(num_pages=8, speculative_config=spec), model=model)
        eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        while eng.has_unfinished():
            outs += [o.token_ids for o in eng.step() if o.finished]
    assert outs[0] == outs[1] and len(outs[0]) == 16
    assert eng.spec.stats.num_draft_tokens > 0
