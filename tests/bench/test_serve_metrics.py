"""Pieces of bench serve: prompts, request bodies, one timed stream, aggregation, table."""
import asyncio

import httpx
import pytest

from dsv4.bench.serve import ServeBenchConfig
from dsv4.bench.random_prompts import COMMON_WORDS, FIRST_PLAIN_TOKEN_ID, random_token_prompts, random_word_prompts
from dsv4.bench.serve_metrics import format_table, percentile, summarize
from dsv4.bench.sse_client import RequestOutcome, request_body, stream_request


def test_random_prompts_are_reproducible_and_in_range():
    a = random_token_prompts(3, 50, vocab_size=300, seed=5)
    assert a == random_token_prompts(3, 50, vocab_size=300, seed=5) != random_token_prompts(3, 50, 300, seed=6)
    assert [len(p) for p in a] == [50, 50, 50]
    assert all(FIRST_PLAIN_TOKEN_ID <= t < 300 for p in a for t in p)
    words = random_word_prompts(2, 20, seed=1)
    assert words == random_word_prompts(2, 20, seed=1)
    assert all(len(w.split()) == 20 and set(w.split()) <= set(COMMON_WORDS) for w in words)
    with pytest.raises(ValueError, match="vocab_size"):
        random_token_prompts(1, 4, vocab_size=FIRST_PLAIN_TOKEN_ID)


def test_request_bodies_per_endpoint():
    completion = request_body("/v1/completions", "m", [101, 102], 7)
    assert completion["prompt"] == [101, 102] and "messages" not in completion
    chat = request_body("/v1/chat/completions", "m", "hello there", 7)
    assert chat["messages"] == [{"role": "user", "content": "hello there"}] and "prompt" not in chat
    for body in (completion, chat):
        assert body["max_tokens"] == 7 and body["ignore_eos"] and body["stream"]
        assert body["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="endpoint"):
        request_body("/v1/embeddings", "m", "x", 1)


def test_config_rejects_bad_values_naming_the_field():
    base = dict(base_url="http://h", model="m", input_len=1, output_len=1, num_prompts=1)
    for field, value in (("base_url", "h:80"), ("endpoint", "/v2"), ("dataset", "sharegpt"),
                         ("request_rate", 0.0), ("vocab_size", 50), ("output_len", 0),
                         ("max_concurrency", 0)):
        with pytest.raises(ValueError, match=field):
            ServeBenchConfig(**{**base, field: value})


def test_one_stream_is_timed_chunk_by_chunk(fake_server):
    server = fake_server(tokens_per_chunk=2)

    async def one():
        async with httpx.AsyncClient(trust_env=False) as client:
            body = request_body("/v1/completions", "m", [200] * 6, 5)
            return await stream_request(client, server.base_url + "/v1/completions", body, 6)

    outcome = asyncio.run(one())
    assert outcome.success and outcome.error == ""
    assert (outcome.prompt_tokens, outcome.output_tokens) == (6, 5)
    assert len(outcome.itl) == 2  # three content chunks: 2 + 2 + 1 tokens
    assert 0 < outcome.ttft <= outcome.ttft + sum(outcome.itl) <= outcome.latency
    assert outcome.tpot == pytest.approx((outcome.latency - outcome.ttft) / 4)


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) == 0.0


def test_summary_by_hand():
    outcomes = [
        RequestOutcome(True, prompt_tokens=10, output_tokens=3, ttft=0.1, latency=0.5, itl=[0.2, 0.2]),
        RequestOutcome(True, prompt_tokens=10, output_tokens=1, ttft=0.3, latency=0.3, itl=[]),
        RequestOutcome(False, latency=0.01, error="HTTP 500: boom"),
    ]
    s = summarize(outcomes, duration=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (20, 4)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.0, 2.0, 12.0)
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["mean_tpot_ms"] == pytest.approx(200)  # only the 3-token request has a TPOT
    assert s["mean_itl_ms"] == pytest.approx(200) and s["p99_e2el_ms"] == pytest.approx(498)
    assert s["first_ttft_ms"] == pytest.approx(100)                  # the first request sent
    assert summarize(outcomes[::-1], duration=2.0)["first_ttft_ms"] is None      # it failed
    table = format_table(s)
    assert "Successful requests:" in table and "P99 TPOT (ms):" in table and "HTTP 500: boom" in table
