"""The bundled demo model (dsv4/assets/demo, docs/demo-model.md): a trained DeepSeek-V4-architecture model
that `dsv4.LLM()` serves when no model is given. Greedy completion of 20 held-out standard-
library function signatures (+ docstrings) must give syntactically valid Python for most of
them; the fraction is printed and recorded (docs/demo-model.md has the measured figure)."""
from __future__ import annotations

import ast
import json
import os

import pytest

from dsv4.assets import DEMO_DIR
from dsv4.text.tokens import BOS

MAX_TOKENS = 64
MIN_VALID_FRACTION = 0.5


def heldout_prompts() -> list[dict]:
    with open(os.path.join(DEMO_DIR, "heldout.json"), encoding="utf-8") as f:
        return json.load(f)["prompts"]


def completed_function(prompt: str, completion: str, finished: bool) -> str:
    """The prompt (signature + docstring, up to its closing quotes) + the generated rest of the
    function, trimmed where the function ends (the first non-blank line back at column 0); a
    line cut off by max_tokens is dropped."""
    first, *lines = completion.split("\n")     # `first` ends the docstring's closing line
    if not finished:
        lines = lines[:-1]
    body = []
    for line in lines:
        if line.strip() and not line[0].isspace():
            break
        body.append(line)
    return prompt.removeprefix(BOS) + first + "\n" + "\n".join(body) + "\n"


def is_valid_function(source: str) -> bool:
    """Parses, and is one function with at least one statement after its docstring."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return (len(tree.body) == 1 and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
            and len(tree.body[0].body) > 1)


def test_validity_rules():
    prompt = BOS + 'def f(x):\n    """Double."""'
    assert is_valid_function(completed_function(prompt, "\n    return 2 * x\n", True))
    assert is_valid_function(completed_function(prompt, "\n    y = x\n    return 2 * y\n\ndef g():\n", False))
    assert is_valid_function(completed_function(prompt, "\n    return x\n    if (x +", False))  # cut line dropped
    assert not is_valid_function(completed_function(prompt, "\n    if x:\n", True))
    assert not is_valid_function(completed_function(prompt, "", True))           # docstring only
    assert not is_valid_function(completed_function(prompt, "\n    return (x +\n", True))
    assert not is_valid_function(completed_function(prompt, ")\n    return x\n", True))


def test_demo_checkpoint_is_the_default_and_in_released_form():
    from dsv4.assets import demo_model_dir
    from dsv4.config import ModelConfig
    assert demo_model_dir() == DEMO_DIR
    with open(os.path.join(DEMO_DIR, "config.json")) as f:
        raw = json.load(f)
    assert "compress_ratios" in raw and "num_hash_layers" in raw and raw["torch_dtype"] == "bfloat16"
    cfg = ModelConfig.from_dir(DEMO_DIR)
    assert set(cfg.compress_ratios) == {0, 4, 128} and cfg.num_hash_layers >= 1
    assert cfg.num_nextn_predict_layers == 1 and cfg.hc_mult == 4
    size = sum(os.path.getsize(os.path.join(DEMO_DIR, n)) for n in os.listdir(DEMO_DIR))
    assert size < 40 * 2 ** 20


def test_demo_completes_heldout_functions(record_property):
    from dsv4 import LLM
    from dsv4.sampling_params import SamplingParams

    prompts = heldout_prompts()
    assert len(prompts) == 20
    llm = LLM()                       # no model: the bundled demo
    assert os.path.samefile(llm.model_dir, DEMO_DIR)
    outs = llm.generate([p["prompt"] for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    valid = []
    for p, out in zip(prompts, outs):
        source = completed_function(p["prompt"], out.text, out.finish_reason == "stop")
        valid.append(is_valid_function(source))
    fraction = sum(valid) / len(valid)
    record_property("valid_python_fraction", fraction)
    print(f"\ndemo model: {sum(valid)}/{len(valid)} held-out completions are valid Python ({fraction:.0%})")
    assert fraction >= MIN_VALID_FRACTION


def test_demo_mtp_matches_its_training_definition():
    """dsv4's MTP head (and main model) on the shipped checkpoint reproduce the model the
    training script defines (transformers' DeepseekV4ForCausalLM + an MTP layer of its pieces)."""
    pytest.importorskip("transformers")
    from scripts.demo import verify as demo_verify     # the repository root is on sys.path (python -m pytest)
    result = demo_verify.compare(demo_verify.load_training_model(DEMO_DIR), DEMO_DIR,
                                 demo_verify.heldout_ids(DEMO_DIR, 96))
    for name, r in result.items():
        assert r["max_abs_diff"] <= 1e-4 * r["ref_scale"], (name, r)
