"""`--speculative-config`: the JSON vLLM users know, on EngineConfig, the CLI and
`dsv4.LLM(speculative_config=...)`; spec_slots follows num_speculative_tokens; bad values and
models that cannot draft are refused naming the field or flag; a draft checkpoint
(`dsv4 convert --extract-mtp`) gives a model without MTP its blocks."""
from __future__ import annotations

import json

import pytest

from dsv4.cli import main
from dsv4.config import ConfigError, EngineConfig, SpeculativeConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.llm import LLM
from dsv4.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_parse_forms():
    want = SpeculativeConfig("mtp", 3)
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 3}) == want
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}') == want
    assert SpeculativeConfig.parse(want) is want and SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).method == "mtp"


@pytest.mark.parametrize("value, message", [
    ("mtp", "not valid JSON"),
    ("[1]", "expected a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method: expected one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens: expected an integer in"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "2"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "draft": "x"}, r"unknown key\(s\) \['draft'\]"),
    ({"num_speculative_tokens": 2, "model": 3}, "model: expected a folder path"),
])
def test_bad_values_name_the_field(value, message):
    with pytest.raises(ConfigError, match=f"`speculative_config`: {message}"):
        EngineConfig(speculative_config=value)


def test_spec_slots_follow_the_draft_length():
    assert EngineConfig().speculative_config is None and EngineConfig().spec_slots == 0
    assert EngineConfig(speculative_config={"num_speculative_tokens": 3}).spec_slots == 3
    assert EngineConfig(speculative_config={"num_speculative_tokens": 3}, spec_slots=5).spec_slots == 5
    with pytest.raises(ConfigError, match="`spec_slots`: 2 is below num_speculative_tokens 3"):
        EngineConfig(speculative_config={"num_speculative_tokens": 3}, spec_slots=2)


def test_cli_flag_and_llm_argument(tiny, capsys):
    args = ["generate", "--model", tiny.path, "--prompt-ids", "5,6,7,8", "--max-tokens", "12", "--temperature", "0",
            "--ignore-eos", "--num-pages", "8", "--max-num-seqs", "4"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]) == 0
    assert capsys.readouterr().out == plain and "token ids:" in plain
    with pytest.raises(SystemExit, match="--speculative-config: .*not valid JSON"):
        main(args + ["--speculative-config", "mtp"])
    with pytest.raises(SystemExit, match="--spec-slots: .*below num_speculative_tokens"):
        main(args + ["--speculative-config", '{"num_speculative_tokens": 4}', "--spec-slots", "1"])
    llm = LLM(tiny.path, num_pages=8, max_num_seqs=4, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.spec is not None and llm.engine.config.spec_slots == 2
    [out] = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], use_tqdm=False,
                         sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert " ".join(map(str, out.token_ids)) in plain


def test_model_without_mtp_is_refused_and_a_draft_checkpoint_supplies_it(tiny, tmp_path, capsys):
    base, draft = str(tmp_path / "main"), str(tmp_path / "draft")
    assert main(["convert", tiny.path, base, "--drop-mtp", "--extract-mtp", draft, "--quiet"]) == 0
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    config = dict(num_pages=8, max_num_seqs=4)
    with pytest.raises(ConfigError, match="`speculative_config`: method 'mtp': the model has no MTP block"):
        LLMEngine(base, EngineConfig(speculative_config=spec, **config))
    with pytest.raises(SystemExit, match="--speculative-config: .*no MTP block"):
        main(["generate", "--model", base, "--prompt-ids", "1,2", "--num-pages", "8",
              "--speculative-config", json.dumps(spec)])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = []
    for path, s in ((tiny.path, None), (base, {**spec, "model": draft}), (tiny.path, spec)):
        eng = LLMEngine(path, EngineConfig(speculative_config=s, **config))
        eng.add_request("r", tiny.ids(30, seed=2), params)
        while eng.has_unfinished():
            done = [o for o in eng.step() if o.finished]
        outs.append(done[0].token_ids)
        if s is not None:
            assert len(eng.model.mtp) == 1 and eng.spec.stats.num_drafts > 0
    assert outs[0] == outs[1] == outs[2]


def test_mtp_blocks_with_compression_are_refused(tiny):
    from dsv4.model.weights import load_model
    model = load_model(tiny.path)
    model.cfg = model.cfg.replace(mtp_compress_ratio=4)
    with pytest.raises(ConfigError, match="compress ratio 4 are not supported"):
        LLMEngine(tiny.path, EngineConfig(num_pages=8, speculative_config={"num_speculative_tokens": 1}), model=model)
