import json

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import Regex, models, pre_tokenizers

from dsv4.text.tokenizer import (SPECIAL_TOKENS, TEST_TOKENIZER_DIR, Tokenizer,
                                  train_test_tokenizer)
from dsv4.text.tokens import ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER


def test_special_tokens_fixed_order():
    assert SPECIAL_TOKENS[:8] == [BOS, EOS, USER, ASSISTANT, "<｜latest_reminder｜>",
                                  THINK_START, THINK_END, DSML]
    assert SPECIAL_TOKENS[8:] == ["<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>",
                                  "<｜title｜>", "<｜read_url｜>"]


def test_shipped_tokenizer_ids(tok):
    assert tok.bos_id == 0 and tok.eos_id == 1
    assert tok.special_ids == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert tok.vocab_size > len(SPECIAL_TOKENS) + 256
    size = sum(p.stat().st_size for p in TEST_TOKENIZER_DIR.iterdir())
    assert size < 2 * 1024 * 1024


def test_special_tokens_inside_text_are_single_ids(tok):
    text = f"x{BOS}a{USER}你好{ASSISTANT}{THINK_START}r{THINK_END}<{DSML}tool_calls>{EOS}"
    ids = tok.encode(text)
    for token in (BOS, USER, ASSISTANT, THINK_START, THINK_END, DSML, EOS):
        assert ids.count(tok.special_ids[token]) == 1
    assert tok.decode(ids) == text


def test_no_implicit_bos_and_skip_special(tok):
    ids = tok.encode("hello")
    assert ids and ids[0] != tok.bos_id
    ids = tok.encode(f"{BOS}hi{EOS}")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_exact_round_trip_of_arbitrary_text(tok):
    text = "  leading spaces\n\ttabs, émojis 🎉🚀, 中文, \u0000 nul and \ufffd replacement  "
    assert tok.decode(tok.encode(text)) == text


def test_long_id_lists_decode_as_one_call_does(tok):
    """From ENCODE_BATCH_FROM ids `decode` takes the batch call (it releases the GIL): same text."""
    from dsv4.text.tokenizer import ENCODE_BATCH_FROM
    ids = tok.encode("ß 中文 🎉 x" * 2000) + [tok.special_ids[THINK_END], 7]
    assert len(ids) >= ENCODE_BATCH_FROM
    for skip in (False, True):
        assert tok.decode(ids, skip) == tok._hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(iter(ids)) == tok._hf.decode(ids, skip_special_tokens=False)


def test_from_dir_requires_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_train_test_tokenizer(tmp_path):
    tok = train_test_tokenizer(["some text to learn from", "更多的文字"] * 3, 300, tmp_path)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["bos_token"] == BOS and config["eos_token"] == EOS
    assert Tokenizer.from_dir(tmp_path).decode(tok.encode("learn 文字")) == "learn 文字"
    with pytest.raises(ValueError, match="vocab_size"):
        train_test_tokenizer(["x"], 100, tmp_path)


def _word_level_checkpoint(path, config: dict | None):
    """A tokenizer whose vocabulary holds V4 tokens as plain entries (not added tokens)."""
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, THINK_START: 3, "a": 4, "b": 5, "<": 6, ">": 7, "think": 8}
    hf = HfTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def test_vocab_tokens_become_added_specials_and_config_names_bos(tmp_path):
    _word_level_checkpoint(tmp_path, {"bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.special_ids == {THINK_START: 3}
    assert tok.encode(f"a{THINK_START}b") == [4, 3, 5]


def test_missing_bos_is_an_error(tmp_path):
    _word_level_checkpoint(tmp_path, None)  # V4 default names, absent from this vocabulary
    with pytest.raises(ValueError, match="begin"):
        Tokenizer.from_dir(tmp_path)
