"""Random prompts of a given length for serving benchmarks, reproducible from a seed.

Without the server's tokenizer we cannot make a *text* of exactly I tokens, so:
  * /v1/completions gets token id lists (the OpenAI API accepts `prompt: [int, ...]`),
    ids drawn uniformly from [FIRST_PLAIN_TOKEN_ID, vocab_size): exactly I tokens;
  * /v1/chat/completions gets I words from a list of common English words, each a single
    token in typical BPE vocabularies: about I tokens (the chat template adds a few).
"""
from __future__ import annotations

import random

# Ids below this are left out: vocabularies put BOS/EOS/pad and other control tokens there.
FIRST_PLAIN_TOKEN_ID = 100
# DeepSeek's BPE vocabulary ends here; the added special tokens (chat markers, DSML, ...) follow.
DEEPSEEK_PLAIN_VOCAB = 128000

COMMON_WORDS = (
    "the of and to in is was for on that with as by at from his her it an be are were "
    "this which or have had not but all they one their been has its more will would who "
    "new after other first also when time two into about there can only some than over "
    "such most made years many then them these world may city state where year between "
    "during under later both while part known people three through being well since used "
    "out up high before each could large family life long number team school around work "
    "water house music early own same place great small found area name game history "
    "against best last left back four along public south north east west still second "
    "group local power play light river point order line company field children member "
    "system country government black white open story road song day"
).split()


def random_token_prompts(num_prompts: int, input_len: int, vocab_size: int = DEEPSEEK_PLAIN_VOCAB,
                         seed: int = 0) -> list[list[int]]:
    """`num_prompts` lists of exactly `input_len` token ids in [FIRST_PLAIN_TOKEN_ID, vocab_size)."""
    if vocab_size <= FIRST_PLAIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {FIRST_PLAIN_TOKEN_ID} (ids below it are control "
                         f"tokens), got {vocab_size}")
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(input_len)]
            for _ in range(num_prompts)]


def random_word_prompts(num_prompts: int, input_len: int, seed: int = 0) -> list[str]:
    """`num_prompts` texts of `input_len` words, each word about one token."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(COMMON_WORDS, k=input_len)) for _ in range(num_prompts)]
