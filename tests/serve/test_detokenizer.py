import random

import pytest

from dsv4.text.detokenizer import IncrementalDetokenizer

SAMPLES = [
    "plain ascii text with spaces",
    "中文字符和标点，还有日本語のテキスト",
    "emoji 🎉🚀👍🏽 and 👨‍👩‍👧 families",
    "mixed <think>reasoning</think> and <｜DSML｜tool_calls> markup<｜end▁of▁sentence｜>",
    "Кириллица, Ελληνικά, العربية, \u0000\ufffd oddities",
]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip", [False, True])
def test_random_sequences_concatenate_to_full_decode(tok, skip):
    rng = random.Random(1234)
    vocab = tok.vocab_size
    for _ in range(300):
        # Random ids (raw byte tokens make invalid and split UTF-8), random specials, and
        # token runs of real multilingual text.
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        text_ids = tok.encode(rng.choice(SAMPLES))
        cut = rng.randrange(len(text_ids) + 1)
        ids = ids[: len(ids) // 2] + text_ids[cut:] + ids[len(ids) // 2:]
        prompt = tok.encode(rng.choice(SAMPLES))[: rng.randrange(8)]
        deltas = stream(tok.detokenizer(prompt, skip_special_tokens=skip), ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_multibyte_characters_are_never_split(tok):
    text = "🎉中文🚀é" * 5
    ids = tok.encode(text)
    assert len(ids) > len("🎉中文🚀é") * 5  # the small vocabulary splits characters into bytes
    deltas = stream(tok.detokenizer(), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # some tokens complete no character


def test_special_tokens_keep_or_skip(tok):
    ids = tok.encode("a</think>b")
    assert "".join(stream(tok.detokenizer(), ids)) == "a</think>b"
    assert "".join(stream(tok.detokenizer(skip_special_tokens=True), ids)) == "ab"


def test_decodes_a_bounded_window(tok):
    calls = []

    def decode(ids, skip_special_tokens=False):
        calls.append(len(ids))
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("the quick brown fox " * 200)
    detok = IncrementalDetokenizer(decode, tok.encode("prompt text here"), False)
    assert "".join(d for i in ids for d in [detok.push(i)]) + detok.flush() == tok.decode(ids)
    assert len(ids) > 500 and max(calls) <= 8


def test_memoised_single_ids_give_the_same_text_with_one_decode_per_token(tok):
    """The tokenizer's detokenizer reads one-id windows from its memo: same deltas as without,
    and one full decode call per pushed token."""
    calls = []

    def decode(ids, skip_special_tokens=False):
        calls.append(len(ids))
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "naïve café 中文 😀 a</think>b " * 20
    ids = tok.encode(text)
    prompt = tok.encode("prompt ü")
    for skip in (False, True):
        plain = IncrementalDetokenizer(decode, prompt, skip)
        memo = tok.detokenizer(prompt, skip_special_tokens=skip)
        expected = [plain.push(i) for i in ids] + [plain.flush()]
        assert [memo.push(i) for i in ids] + [memo.flush()] == expected
        assert "".join(expected) == tok.decode(ids, skip_special_tokens=skip)
    ascii_ids = tok.encode("the quick brown fox " * 20)
    calls.clear()
    counted = IncrementalDetokenizer(decode, prompt, False, tok.detokenizer()._decode_one)
    assert "".join(counted.push(i) for i in ascii_ids) + counted.flush() == tok.decode(ascii_ids)
    assert len(calls) == 1 + len(ascii_ids) + 1      # the prompt's context, one per token, the flush


@pytest.mark.parametrize("skip", [False, True])
def test_byte_level_fast_path_gives_the_window_deltas_without_decoding_windows(tok, skip):
    """`concatenates` (a byte-level decoder, as the tokenizer's): each push returns what the
    window decode returns, split characters and specials included, and plain text decodes no
    window at all (its one-id texts come from the memo)."""
    calls = []

    def decode(ids, skip_special_tokens=False):
        calls.append(len(ids))
        return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    one = tok.detokenizer(skip_special_tokens=skip)._decode_one
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 30))]
        ids += tok.encode(rng.choice(SAMPLES))
        prompt = tok.encode(rng.choice(SAMPLES))[: rng.randrange(8)]
        window = IncrementalDetokenizer(tok.decode, prompt, skip, one)
        fast = IncrementalDetokenizer(tok.decode, prompt, skip, one, concatenates=True)
        assert stream(fast, ids) == stream(window, ids)
    ascii_ids = tok.encode("the quick brown fox " * 20)
    fast = IncrementalDetokenizer(decode, tok.encode("prompt"), skip, one, concatenates=True)
    calls.clear()
    assert "".join(fast.push(i) for i in ascii_ids) + fast.flush() == tok.decode(ascii_ids)
    assert calls == []
