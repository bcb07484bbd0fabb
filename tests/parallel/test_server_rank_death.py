"""`dsv4 serve --tensor-parallel-size 2` (or `--data-parallel-size 2 --enable-expert-parallel`)
when rank 1 dies mid-request: the request in flight fails with a 5xx (an error, not a hang)
and the server exits with code 1."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest_plugins = ["serve.server_fixtures"]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _spawned(pid: int) -> bool:
    return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()


def _post(url: str, body: dict, out: dict) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out["status"], out["body"] = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        out["status"], out["body"] = e.code, e.read().decode()


@pytest.mark.parametrize("parallel", [["--tensor-parallel-size", "2"],
                                      ["--data-parallel-size", "2", "--enable-expert-parallel"]])
def test_a_dead_rank_fails_the_request_and_ends_the_server(demo_dir, tmp_path, parallel):
    from serve.server_fixtures import ServerProcess
    server = ServerProcess(["--model", demo_dir, "--port", "0", "--num-pages", "8", "--max-model-len", "2048",
                            *parallel], tmp_path / "serve.log")
    try:
        core = next(c for c in _children(server.proc.pid) if _spawned(c))
        rank1 = next(c for c in _children(core) if _spawned(c))
        out: dict = {}
        body = {"prompt": "hello", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        t = threading.Thread(target=_post, args=(server.base_url + "/v1/completions", body, out))
        t.start()
        deadline = time.monotonic() + 120
        while _generated(_metrics(server.base_url)) < 2:          # the request is decoding
            assert time.monotonic() < deadline and t.is_alive(), out
        os.kill(rank1, signal.SIGKILL)
        t.join(120)
        assert not t.is_alive(), "the request hangs"
        assert out["status"] >= 500, out
        assert server.proc.wait(60) == 1, server.log()[-2000:]
        assert "parallel rank dsv4-rank1 exited" in server.log()
    finally:
        server.stop()


def _metrics(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return r.read().decode()


def _generated(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("dsv4:generation_tokens_total") or line.startswith("dsv4:generated_tokens"):
            return float(line.split()[-1])
    return 0.0
