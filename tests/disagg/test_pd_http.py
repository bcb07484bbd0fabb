"""Router + one prefill + two decode engines (one pulling over TCP, one over NIXL/UCX) as separate
processes on loopback (random tiny model, demo tokenizer). The decode engine, asked directly without the transfer header, is the
colocated engine the disaggregated outputs are compared with (invariant 5). Faults come last:
an unreachable prefill engine, a transfer that times out, an abort during a transfer, the
prefill engine killed; after each, pages are back to idle on both sides."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from dsv4.disagg.settings import KV_TRANSFER_HEADER

SPEC = "random:tiny::vocab_size=8192"
ENGINE = ["--model", SPEC, "--port", "0", "--num-pages", "40", "--max-model-len", "2048", "--log-level", "warning"]
TIMEOUT_S = 6


@pytest.fixture(scope="module")
def cluster(demo_dir, tmp_path_factory):
    from serve.server_fixtures import ServerProcess     # inside: the serve tests load it as a plugin
    tmp = tmp_path_factory.mktemp("pd")
    tok = ["--tokenizer", demo_dir]
    prefill = ServerProcess([*ENGINE, *tok, "--role", "prefill", "--kv-transfer", '{"transport": "nixl"}'],
                            tmp / "prefill.log", wait=False)    # serves TCP and NIXL pulls
    decode = ServerProcess([*ENGINE, *tok, "--role", "decode", "--kv-transfer", f'{{"timeout": {TIMEOUT_S}}}'],
                           tmp / "decode.log", wait=False)
    nixl = ServerProcess([*ENGINE, *tok, "--role", "decode", "--kv-transfer", '{"transport": "nixl"}'],
                         tmp / "decode-nixl.log", wait=False)
    try:
        for engine in (prefill, decode, nixl):               # the three engines start side by side
            engine.wait_ready()
    except BaseException:
        for engine in (prefill, decode, nixl):
            engine.stop()
        raise
    router = ServerProcess(["--prefill", prefill.base_url, "--decode", decode.base_url, nixl.base_url, "--port", "0",
                            "--log-level", "warning"], tmp / "router.log", command="router")
    yield prefill, decode, router, nixl
    for p in (router, nixl, decode, prefill):
        p.stop()


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60, trust_env=False) as c:
        yield c


def complete(http, url, ids, max_tokens=5, headers=None, **extra) -> dict:
    r = http.post(f"{url}/v1/completions", headers=headers or {}, json={
        "model": SPEC, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def ids(n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def info(http, url) -> dict:
    return http.get(f"{url}/disagg/info").json()


def wait_idle(http, *urls) -> None:
    """Poll until the engines hold no page, run nothing and transfer nothing (stats arrive with
    each engine step, so this waits for the step that released them)."""
    deadline = time.monotonic() + 30
    while True:
        states = [info(http, u) for u in urls]
        if all(s["pages_used"] == 0 and s["swa_pages_used"] == 0 and s["slots_used"] == 0 and
               s["num_running"] == 0 and s["kv_transfers_pending"] == 0 for s in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.05)


# prompt lengths n; the state moves at L = n - 1: inside a C4 group, on a C4 boundary, shorter than
# the window, inside a C128 group, on a page boundary, one past it
@pytest.mark.parametrize("n", [1, 3, 5, 8, 131, 257, 258, 387])
def test_greedy_equals_colocated(cluster, http, n):
    prefill, decode, router, nixl = cluster
    prompt = ids(n, seed=n)
    got = complete(http, router.base_url, prompt)          # either decode engine (least loaded)
    want = complete(http, decode.base_url, prompt)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    pull = {KV_TRANSFER_HEADER: info(http, prefill.base_url)["state_address"]}
    via_nixl = complete(http, nixl.base_url, prompt, headers=pull)
    assert via_nixl["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == 5


def test_streaming_and_n(cluster, http):
    prefill, decode, router, nixl = cluster
    prompt = ids(300, seed=11)
    want = complete(http, decode.base_url, prompt, max_tokens=6)["choices"][0]["text"]
    both = complete(http, router.base_url, prompt, max_tokens=6, n=2)
    assert [c["text"] for c in both["choices"]] == [want, want]
    text = ""
    with http.stream("POST", f"{router.base_url}/v1/completions", json={
            "model": SPEC, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == want
    for engine in (decode, nixl):
        assert info(http, engine.base_url)["kv_transfers"] >= 3 and info(http, engine.base_url)["kv_transfer_bytes"] > 0
    wait_idle(http, prefill.base_url, decode.base_url, nixl.base_url)
    metrics = http.get(f"{router.base_url}/metrics").text
    assert 'dsv4_engine:kv_transfer_bytes{url="' + decode.base_url in metrics
    assert "dsv4_router:requests_total" in metrics
    wait_idle(http, prefill.base_url, decode.base_url)


def test_prompt_logprobs_are_computed_on_the_decode_engine(cluster, http):
    prefill, decode, router, nixl = cluster
    prompt = ids(20, seed=12)
    got = complete(http, router.base_url, prompt, max_tokens=2, prompt_logprobs=1)["choices"][0]
    want = complete(http, decode.base_url, prompt, max_tokens=2, prompt_logprobs=1)["choices"][0]
    assert got["prompt_logprobs"] == want["prompt_logprobs"] and len(got["prompt_logprobs"]) == 20
    assert got["text"] == want["text"]


def test_unreachable_prefill_fails_alone(cluster, http):
    prefill, decode, router, nixl = cluster
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"        # nobody listens once closed
    r = http.post(f"{decode.base_url}/v1/completions", headers={KV_TRANSFER_HEADER: dead},
                  json={"model": SPEC, "prompt": ids(40, 1), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 503 and "cannot reach the prefill engine" in r.json()["error"]["message"]
    wait_idle(http, decode.base_url)
    complete(http, router.base_url, ids(20, 2))                 # the others keep serving


def test_transfer_timeout_releases(cluster, http):
    prefill, decode, router, nixl = cluster
    with socket.socket() as silent:                          # accepts (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        r = http.post(f"{decode.base_url}/v1/completions", headers={
            KV_TRANSFER_HEADER: f"127.0.0.1:{silent.getsockname()[1]}"},
            json={"model": SPEC, "prompt": ids(40, 3), "max_tokens": 3, "temperature": 0})
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    wait_idle(http, decode.base_url)


def hang_up_after_sending(url: str, path: str, headers: dict, body: dict) -> None:
    """Send a whole HTTP request, then close the connection without reading anything."""
    import json
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {**headers, "content-type": "application/json",
                                               "content-length": len(data), "host": host}.items())
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + data)


def test_abort_during_transfer(cluster, http):
    prefill, decode, router, nixl = cluster
    for url in (decode.base_url, router.base_url):                     # the client hangs up before any byte
        headers = {KV_TRANSFER_HEADER: info(http, prefill.base_url)["state_address"]} if url == decode.base_url else {}
        before = (info(http, decode.base_url)["kv_transfers"] + info(http, nixl.base_url)["kv_transfers"],
                  info(http, prefill.base_url)["kv_transfers"])
        hang_up_after_sending(url, "/v1/completions", headers, {
            "model": SPEC, "prompt": ids(1900, 4), "max_tokens": 50, "temperature": 0, "stream": True})
        wait_idle(http, prefill.base_url, decode.base_url, nixl.base_url)
        after = (info(http, decode.base_url)["kv_transfers"] + info(http, nixl.base_url)["kv_transfers"],
                 info(http, prefill.base_url)["kv_transfers"])
        assert after == before              # no state installed, none sent: the prefill side dropped it
    complete(http, router.base_url, ids(10, 5))


def test_handshake_mismatch_is_refused(cluster, http):
    from dsv4.disagg.wire import parse_address, recv_frame, send_frame
    prefill, decode, router, nixl = cluster
    with socket.create_connection(parse_address(info(http, prefill.base_url)["state_address"]), timeout=10) as s:
        send_frame(s, {"op": "hello", "signature": "0" * 64, "summary": {"layers": 99}})
        reply, _ = recv_frame(s)
    assert not reply["ok"] and "KV layout mismatch" in reply["error"] and "'layers': 99" in reply["error"]


def test_decode_side_gone_mid_transfer_releases_prefill(cluster, http):
    from dsv4.disagg.wire import parse_address, recv_frame, send_frame
    prefill, decode, router, nixl = cluster
    state = info(http, prefill.base_url)
    with socket.create_connection(parse_address(state["state_address"]), timeout=10) as s:
        send_frame(s, {"op": "hello", "signature": state["state_signature"], "summary": {}})
        assert recv_frame(s)[0]["ok"]
        send_frame(s, {"op": "prefill", "id": "gone", "prompt": ids(1900, 7)})
    deadline = time.monotonic() + 30
    while info(http, prefill.base_url)["kv_transfer_failures"] == state["kv_transfer_failures"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    wait_idle(http, prefill.base_url)


def test_prefill_dies_mid_transfer(cluster, http):
    prefill, decode, router, nixl = cluster
    with socket.socket() as fake:                            # a prefill engine that dies half-way
        fake.bind(("127.0.0.1", 0))
        fake.listen(1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sent = pool.submit(http.post, f"{decode.base_url}/v1/completions",
                               headers={KV_TRANSFER_HEADER: f"127.0.0.1:{fake.getsockname()[1]}"},
                               json={"model": SPEC, "prompt": ids(40, 8), "max_tokens": 3, "temperature": 0})
            conn, _ = fake.accept()
            from dsv4.disagg.wire import recv_frame, send_frame
            with conn:
                recv_frame(conn)
                send_frame(conn, {"ok": True})
                recv_frame(conn)
                conn.sendall(b"\x00\x00\x01\x00{\"ok\": tr")         # part of a frame, then gone
            r = sent.result()
    assert r.status_code == 502 and "lost the prefill engine" in r.json()["error"]["message"]
    wait_idle(http, decode.base_url)


def test_prefill_engine_killed(cluster, http):
    prefill, decode, router, nixl = cluster
    for pid in children(prefill.proc.pid):                   # its engine core (the state server) first
        os.kill(pid, signal.SIGKILL)
    prefill.proc.kill()
    prefill.proc.wait()
    r = http.post(f"{router.base_url}/v1/completions", json={
        "model": SPEC, "prompt": ids(40, 6), "max_tokens": 3, "temperature": 0})
    assert r.status_code in (502, 503) and "prefill engine" in r.json()["error"]["message"]
    wait_idle(http, decode.base_url)
    complete(http, decode.base_url, ids(40, 6), max_tokens=3)     # the decode engine keeps serving
