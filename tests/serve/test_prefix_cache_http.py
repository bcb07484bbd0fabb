"""The prefix cache over HTTP (`dsv4 serve` as a subprocess, a random tiny model given as a
`random:` spec with the demo tokenizer): a resent chat reports
`usage.prompt_tokens_details.cached_tokens` >= (prompt_tokens // 256 - 1) * 256, a second turn
reuses the first, the `dsv4:prefix_cache_*` metrics count it, and `POST /reset_prefix_cache`
forgets it."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for serve.server_fixtures
pytest_plugins = ["serve.server_fixtures"]

SPEC = "random:tiny::vocab_size=8192"     # the demo tokenizer's vocabulary


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    from serve.server_fixtures import ServerProcess
    args = ["--model", SPEC, "--tokenizer", demo_dir, "--port", "0", "--num-pages", "48",
            "--max-model-len", "4096", "--log-level", "warning"]
    proc = ServerProcess(args, tmp_path_factory.mktemp("prefix-server") / "serve.log")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=120, trust_env=False) as c:
        yield c


def words(n: int, seed: int) -> str:
    from dsv4.bench.random_prompts import random_word_prompts
    return random_word_prompts(1, n, seed)[0]


def chat(client, messages: list[dict], max_tokens: int = 8) -> dict:
    r = client.post("/v1/chat/completions", json={"model": SPEC, "messages": messages, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_resend_hits_then_reset_forgets(client, metric):
    messages = [{"role": "user", "content": words(900, seed=1)}]
    first, second = chat(client, messages), chat(client, messages)
    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 768, "the prompt spans fewer than four pages"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (prompt // 256 - 1) * 256 and cached % 256 == 0 and cached < prompt
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    text = client.get("/metrics").text
    assert metric(text, "dsv4:prefix_cache_queries_total") >= 2 * prompt
    assert metric(text, "dsv4:prefix_cache_hits_total") >= cached
    assert metric(text, "dsv4:prefix_cache_pages") >= cached // 256

    assert client.post("/reset_prefix_cache").status_code == 200
    third = chat(client, messages)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the reset did not forget the prefix"
    assert third["choices"][0]["message"] == first["choices"][0]["message"]


def test_second_turn_reuses_the_first(client):
    messages = [{"role": "user", "content": words(600, seed=2)}]
    one = chat(client, messages, max_tokens=40)
    messages += [one["choices"][0]["message"], {"role": "user", "content": words(300, seed=3)}]
    two = chat(client, messages)
    assert two["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"] + 300
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= one["usage"]["prompt_tokens"] // 256 * 256


def test_streamed_usage_and_completions_report_cached_tokens(client):
    from dsv4.text.tokenizer import Tokenizer
    from dsv4.assets import demo_model_dir
    ids = Tokenizer.from_dir(demo_model_dir()).encode(words(700, seed=4))
    body = {"model": SPEC, "prompt": [ids, ids[:600]], "max_tokens": 4, "temperature": 0, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    import json
    usage = json.loads(chunks[-1][len("data: "):])["usage"]
    assert usage["prompt_tokens"] == len(ids) + 600
    # each prompt counted once: its forks (n = 2) and the shorter prompt resume from the first's pages
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 256 + 256
