"""`dsv4 serve --api-server-count N` (serve/http/api_workers.py): N API processes on one port,
one engine core. The wire routes each request's outputs to the process that sent it; requests
spread over the processes give the tokens of a single-process server (invariant 5); aborts and
disconnects are per process; an API process or the engine core that dies ends the whole
server; the flag's errors name it."""
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
import zmq

from dsv4.cli import main
from dsv4.cli.serve import api_server_count
from dsv4.engine import ipc
from dsv4.engine.ipc import (AddRequest, EngineStats, RequestFailed, StepOutputs, TokenOutput, owned_id,
                             request_owner)
from dsv4.sampling_params import SamplingParams

pytest_plugins = ["serve.server_fixtures"]

PROCESSES = re.compile(r"processes: api ([\d ]+); engine core (\d+)")
PROMPTS = [[11, 12, 13, 14, 15], [300, 301, 302], [7] * 9, [42, 4242, 4000, 17]]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if _alive(p)]}"
        time.sleep(0.05)


# ---- the wire ------------------------------------------------------------------------------
def test_request_ids_name_their_api_process():
    assert owned_id(0, 1, "abc-0") == "abc-0" and request_owner("abc-0") == 0
    assert [request_owner(owned_id(i, 3, "abc-0")) for i in range(3)] == [0, 1, 2]
    assert owned_id(1, 2, "abc-0") != owned_id(0, 2, "abc-0")


def test_engine_takes_inputs_from_every_api_process_and_routes_outputs_to_their_owner():
    addresses = ipc.Addresses.new(2)
    ctx = zmq.Context()
    try:
        api = [ipc.api_sockets(ctx, addresses.of(i)) for i in range(2)]
        inbox, outbox = ipc.engine_sockets(ctx, addresses)
        for i, (push, _) in enumerate(api):
            push.send(ipc.encode(AddRequest(owned_id(i, 2, "r"), [1, 2], SamplingParams())))
        got = sorted(ipc.decode_input(inbox.recv()).request_id for _ in range(2) if inbox.poll(5000))
        assert got == ["0:r", "1:r"]
        stats = EngineStats(num_running=2, steps=7)
        outbox.send_step(StepOutputs([TokenOutput("0:r", [5]), TokenOutput("1:r", [6]), TokenOutput("1:s", [7])],
                                     [RequestFailed("0:t", 400, "no")], stats))
        parts = [ipc.decode_output(pull.recv()) for _, pull in api if pull.poll(5000)]
        assert [[o.token_ids for o in p.outputs] for p in parts] == [[[5]], [[6], [7]]]
        assert [[f.request_id for f in p.failures] for p in parts] == [["0:t"], []]
        assert all(p.stats == stats for p in parts)      # every API process gets the engine's stats
    finally:
        ctx.destroy(linger=0)
        addresses.remove()


# ---- the flag ------------------------------------------------------------------------------
class _Args:
    def __init__(self, n):
        self.api_server_count = n


def test_flag_errors_name_the_flag():
    cores = len(os.sched_getaffinity(0))
    for n, message in ((0, "must be >= 1"), (-2, "must be >= 1"), (cores + 1, f"the {cores} cores")):
        with pytest.raises(SystemExit, match=f"--api-server-count.*{message}"):
            api_server_count(_Args(n), disaggregated=False)
    with pytest.raises(SystemExit, match="--api-server-count: a prefill/decode role"):
        api_server_count(_Args(2), disaggregated=True)
    with pytest.raises(SystemExit, match="--api-server-count must be >= 1, got 0"):
        main(["serve", "--api-server-count", "0"])
    assert api_server_count(_Args(None), disaggregated=True) == 1


def test_default_is_one_process():
    assert api_server_count(_Args(None), disaggregated=False) == 1


# ---- a real server of two API processes ------------------------------------------------------
@pytest.fixture(scope="module")
def two_servers(demo_dir, tmp_path_factory):
    from serve.server_fixtures import ServerProcess
    args = ["--model", demo_dir, "--port", "0", "--api-server-count", "2", "--num-pages", "96",
            "--max-model-len", "512", "--log-level", "warning"]
    server = ServerProcess(args, tmp_path_factory.mktemp("api2") / "serve.log")
    api, engine = PROCESSES.search(server.log()).groups()
    server.pids = [int(p) for p in api.split()] + [int(engine)]
    yield server
    assert server.stop() == 0, server.log()          # SIGINT to process 0 alone stops them all
    _wait_gone(server.pids)


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[str, object]:
    """(the answering API process, the text of each choice) over a connection of its own."""
    with httpx.Client(base_url=url, trust_env=False, timeout=120, headers=headers) as http:
        if not body.get("stream"):
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.headers.get("x-dsv4-api-server"), [c["text"] for c in r.json()["choices"]]
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            return r.headers.get("x-dsv4-api-server"), ["".join(c["choices"][0]["text"] for c in chunks)]


def test_requests_spread_over_both_processes_give_single_process_tokens(two_servers, real_server, metric):
    from serve.server_fixtures import API_KEY
    bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": s}
              for p in PROMPTS for s in (False, True)] * 3
    results: list = [None] * len(bodies)

    def run(i):
        results[i] = _post(two_servers.base_url, bodies[i])
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {who for who, _ in results} == {"0", "1"}, results
    auth = {"Authorization": f"Bearer {API_KEY}"}
    single = {json.dumps(b["prompt"]): _post(real_server.base_url, {**b, "stream": False}, auth)[1]
              for b in bodies[:len(PROMPTS) * 2]}
    for body, (_, texts) in zip(bodies, results):
        assert texts == single[json.dumps(body["prompt"])]
    _engine_metrics_agree(two_servers.base_url, metric)


def _by_process(url: str, path: str) -> dict[str, str]:
    """GET `path` from each API process (new connections until both answered)."""
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only {sorted(seen)} answered"
        with httpx.Client(base_url=url, trust_env=False, timeout=30) as http:
            r = http.get(path)
            seen[r.headers["x-dsv4-api-server"]] = r.text
    return seen


def _engine_metrics_agree(url: str, metric) -> None:
    """Every process reports the engine's own figures (steps, tokens, running) alike."""
    names = ("dsv4:engine_steps_total", "dsv4:generation_tokens_total", "dsv4:num_requests_running")
    deadline = time.monotonic() + 30
    while True:
        texts = _by_process(url, "/metrics")
        values = {p: [metric(t, n) for n in names] for p, t in texts.items()}
        if values["0"] == values["1"] and values["0"][2] == 0:
            break
        assert time.monotonic() < deadline, values
        time.sleep(0.05)
    assert values["0"][1] > 0


def test_disconnects_abort_in_the_process_that_served_them(two_servers, metric):
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
    served = set()
    while served != {"0", "1"}:            # a dropped stream on each process
        with httpx.Client(base_url=two_servers.base_url, trust_env=False, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert next(r.iter_lines()).startswith("data: ")
                served.add(r.headers["x-dsv4-api-server"])
    _engine_metrics_agree(two_servers.base_url, metric)      # nothing left running in the engine
    texts = _by_process(two_servers.base_url, "/metrics")
    aborts = {p: metric(t, "dsv4:request_success_total", finished_reason="abort") for p, t in texts.items()}
    assert aborts["0"] >= 1 and aborts["1"] >= 1, aborts
    assert [metric(texts[p], "dsv4:api_server_info", api_server=p, api_server_count="2") for p in "01"] == [1, 1]
    assert {p for p in _by_process(two_servers.base_url, "/health")} == {"0", "1"}


# ---- deaths (the scripted engine core: no model to load) --------------------------------------
def _endless_stream_on(server, process: str, stack):
    """A streamed [[endless]] chat answered by API process `process`: its line iterator."""
    body = {"messages": [{"role": "user", "content": "[[endless]]"}], "max_tokens": 3000, "stream": True}
    while True:
        http = stack.enter_context(httpx.Client(base_url=server.base_url, trust_env=False, timeout=30))
        r = stack.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        if r.headers["x-dsv4-api-server"] == process:
            return lines


def _ends_with_an_error(lines, words: str) -> None:
    rest = [ln for ln in lines if ln.startswith("data: ")]
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == 500 and words in error["message"] and rest[-1] == "data: [DONE]", rest[-3:]


def test_an_api_process_that_dies_ends_the_server(fake_server_factory):
    from contextlib import ExitStack
    server = fake_server_factory(api_server_count=2)
    worker, engine = server.server.workers.processes[0], server.server.client.process
    with ExitStack() as stack:
        lines = _endless_stream_on(server, "0", stack)
        os.kill(worker.pid, signal.SIGKILL)
        _ends_with_an_error(lines, "API process 1 died")
    server.thread.join(30)
    assert server.exit_code == 1
    _wait_gone([engine.pid, worker.pid])
    assert not os.path.exists(server.server.client.addresses.folder)


def test_engine_death_ends_every_api_process(fake_server_factory):
    from contextlib import ExitStack
    server = fake_server_factory(api_server_count=2)
    worker = server.server.workers.processes[0]
    with ExitStack() as stack:
        lines = _endless_stream_on(server, "1", stack)
        with httpx.Client(base_url=server.base_url, trust_env=False, timeout=30) as http:
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "[[crash]]"}]})
        _ends_with_an_error(lines, "engine core")
    server.thread.join(30)
    assert server.exit_code == 1
    worker.join(30)
    assert worker.exitcode == 1


def test_stopping_process_0_drains_every_api_process(fake_server_factory):
    """SIGTERM/Ctrl-C/stop() of process 0 reaches the others: a stream on process 1 still runs
    for the drain time, then ends with a 503 event; every process exits 0."""
    from contextlib import ExitStack

    from dsv4.serve.http.limits import ServerLimits
    server = fake_server_factory(ServerLimits(shutdown_timeout=0.3), api_server_count=2)
    worker, engine = server.server.workers.processes[0], server.server.client.process
    with ExitStack() as stack:
        lines = _endless_stream_on(server, "1", stack)
        server.server.stop()
        rest = [ln for ln in lines if ln.startswith("data: ")]
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"] and rest[-1] == "data: [DONE]"
    server.thread.join(30)
    worker.join(30)
    assert (server.exit_code, worker.exitcode) == (0, 0)
    _wait_gone([engine.pid])
    assert not os.path.exists(server.server.client.addresses.folder)
