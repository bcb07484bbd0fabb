import pytest

from dsv4.text.tokenizer import TEST_TOKENIZER_DIR, Tokenizer


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """The small BPE shipped in dsv4/assets/test_tokenizer (all V4 special tokens)."""
    return Tokenizer.from_dir(TEST_TOKENIZER_DIR)
