"""A request that can never fit is refused at the edge (`dsv4 serve` as a subprocess, a random
tiny model on a KV cache of 2 history pages = 512 tokens, no --max-model-len): a 400 naming the
limit and what sets it, the server keeps serving, no page is left held. A --max-model-len the
cache cannot hold for one request stops the start-up with a message naming the flag."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for serve.server_fixtures
pytest_plugins = ["serve.server_fixtures"]

SPEC = "random:tiny::vocab_size=8192"     # the demo tokenizer's vocabulary
PAGES = 2
CACHE_TOKENS = PAGES * 256
LIMIT = f"maximum context length is {CACHE_TOKENS} tokens (set by the KV cache ({PAGES} pages of 256 tokens))"


@pytest.fixture(scope="module")
def client(demo_dir, tmp_path_factory):
    from serve.server_fixtures import ServerProcess
    args = ["--model", SPEC, "--tokenizer", demo_dir, "--port", "0", "--num-pages", str(PAGES),
            "--max-num-seqs", "2", "--max-num-batched-tokens", "256", "--log-level", "warning"]
    server = ServerProcess(args, tmp_path_factory.mktemp("limits-server") / "serve.log")
    with httpx.Client(base_url=server.base_url, timeout=120, trust_env=False) as c:
        yield c
    assert server.stop() == 0, server.log()


def complete(client, prompt: list[int], max_tokens: int) -> httpx.Response:
    return client.post("/v1/completions", json={"model": SPEC, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True})


def pages_in_use(client, metric, deadline_s: float = 30) -> float:
    """dsv4:cache_pages_used once the engine has no request (0 when nothing leaked)."""
    deadline = time.monotonic() + deadline_s
    while True:
        text = client.get("/metrics").text
        idle = metric(text, "dsv4:num_requests_running") == 0 and metric(text, "dsv4:num_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return metric(text, "dsv4:cache_pages_used")
        time.sleep(0.1)


def test_the_cache_sets_max_model_len(client, metric):
    models = client.get("/v1/models").json()["data"]
    assert [m["max_model_len"] for m in models] == [CACHE_TOKENS]
    ok = complete(client, [7] * 400, CACHE_TOKENS - 400)       # exactly the cache: served in full
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == CACHE_TOKENS - 400
    assert pages_in_use(client, metric) == 0, "a page is still held after the request ended"


@pytest.mark.parametrize("prompt_len, max_tokens, param", [
    (CACHE_TOKENS + 1, 1, "prompt"),          # the prompt alone is past the cache
    (CACHE_TOKENS, 1, "prompt"),              # no room for one generated token
    (400, CACHE_TOKENS - 400 + 1, "max_tokens"),   # prompt + max_tokens one past the cache
])
def test_request_that_can_never_fit_gets_400_naming_the_limit(client, metric, prompt_len, max_tokens, param):
    r = complete(client, [7] * prompt_len, max_tokens)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert LIMIT in err["message"] and str(prompt_len) in err["message"]
    # the server keeps serving (a request of exactly the cache: test_the_cache_sets_max_model_len)
    ok = complete(client, [7] * 400, 2)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2
    assert pages_in_use(client, metric) == 0, "a page is still held after the requests ended"


def test_max_model_len_the_cache_cannot_hold_stops_start_up(demo_dir):
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "serve", "--model", SPEC, "--tokenizer", demo_dir,
                        "--port", "0", "--num-pages", str(PAGES), "--max-model-len", "4096"],
                       capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "dsv4 serve: the engine could not start: --num-pages: " in r.stderr
    assert f"holds {CACHE_TOKENS} tokens" in r.stderr and "max_model_len 4096" in r.stderr
