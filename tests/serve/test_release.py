import json

import pytest

from dsv4.serve.chat_format.release import REASONING_EFFORTS, RELEASES, detect_release, effort_prefix, normalize_effort

# Module-level names of the two reference encoders, as the checkpoints ship them in
# encoding/encoding_dsv4.py (only these assignments matter to the detection).
PREVIEW_ENCODER = 'REASONING_EFFORT_MAX = (\n    "Reasoning Effort: Absolute maximum ..."\n)\n'
R0731_ENCODER = ('from typing import Dict\n'
                 'REASONING_EFFORT_PROMPTS: Dict[str, str] = {"low": "", "high": "h", "max": "m"}\n'
                 'DEFAULT_REASONING_EFFORT = "low"\n')


def checkpoint(tmp_path, name, encoder=None, config=None):
    path = tmp_path / name
    path.mkdir()
    if encoder is not None:
        (path / "encoding").mkdir()
        (path / "encoding" / "encoding_dsv4.py").write_text(encoder, encoding="utf-8")
    if config is not None:
        (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def test_release_from_the_shipped_encoder(tmp_path):
    assert detect_release(checkpoint(tmp_path, "a", PREVIEW_ENCODER)) == "preview"
    # The encoder outranks the folder name.
    assert detect_release(checkpoint(tmp_path, "DeepSeek-V4-Flash-0731", PREVIEW_ENCODER)) == "preview"
    assert detect_release(checkpoint(tmp_path, "b", R0731_ENCODER)) == "0731"


def test_release_from_config_and_name(tmp_path):
    assert detect_release(checkpoint(tmp_path, "c", config={"dspark_block_size": 5})) == "0731"
    assert detect_release(checkpoint(tmp_path, "DeepSeek-V4-Pro-0813")) == "0731"
    assert detect_release(checkpoint(tmp_path, "DeepSeek-V4-Flash", config={"vocab_size": 129280})) == "preview"
    assert detect_release(checkpoint(tmp_path, "d", "this is not python (", {"broken": True})) == "preview"


def test_accepted_efforts():
    assert RELEASES == ("preview", "0731")
    assert REASONING_EFFORTS == {"preview": (None, "high", "max"), "0731": (None, "low", "high", "max")}


@pytest.mark.parametrize("release,effort", [("preview", "low"), ("preview", "medium"),
                                            ("0731", "medium"), ("0731", "xhigh")])
def test_unknown_effort_is_rejected(release, effort):
    with pytest.raises(ValueError, match="reasoning_effort"):
        effort_prefix(release, effort, thinking=True)


def test_unknown_release_is_rejected():
    with pytest.raises(ValueError, match="release"):
        effort_prefix("v5", None, thinking=True)


def test_prefixes_only_in_thinking_mode():
    assert effort_prefix("0731", "max", thinking=False) == ""
    assert effort_prefix("0731", "max", thinking=True).startswith("Reasoning Effort: Beyond maximum")
    assert effort_prefix("0731", "high", thinking=True) == effort_prefix("preview", "max", thinking=True)


# 0731 rows: vLLM tests/tokenizers_/test_deepseek_v4.py::
# test_deepseek_v4_maps_compatible_thinking_reasoning_effort_values (every row, "unexpected"
# included). Preview rows: the mapping of vLLM's preview-era vllm/tokenizers/deepseek_v4.py
# ("max"/"xhigh" -> max, "none" -> no thinking, anything else -> high).
# None keeps the release default (DeepSeek's reference); vLLM sends "high" instead.
@pytest.mark.parametrize("release,given,want", [
    ("0731", "none", (None, False)), ("0731", "minimal", ("low", True)), ("0731", "low", ("low", True)),
    ("0731", "medium", ("low", True)), ("0731", "high", ("high", True)), ("0731", "xhigh", ("high", True)),
    ("0731", "max", ("max", True)), ("0731", "unexpected", ("high", True)), ("0731", None, (None, True)),
    ("preview", "none", (None, False)), ("preview", "max", ("max", True)), ("preview", "xhigh", ("max", True)),
    ("preview", "high", ("high", True)), ("preview", "low", ("high", True)), ("preview", "medium", ("high", True)),
    ("preview", "unexpected", ("high", True)), ("preview", None, (None, True)),
])
def test_requested_efforts_map_to_the_release(release, given, want):
    assert normalize_effort(release, given) == want
    effort, _ = want
    effort_prefix(release, effort, thinking=True)  # every mapped value is one the release accepts
