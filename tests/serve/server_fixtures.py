"""Servers for the server tests (load with `pytest_plugins = ["serve.server_fixtures"]`).

* `real_server` (session): `python -m dsv4.cli serve --port 0 ...` as a subprocess on the
  demo checkpoint (a random tiny model with the bundled test tokenizer until the trained
  demo lands), with an API key, reached at `real_server.base_url`.
* `fake_server` (session) / `fake_server_factory`: the real API process in a thread of this
  process, wired over the same IPC protocol to `fake_engine_core`, a scripted engine core
  whose replies are fixed texts chosen by a `[[key]]` marker in the prompt (see SCRIPTS).
  Random weights never write `</think>` or DSML; the scripts do. Markers beyond SCRIPTS:
  [[fail]] (500 after one token), [[endless]] (one token per 20 ms until aborted),
  [[crash]] (the core exits), [[garbage]] (the core sends an undecodable frame).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dsv4.serve.chat_format.dsml import BLOCK_CLOSE, BLOCK_OPEN, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN
from dsv4.engine.core import _drain
from dsv4.engine.ipc import (AbortRequests, AddRequest, EngineStats, Ready, RequestFailed, Shutdown,
                            StepOutputs, TokenOutput, encode, engine_sockets, parent_alive)

API_KEY = "test-key"
MODEL_NAMES = ["dsv4-test", "dsv4-alias"]
READY = re.compile(r"ready at (http://\S+)")

_CALL = (f'{INVOKE_OPEN}get_weather">\n{PARAM_OPEN}city" string="true">Paris{PARAM_CLOSE}\n'
         f'{PARAM_OPEN}days" string="false">3{PARAM_CLOSE}\n{INVOKE_CLOSE}\n{BLOCK_CLOSE}')
SCRIPTS = {
    "think": "Two and two make four.</think>The answer is 4.",
    "tool": "Let me check.\n\n" + BLOCK_OPEN + "\n" + _CALL,
    "tool_rest": _CALL,                                   # after a forced "\n\n<block>\n" prefill
    "named_rest": _CALL.split("\n", 1)[1],                # after a forced invoke header
    "plain": "Hello from the fake engine.",
    # Real-output variants: typed by the schema, a spurious "arguments" wrapper, cut mid-value.
    "typed_tool": BLOCK_OPEN + _CALL.replace('"false">3', '"true">3').replace("\n", ""),
    "wrapped_tool": (f'{BLOCK_OPEN}{INVOKE_OPEN}get_weather">{PARAM_OPEN}arguments" string="false">'
                     f'{{"city": "Paris", "days": 3}}{PARAM_CLOSE}{INVOKE_CLOSE}{BLOCK_CLOSE}'),
    "cut_tool": "Let me check.\n\n" + BLOCK_OPEN + "\n" + _CALL.split('"false">')[0] + '"false">[1,2',
}
DEFAULT_REPLY = SCRIPTS["plain"]
FAKE_MAX_MODEL_LEN = 4096
STEP_S, SLOW_STEP_S = 0.002, 0.02


# ---- the scripted engine core ----------------------------------------------------------------
class _Script:
    def __init__(self, tok, msg: AddRequest):
        text = tok.decode(msg.prompt_token_ids)
        key = next((k for k in ("crash", "garbage", "fail", "endless", *SCRIPTS) if f"[[{k}]]" in text), "plain")
        if key.endswith("_rest") and not text.endswith(("tool_calls>\n", '">\n')):
            key = "plain"                                # the prompt lacks the forced prefill
        self.key, self.params, self.rid = key, msg.params, msg.request_id
        reply = SCRIPTS.get(key, "a")
        self.tokens = tok.encode(reply) + [tok.eos_id]
        self.sent = 0

    def next_output(self) -> TokenOutput | RequestFailed:
        if self.key == "fail" and self.sent == 1:
            return RequestFailed(self.rid, 500, "injected failure")
        tid = self.tokens[0] if self.key == "endless" else self.tokens[self.sent]
        self.sent += 1
        out = TokenOutput(self.rid, [tid])
        if self.params.logprobs is not None:
            out.logprobs = [[(tid, -0.25)] + [(t, -1.0 - t / 1000) for t in range(self.params.logprobs)
                                             if t != tid]]
        eos = tid == self.tokens[-1] and self.key != "endless"
        if eos or self.sent >= self.params.max_tokens:
            out.finished, out.finish_reason = True, "stop" if eos else "length"
        return out


def fake_engine_core(model_dir, config, addresses, parent_pid) -> None:
    import zmq

    from dsv4.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    ctx = zmq.Context()
    inbox, outbox = engine_sockets(ctx, addresses)
    outbox.send(encode(Ready(max_model_len=FAKE_MAX_MODEL_LEN, vocab_size=tok.vocab_size, eos_token_id=tok.eos_id,
                             num_pages=16, max_num_seqs=64, max_request_tokens=FAKE_MAX_MODEL_LEN,
                             memory_report="fake engine core")))
    active: dict[str, _Script] = {}
    while parent_alive(parent_pid):
        for msg in _drain(inbox, 0 if active else 100):
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    active.pop(rid, None)
            elif isinstance(msg, AddRequest):
                script = _Script(tok, msg)
                if script.key == "crash":
                    os._exit(3)
                if script.key == "garbage":
                    outbox.send(b"\xc1 not msgpack")
                active[msg.request_id] = script
        results = [s.next_output() for s in list(active.values())]
        for r in results:
            if isinstance(r, RequestFailed) or r.finished:
                active.pop(r.request_id)
        outputs = [r for r in results if isinstance(r, TokenOutput)]
        failures = [r for r in results if isinstance(r, RequestFailed)]
        outbox.send(encode(StepOutputs(outputs, failures, EngineStats(num_running=len(active)))))
        time.sleep(SLOW_STEP_S if any(s.key == "endless" for s in active.values()) else STEP_S)


def exiting_engine_core(*args) -> None:
    """An engine core that dies before saying anything."""
    os._exit(2)


def silent_engine_core(*args) -> None:
    """An engine core that never gets ready (the client's start timeout ends it)."""
    time.sleep(120)


class ThreadServer:
    """An APIServer running in a thread of this process."""

    def __init__(self, model_dir: str, engine_target, api_key: str | None = None, limits=None,
                 api_server_count: int = 1):
        from dsv4.serve.http.limits import ServerLimits
        from dsv4.serve.http.server import APIServer, ServeSettings
        settings = ServeSettings(model_dir=model_dir, model_names=list(MODEL_NAMES), port=0, api_key=api_key,
                                 log_level="warning", limits=limits or ServerLimits(),
                                 api_server_count=api_server_count)
        self.server = APIServer(settings, engine_target)
        self.server.start_engine(timeout=60)
        self.base_url = self.server.url
        self.exit_code: int | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(30), "the in-process server did not start"

    def _run(self, ready: threading.Event) -> None:
        self.exit_code = self.server.serve(on_ready=ready.set)

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(30)


def start_fake_server(limits=None, api_server_count: int = 1) -> ThreadServer:
    from dsv4.text.tokenizer import TEST_TOKENIZER_DIR
    return ThreadServer(str(TEST_TOKENIZER_DIR), fake_engine_core, limits=limits, api_server_count=api_server_count)


@pytest.fixture(scope="session")
def fake_server():
    server = start_fake_server()
    yield server
    server.stop()


@pytest.fixture
def fake_server_factory():
    """start(limits=None, api_server_count=1) -> a fresh fake server of its own (stopped after the test)."""
    started = []
    yield lambda limits=None, api_server_count=1: started.append(start_fake_server(limits, api_server_count)) or started[-1]
    for server in started:
        server.stop()


# ---- the real server ------------------------------------------------------------------------
class ServerProcess:
    """`python -m dsv4.cli <command> *args` (`serve`, or `router` of the disaggregated tests) with
    its output in `log_path`, ready once it logs "ready at <url>" (then `base_url`). `wait=False`
    returns at once (`base_url` None): call `wait_ready()` later, so several start together."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 180, command: str = "serve",
                 wait: bool = True):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 shared cores: one torch thread is much faster
        self.command, self.log_path, self.timeout = command, log_path, timeout
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli", command, *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env)
        self.base_url = self.wait_ready() if wait else None

    def wait_ready(self) -> str:
        self.base_url = self._wait_ready(self.timeout)
        return self.base_url

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = READY.search(self.log())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                pytest.fail(f"dsv4 {self.command} exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"dsv4 {self.command} did not get ready in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def demo_dir() -> str:
    from dsv4.assets import demo_model_dir
    return demo_model_dir()


@pytest.fixture(scope="session")
def real_server(demo_dir, tmp_path_factory):
    args = ["--model", demo_dir, "--port", "0", "--served-model-name", *MODEL_NAMES, "--api-key", API_KEY,
            "--num-pages", "96", "--max-model-len", "512", "--log-level", "warning",
            "--grammar-worker", "process"]   # (the structured-output tests take the worker process path)
    server = ServerProcess(args, tmp_path_factory.mktemp("server") / "serve.log")
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture
def http(real_server):
    with httpx.Client(base_url=real_server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60, trust_env=False) as client:
        yield client


@pytest.fixture(scope="session")
def metric():
    """metric(prometheus_text, name, **labels) -> the sample's value (0.0 when absent)."""
    return read_metric


def read_metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0
