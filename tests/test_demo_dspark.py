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

ACCEPTANCE_FLOOR = 1.2     # mean acceptance length at k = 3 on 3 held-out prompts: shipped 1.53, random 1.00


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


# ---- the shipped drafter: dsv4/assets/demo/dspark (docs/demo-model.md "DSpark drafter") ----------
def _heldout(n: int) -> list[str]:
    from dsv4.assets import DEMO_DIR
    with open(os.path.join(DEMO_DIR, "heldout.json"), encoding="utf-8") as f:
        return [p["prompt"] for p in json.load(f)["prompts"][:n]]


def _run(spec, prompts, max_tokens):
    from dsv4.assets import DEMO_DIR
    eng = LLMEngine(DEMO_DIR, EngineConfig(num_pages=16, max_num_seqs=len(prompts), speculative_config=spec))
    for i, text in enumerate(prompts):
        eng.add_request(str(i), eng.tokenizer.encode(text),
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    return eng, [done[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def heldout_plain():
    """3 held-out prompts and their plain greedy continuations (32 tokens)."""
    prompts = _heldout(3)
    return prompts, _run(None, prompts, 32)[1]


def test_shipped_dspark_heads_draft_like_a_trained_drafter(heldout_plain):
    """`method: dspark` on the demo loads its DSpark draft folder in place of the MTP layer; on 3
    held-out prompts greedy output equals plain decode and the mean acceptance length is well
    above 1 (the same stages untrained draft almost nothing: test below)."""
    from dsv4.assets import ASSETS, DEMO_DIR
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(ASSETS) for n in names)
    assert size < 40 * 2 ** 20
    prompts, plain = heldout_plain
    eng, drafted = _run({"method": "dspark", "num_speculative_tokens": 3}, prompts, 32)
    assert eng.model.cfg.dspark_block_size == 4 and len(eng.model.mtp) == 1
    assert eng.model.cfg.num_nextn_predict_layers == 1 and not hasattr(eng.model.mtp[0], "e_proj")
    assert drafted == plain
    stats = eng.spec.stats.summary()
    assert stats["spec_mean_acceptance_length"] > ACCEPTANCE_FLOOR, stats


def test_random_dspark_heads_stay_under_the_floor(tmp_path, heldout_plain):
    """The control of the test above: the shipped stages with every tensor redrawn at random (same
    shapes and scales), given as a draft folder (`"model": DIR`), keep greedy output and draft
    almost nothing right: their acceptance length stays under the floor the trained ones clear."""
    import shutil
    import torch
    from safetensors.torch import load_file, save_file
    from dsv4.assets import DEMO_DIR
    src = os.path.join(DEMO_DIR, "dspark")
    g = torch.Generator().manual_seed(0)
    weights = {k: (torch.randn(t.shape, generator=g) * t.float().std(correction=0) + t.float().mean()).to(t.dtype)
               for k, t in load_file(os.path.join(src, "model.safetensors")).items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    prompts, plain = heldout_plain
    eng, drafted = _run({"method": "dspark", "num_speculative_tokens": 3, "model": str(tmp_path)}, prompts, 32)
    assert drafted == plain
    assert eng.spec.stats.summary()["spec_mean_acceptance_length"] < ACCEPTANCE_FLOOR


def test_shipped_dspark_stage_reads_its_window():
    """scripts/demo/eval_dspark.py on one 256-token window of held-out code: the shipped stage's
    teacher-forced drafts are right more often with the window keys than without them (it reads
    the target's taps), and than the Markov head alone."""
    from dsv4.assets import DEMO_DIR
    from dsv4.engine.oneshot import OneSequence
    from dsv4.model.draft import load_dspark_draft
    from scripts.demo.eval_dspark import heldout_tokens, row_hits
    backend = get_backend()
    set_backend("reference")
    try:
        model = load_model(DEMO_DIR)
        load_dspark_draft(model, os.path.join(DEMO_DIR, "dspark"))
        ids = heldout_tokens(Tokenizer.from_dir(DEMO_DIR), 1)[:256]
        hits = row_hits(model, OneSequence(model, 256), ids)
    finally:
        set_backend(backend)
    assert hits["window"].sum() > 1.5 * hits["no window"].sum()
    assert hits["window"].sum() > 1.5 * hits["markov only"].sum()
