"""Online serving benchmark against an OpenAI-compatible server (`dsv4 bench serve`).

Sends `num_prompts` streaming requests of random prompts of `input_len` tokens, each asking
for exactly `output_len` tokens, at most `max_concurrency` in flight, arriving as a Poisson
process of `request_rate` per second (all at once when the rate is infinite), and reports
what `vllm bench serve` reports (see `serve_metrics`). A failed request is counted, never
raised. The HTTP client ignores proxy environment variables: a proxy would be measured too.
`dataset="multiturn"`: `num_prompts` conversations of `num_turns` turns instead, each turn
resending the whole history (see `multiturn`); the result adds TTFT and prefix-cache hit rate
per turn.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from dsv4.bench.raw_http import RawClient
from dsv4.bench.random_prompts import (DEEPSEEK_PLAIN_VOCAB, FIRST_PLAIN_TOKEN_ID, random_token_prompts,
                                     random_word_prompts)
from dsv4.bench.multiturn import History, build_conversations, per_turn_summary, skipped_turn
from dsv4.bench.serve_metrics import summarize
from dsv4.bench.sse_client import (CHAT_COMPLETIONS, COMPLETIONS, ENDPOINTS, RequestOutcome, request_body,
                                  stream_request)

DATASETS = ("random", "multiturn")


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str
    model: str
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None = None  # None: no limit
    request_rate: float = math.inf      # requests per second; inf: all at t = 0
    endpoint: str = COMPLETIONS
    dataset: str = "random"
    seed: int = 0
    vocab_size: int = DEEPSEEK_PLAIN_VOCAB  # token ids for /v1/completions stay below it
    api_key: str | None = None
    request_timeout: float = 3600.0     # seconds without progress before a request fails
    show_progress: bool = True
    num_turns: int = 1                  # multiturn: turns per conversation
    prefix_len: int = 0                 # multiturn: words of the system prompt every conversation shares

    def __post_init__(self):
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {self.max_concurrency}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.vocab_size <= FIRST_PLAIN_TOKEN_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_PLAIN_TOKEN_ID} (lower ids are control tokens), "
                             f"got {self.vocab_size}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.num_turns < 1 or self.prefix_len < 0:
            raise ValueError(f"num_turns must be >= 1 and prefix_len >= 0, got {self.num_turns}, {self.prefix_len}")
        if self.dataset != "multiturn" and (self.num_turns != 1 or self.prefix_len):
            raise ValueError("num_turns and prefix_len are settings of the multiturn dataset")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


def build_prompts(cfg: ServeBenchConfig) -> list[str | list[int]]:
    """Token id lists for completions (exact length), word texts for chat (approximate)."""
    if cfg.endpoint == CHAT_COMPLETIONS:
        return random_word_prompts(cfg.num_prompts, cfg.input_len, cfg.seed)
    return random_token_prompts(cfg.num_prompts, cfg.input_len, cfg.vocab_size, cfg.seed)


def run_serve_benchmark(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run the benchmark to completion; the result is JSON-serialisable."""
    head = {"date": datetime.datetime.now().isoformat(timespec="seconds"), **_config_fields(cfg)}
    if cfg.dataset == "multiturn":
        conversations, duration = asyncio.run(_converse_all(cfg))
        flat = [o for conv in conversations for o in conv]
        return {**head, **summarize(flat, duration), **per_turn_summary(conversations, cfg.num_turns)}
    prompts = build_prompts(cfg)
    outcomes, duration = asyncio.run(_send_all(cfg, prompts))
    return {**head, **summarize(outcomes, duration)}


def save_result(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


async def _send_all(cfg: ServeBenchConfig, prompts: list[str | list[int]]) -> tuple[list[RequestOutcome], float]:
    """Issue every request on its arrival time; returns the outcomes in prompt order and the
    wall time from the first send to the last completion."""
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    arrivals = random.Random(cfg.seed + 1)  # independent of the prompts' stream
    progress = tqdm(total=len(prompts), desc="bench serve", unit="req", file=sys.stderr,
                    disable=not cfg.show_progress)

    async def one(client, prompt: str | list[int]) -> RequestOutcome:
        body = request_body(cfg.endpoint, cfg.model, prompt, cfg.output_len)
        prompt_len = len(prompt) if isinstance(prompt, list) else cfg.input_len
        async with limit:
            outcome = await stream_request(client, cfg.url, body, prompt_len, headers)
        progress.update(1)
        return outcome

    results, duration = await _launch(cfg, prompts, one, arrivals)
    progress.close()
    return results, duration


async def _converse_all(cfg: ServeBenchConfig) -> tuple[list[list[RequestOutcome]], float]:
    """Every conversation, turn after turn; outcomes per conversation and the wall time."""
    conversations = build_conversations(cfg.num_prompts, cfg.num_turns, cfg.input_len, cfg.prefix_len, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    arrivals = random.Random(cfg.seed + 1)
    progress = tqdm(total=cfg.num_prompts * cfg.num_turns, desc="bench serve", unit="req", file=sys.stderr,
                    disable=not cfg.show_progress)

    async def one(client, conv) -> list[RequestOutcome]:
        history, outcomes = History(cfg.endpoint, conv.system), []
        async with limit:
            for user in conv.user_turns:
                prompt = history.ask(user)
                body = request_body(cfg.endpoint, cfg.model, prompt, cfg.output_len)
                outcome = await stream_request(client, cfg.url, body, 0, headers)
                outcomes.append(outcome)
                progress.update(1)
                if not outcome.success:
                    break
                history.answer(outcome.text)
        skipped = cfg.num_turns - len(outcomes)
        progress.update(skipped)
        return outcomes + [skipped_turn() for _ in range(skipped)]

    results, duration = await _launch(cfg, conversations, one, arrivals)
    progress.close()
    return results, duration


async def _launch(cfg: ServeBenchConfig, items: list, one, arrivals: random.Random) -> tuple[list, float]:
    """Start `one(client, item)` for every item, paced by Poisson arrivals at `request_rate`
    (all at once when infinite) -> (their results in order, the wall time)."""
    async with _client(cfg) as client:
        start = time.perf_counter()
        tasks = []
        for i, item in enumerate(items):
            if i and math.isfinite(cfg.request_rate):
                await asyncio.sleep(arrivals.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(one(client, item)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _client(cfg: ServeBenchConfig) -> httpx.AsyncClient | RawClient:
    """http://: the raw client, whose CPU per streamed chunk stays well below the server's (so
    the run measures the server); https://: httpx."""
    if cfg.base_url.startswith("http://"):
        return RawClient(cfg.request_timeout)
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    timeout = httpx.Timeout(cfg.request_timeout, pool=None)  # waiting for a free connection is not a failure
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def _config_fields(cfg: ServeBenchConfig) -> dict[str, Any]:
    fields = dataclasses.asdict(cfg)
    for private in ("api_key", "show_progress"):
        fields.pop(private)
    if not math.isfinite(cfg.request_rate):
        fields["request_rate"] = "inf"  # JSON has no infinity
    return fields
