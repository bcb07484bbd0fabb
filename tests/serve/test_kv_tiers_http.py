"""The host and disk tiers over HTTP (`dsv4 serve --host-cache-gb --disk-cache-dir` as a
subprocess, a random tiny model): after `POST /reset_prefix_cache` empties the GPU prefix cache
a resent chat is restored from the host tier, and after a restart of the server from disk;
`usage.prompt_tokens_details.cached_tokens` counts those tokens, the answers are the cold one's,
and `dsv4:prefix_cache_tier_hits_total{tier}` and the tier byte counters count them."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/, for serve.server_fixtures
pytest_plugins = ["serve.server_fixtures"]

SPEC = "random:tiny::vocab_size=8192"     # the demo tokenizer's vocabulary


def start(demo_dir, folder: Path, log: Path):
    from serve.server_fixtures import ServerProcess
    args = ["--model", SPEC, "--tokenizer", demo_dir, "--port", "0", "--num-pages", "48", "--max-model-len", "4096",
            "--log-level", "warning", "--host-cache-gb", "0.05", "--disk-cache-dir", str(folder),
            "--disk-cache-gb", "1"]
    return ServerProcess(args, log)


def chat(base_url: str, messages: list[dict]) -> tuple[dict, str]:
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as c:
        r = c.post("/v1/chat/completions", json={"model": SPEC, "messages": messages, "max_tokens": 8,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json(), c.get("/metrics").text


def reset(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=60, trust_env=False) as c:
        assert c.post("/reset_prefix_cache").status_code == 200


def test_host_then_disk_after_restart(demo_dir, tmp_path, metric):
    from dsv4.bench.random_prompts import random_word_prompts
    messages = [{"role": "user", "content": random_word_prompts(1, 900, 5)[0]}]
    folder = tmp_path / "kv"
    server = start(demo_dir, folder, tmp_path / "one.log")
    try:
        first, _ = chat(server.base_url, messages)
        reset(server.base_url)
        second, text = chat(server.base_url, messages)
    finally:
        assert server.stop() == 0, server.log()
    prompt, cached = first["usage"]["prompt_tokens"], second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt > 768 and cached >= (prompt // 256 - 1) * 256 and cached % 256 == 0
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    assert metric(text, "dsv4:prefix_cache_tier_hits_total", tier="host") == cached
    assert metric(text, "dsv4:kv_tier_bytes_total", direction="gpu_to_host") > 0
    assert metric(text, "dsv4:kv_tier_bytes_total", direction="host_to_gpu") > 0
    assert list(folder.glob("*.kv")), "nothing was written to disk"

    server = start(demo_dir, folder, tmp_path / "two.log")
    try:
        third, text = chat(server.base_url, messages)
    finally:
        assert server.stop() == 0, server.log()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert third["choices"][0]["message"] == first["choices"][0]["message"]
    assert metric(text, "dsv4:prefix_cache_tier_hits_total", tier="disk") == cached
