"""64 concurrent streaming clients on the demo model: every stream gets exactly its tokens
(the greedy text LLM.generate gives), /health stays 200, and afterwards the engine holds no
page; clients that hang up mid-stream get their requests aborted and their pages freed."""
import asyncio
import json
import time

import httpx
import pytest
import torch

pytest_plugins = ["serve.server_fixtures"]

CLIENTS, MAX_TOKENS, LONG = 64, 12, 480   # LONG: what hung-up clients asked for (context 512)


def prompt(i: int) -> list[int]:
    return [100 + i, 200 + i, 300 + (i * 7) % 300, 50 + i, 400 + i, 60 + i]


@pytest.fixture(scope="module")
def reference(demo_dir) -> list[str]:
    """Greedy texts of the load prompts, from the offline engine."""
    from dsv4.engine.llm import LLM
    from dsv4.sampling_params import SamplingParams
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = LLM(demo_dir, num_pages=8, max_model_len=512).generate(
            prompt_token_ids=[prompt(i) for i in range(CLIENTS)], use_tqdm=False,
            sampling_params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)
    return [o.text for o in outs]


async def stream(client: httpx.AsyncClient, i: int, max_tokens: int, hang_up_after: int | None = None) -> dict:
    body = {"model": "dsv4-test", "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    got = {"text": "", "tokens": 0, "finish": [], "usage": None, "done": 0, "events": 0}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            got["events"] += 1
            if line == "data: [DONE]":
                got["done"] += 1
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                got["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                got["text"] += choice["text"]
                got["tokens"] += len(choice["logprobs"]["tokens"])
                got["finish"] += [choice["finish_reason"]] if choice["finish_reason"] else []
            if hang_up_after is not None and got["events"] >= hang_up_after:
                return got          # leaving the block closes the connection mid-stream
    return got


async def watch_health(client: httpx.AsyncClient, stop: asyncio.Event) -> list[int]:
    codes = []
    while not stop.is_set():
        codes.append((await client.get("/health")).status_code)
        await asyncio.sleep(0.1)
    return codes


async def run_clients(base_url: str, headers: dict, jobs: list[tuple[int, int, int | None]]):
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=300,
                                 trust_env=False) as client:
        stop = asyncio.Event()
        health = asyncio.create_task(watch_health(client, stop))
        results = await asyncio.gather(*(stream(client, *job) for job in jobs))
        stop.set()
        return results, await health


def engine_is_idle(http, metric, deadline_s: float = 30) -> str:
    deadline = time.monotonic() + deadline_s
    while True:
        text = http.get("/metrics").text
        idle = {"dsv4:num_requests_running": 0, "dsv4:num_requests_waiting": 0, "dsv4:cache_pages_used": 0,
                "dsv4:swa_pages_used": 0, "dsv4:request_slots_used": 0,
                "dsv4:cache_pages_free": metric(text, "dsv4:cache_pages_total")}
        if all(metric(text, name) == value for name, value in idle.items()):
            return text
        assert time.monotonic() < deadline, f"the engine did not go idle:\n{text}"
        time.sleep(0.1)


def test_64_streams_get_exactly_their_tokens(real_server, http, metric, reference):
    from serve.server_fixtures import API_KEY
    engine_is_idle(http, metric)
    results, health = asyncio.run(run_clients(real_server.base_url, {"Authorization": f"Bearer {API_KEY}"},
                                              [(i, MAX_TOKENS, None) for i in range(CLIENTS)]))
    for i, got in enumerate(results):
        assert got["tokens"] == MAX_TOKENS and got["usage"]["completion_tokens"] == MAX_TOKENS, (i, got)
        assert got["finish"] == ["length"] and got["done"] == 1, (i, got)
        assert got["text"] == reference[i], i
    assert health and set(health) == {200}
    engine_is_idle(http, metric)


def test_clients_hanging_up_mid_stream_free_their_pages(real_server, http, metric):
    from serve.server_fixtures import API_KEY
    before = engine_is_idle(http, metric)
    jobs = [(i, LONG, 3) if i % 2 else (i, MAX_TOKENS, None) for i in range(CLIENTS)]
    results, health = asyncio.run(run_clients(real_server.base_url, {"Authorization": f"Bearer {API_KEY}"}, jobs))
    assert all(got["tokens"] == MAX_TOKENS and got["done"] == 1 for got in results[::2])
    assert set(health) == {200}
    after = engine_is_idle(http, metric)
    aborted = (metric(after, "dsv4:request_success_total", finished_reason="abort")
               - metric(before, "dsv4:request_success_total", finished_reason="abort"))
    assert aborted == CLIENTS // 2
    # Had the hung-up requests gone on, the engine would have run >= LONG steps and made
    # their LONG tokens each; the margin allows for an API process lagging behind on 2 cores.
    generated = metric(after, "dsv4:generation_tokens_total") - metric(before, "dsv4:generation_tokens_total")
    assert generated < CLIENTS * MAX_TOKENS + (CLIENTS // 2) * LONG * 3 // 4
    steps = metric(after, "dsv4:engine_steps_total") - metric(before, "dsv4:engine_steps_total")
    assert 0 < steps < LONG * 3 // 4
