"""Multi-turn chats for `dsv4 bench serve --dataset multiturn`: what prefix caching is for.

`num_prompts` conversations of `num_turns` turns. Every conversation opens with a system
prompt of `prefix_len` words shared by all of them (none when 0); each turn adds a user
message of `input_len` random words and resends the whole history (the previous turns' user
messages and the server's answers, as text), asking for `output_len` tokens. A conversation's
turns run one after another; conversations run side by side (at most `max_concurrency`,
started as a Poisson process of `request_rate`). On /v1/completions the history is one text.
A turn that fails ends its conversation: the turns left are counted as failed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from dsv4.bench.random_prompts import random_word_prompts
from dsv4.bench.sse_client import CHAT_COMPLETIONS, RequestOutcome


@dataclass(frozen=True)
class Conversation:
    system: str              # shared by every conversation ("" for none)
    user_turns: list[str]


def build_conversations(num: int, turns: int, turn_words: int, prefix_words: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    system = random_word_prompts(1, prefix_words, seed=seed + 1)[0] if prefix_words else ""
    return [Conversation(system, random_word_prompts(turns, turn_words, seed=rng.randrange(2**31)))
            for _ in range(num)]


class History:
    """The prompt of the next turn: a message list (chat) or one text (completions)."""

    def __init__(self, endpoint: str, system: str):
        self.chat = endpoint == CHAT_COMPLETIONS
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.text = system

    def ask(self, user: str) -> list[dict[str, str]] | str:
        if self.chat:
            self.messages.append({"role": "user", "content": user})
            return list(self.messages)
        self.text = f"{self.text}\n\n{user}\n\n" if self.text else f"{user}\n\n"
        return self.text

    def answer(self, text: str) -> None:
        if self.chat:
            self.messages.append({"role": "assistant", "content": text})
        else:
            self.text += text


def skipped_turn() -> RequestOutcome:
    return RequestOutcome(success=False, error="an earlier turn of the conversation failed")


def per_turn_summary(outcomes: Sequence[Sequence[RequestOutcome]], turns: int) -> dict[str, Any]:
    """Mean TTFT (ms) and prefix-cache hit rate of each turn across conversations."""
    ttft, hit_rate = [], []
    for k in range(turns):
        done = [conv[k] for conv in outcomes if k < len(conv) and conv[k].success]
        ttft.append(1000 * sum(o.ttft for o in done) / len(done) if done else 0.0)
        prompt = sum(o.prompt_tokens for o in done)
        hit_rate.append(sum(o.cached_tokens for o in done) / prompt if prompt else 0.0)
    return {"num_turns": turns, "mean_ttft_ms_by_turn": ttft, "prefix_cache_hit_rate_by_turn": hit_rate}
