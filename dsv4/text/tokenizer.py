"""A checkpoint's tokenizer (through the `tokenizers` library) with V4's special tokens.

`Tokenizer.from_dir` reads `tokenizer.json` (and `tokenizer_config.json` when present).
Every V4 special token the vocabulary holds is made an *added special token*, so that it is
matched inside any text and always encodes to its single id. `train_test_tokenizer` builds a
small byte-level BPE carrying all V4 special tokens, for tests and demo models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Tokenizer as _HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dsv4.text.detokenizer import IncrementalDetokenizer
from dsv4.text.tokens import BOS, EOS, SPECIAL_TOKENS

__all__ = ["SPECIAL_TOKENS", "Tokenizer", "train_test_tokenizer", "build_test_tokenizer",
           "TEST_TOKENIZER_DIR"]

# Texts at least this long are encoded through `encode_batch` (see `Tokenizer.encode`).
ENCODE_BATCH_FROM = 4096

# The tokenizer shipped with the package for tests (built by `build_test_tokenizer`).
TEST_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "test_tokenizer"


class Tokenizer:
    """Text <-> ids for one checkpoint. Encoding never adds BOS implicitly."""

    def __init__(self, hf: _HfTokenizer, bos_token: str = BOS, eos_token: str = EOS):
        self._hf = hf
        _register_specials(hf, [bos_token, eos_token, *SPECIAL_TOKENS])
        self.special_ids: dict[str, int] = {
            tok: hf.token_to_id(tok) for tok in SPECIAL_TOKENS if hf.token_to_id(tok) is not None
        }
        self.bos_id = _require_id(hf, bos_token)
        self.eos_id = _require_id(hf, eos_token)
        self.bos_token, self.eos_token = bos_token, eos_token
        self._token_texts = (_TokenTexts(hf, False), _TokenTexts(hf, True))    # by skip_special_tokens

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        bos, eos = _config_bos_eos(path / "tokenizer_config.json")
        return cls(_HfTokenizer.from_file(str(file)), bos_token=bos, eos_token=eos)

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if len(text) < ENCODE_BATCH_FROM:
            return self._hf.encode(text, add_special_tokens=False).ids
        # `encode` may hold the GIL for the whole call (seconds for megabytes), stalling every
        # other thread of the process (the server's event loop); `encode_batch` releases it.
        return self._hf.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        if len(ids) < ENCODE_BATCH_FROM:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        # as `encode`: `decode` holds the GIL for the whole call, `decode_batch` releases it.
        return self._hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for in any text: the longest
        vocabulary entry (byte-level BPE spells each byte as one character)."""
        return max((len(t) for t in self._hf.get_vocab(with_added_tokens=True)), default=0)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A streaming decoder for one request. Keep special tokens (the default) when the
        text goes to `OutputParser`: it needs `</think>` and the DSML markers to split it."""
        return IncrementalDetokenizer(self.decode, prompt_ids or [], skip_special_tokens,
                                      self._token_texts[bool(skip_special_tokens)].get,
                                      concatenates=isinstance(self._hf.decoder, decoders.ByteLevel))


class _TokenTexts:
    """One id's text, memoised: at most one entry per vocabulary id (it never grows past it)."""

    def __init__(self, hf: _HfTokenizer, skip_special_tokens: bool):
        self._hf, self._skip, self._texts = hf, skip_special_tokens, {}

    def get(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._hf.decode([token_id], skip_special_tokens=self._skip)
        return text


def _register_specials(hf: _HfTokenizer, tokens: list[str]) -> None:
    """Mark every listed token that the vocabulary holds as an added special token, so the
    pre-tokenizer never splits it (a no-op for tokens already added)."""
    present = [t for t in dict.fromkeys(tokens) if hf.token_to_id(t) is not None]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in present])


def _require_id(hf: _HfTokenizer, token: str) -> int:
    tid = hf.token_to_id(token)
    if tid is None:
        raise ValueError(f"tokenizer has no id for {token!r}")
    return tid


def _config_bos_eos(config_file: Path) -> tuple[str, str]:
    """BOS and EOS strings from tokenizer_config.json, V4's defaults when absent."""
    if not config_file.is_file():
        return BOS, EOS
    config = json.loads(config_file.read_text(encoding="utf-8"))

    def token_text(key: str, default: str) -> str:
        value = config.get(key)
        if isinstance(value, dict):  # {"content": "...", ...} in older configs
            value = value.get("content")
        return value if isinstance(value, str) and value else default

    return token_text("bos_token", BOS), token_text("eos_token", EOS)


def train_test_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Tokenizer:
    """Train a byte-level BPE on `texts` whose first ids are `SPECIAL_TOKENS` in order, save
    `tokenizer.json` and `tokenizer_config.json` in `out_dir`, and load it back."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}")
    hf = _HfTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(list(texts), trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False,
              "model_max_length": 1048576, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Tokenizer.from_dir(out)


# Text the shipped test tokenizer is trained on: several scripts, code, JSON and V4 markup.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the weather in Paris today?",
    "Explain the theory of relativity in simple terms, step by step, and check the answer.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    '{"city": "Paris", "days": 3, "metric": true, "tags": ["a", "b"], "nested": {"k": null}}',
    "你好，世界！今天天气怎么样？我们来计算一下：一加一等于二。",
    "日本語のテキストと한국어 텍스트, Кириллица, Ελληνικά, العربية, emoji 🎉🚀👍🏽",
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n",
    "## Tools\n\nYou have access to a set of tools to help answer the user's question.",
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    "<tool_result>sunny, 21 degrees</tool_result>",
]


def build_test_tokenizer(out_dir: str | Path = TEST_TOKENIZER_DIR,
                         vocab_size: int = 1024) -> Tokenizer:
    """(Re)build the small tokenizer shipped in dsv4/assets/test_tokenizer."""
    return train_test_tokenizer(_CORPUS * 4, vocab_size, out_dir)
