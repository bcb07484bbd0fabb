"""README.md's commands run as written, on the demo model, with the server on a free port
(every "8000" becomes that port):

* the Serving section: its `dsv4 serve` line starts the server, every other shell line and
  every Python block that talks to it must succeed (exit 0, no OpenAI error body, no failed
  benchmark request);
* the offline Python block runs;
* the other `dsv4 ...` lines on the random checkpoint the README writes (`/tmp/tiny`, here a
  fresh folder) or on a `random:` spec run in order and must succeed; the lines that name a
  released checkpoint the tests cannot have (`dsv4 convert V4-Flash ...`) are checked against
  the CLI's parser; `make serve ARGS=...` must pass ARGS to `dsv4 serve`;
* last, SIGTERM during a stream: the stream still ends complete, new connections are refused,
  the server exits 0, its engine core is gone and its IPC folder removed.
"""
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall(README) if tag == lang]


def lines(block: str) -> list[str]:
    """Shell commands of a block (continuations joined, blank lines dropped)."""
    return [ln.strip() for ln in block.replace("\\\n", " ").splitlines() if ln.strip()]


SERVING = next(b for b in blocks("bash") if any(ln.startswith("dsv4 serve") for ln in lines(b)))
SERVE_LINE = next(ln for ln in lines(SERVING) if ln.startswith("dsv4 serve"))
CLIENT_LINES = [ln for b in blocks("bash") for ln in lines(b)
                if "127.0.0.1:8000" in ln and not ln.startswith("dsv4 serve")]
API_KEY = shlex.split(SERVE_LINE)[shlex.split(SERVE_LINE).index("--api-key") + 1]


def _env(tmpdir: Path) -> dict:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, tmp: Path):
        self.port, self.tmp = _free_port(), tmp
        self.log = tmp / "serve.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(["bash", "-c", "exec " + self.on_port(SERVE_LINE)], stdout=log,
                                         stderr=subprocess.STDOUT, env=_env(tmp), cwd=ROOT)
        deadline = time.monotonic() + 180
        while "ready at" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def on_port(self, text: str) -> str:
        return text.replace("8000", str(self.port))

    def run(self, command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, env=_env(self.tmp), cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("readme"))
    yield server
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        server.proc.wait(30)


def test_serving_commands_run_as_written(served):
    assert CLIENT_LINES and any("bench serve" in ln for ln in CLIENT_LINES)
    for line in CLIENT_LINES:
        r = served.run(["bash", "-c", served.on_port(line)])
        assert r.returncode == 0, (line, r.stdout, r.stderr)
        assert '"error"' not in r.stdout, (line, r.stdout)
        if line.startswith("curl"):
            assert r.stdout.startswith("{"), (line, r.stdout)
        if "bench serve" in line:
            assert re.search(r"Failed requests:\s+0\b", r.stdout), r.stdout


def test_python_blocks_run_as_written(served):
    client_blocks = [b for b in blocks("python") if "127.0.0.1:8000" in b]
    assert client_blocks and any("tools" in b for b in client_blocks)
    for block in blocks("python"):
        r = served.run([sys.executable, "-c", served.on_port(block)])
        assert r.returncode == 0, (block, r.stdout, r.stderr)
        assert r.stdout.strip(), block


OTHERS = [ln.split(" #")[0].strip() for b in blocks("bash") for ln in lines(b)
          if ln.startswith("dsv4 ") and ln not in CLIENT_LINES and ln != SERVE_LINE]
RUNNABLE = [ln for ln in OTHERS if "/tmp/tiny" in ln or "random:" in ln]


# the `dsv4` entry point (dsv4.cli.main) on each line in turn, in one fresh process: one start-up
# (torch and the CLI imported once) for all the lines; the first that fails stops it, named
RUN_IN_TURN = """
import shlex, sys
from dsv4.cli import main
for line in sys.argv[1:]:
    print("$", line, flush=True)
    try:
        code = main(shlex.split(line)[1:])
    except SystemExit as e:
        code = e.code
    if code:
        sys.exit(f"{line!r} exited with {code}")
"""


def test_commands_on_the_random_checkpoint_run_as_written(tmp_path):
    assert RUNNABLE[0].startswith("dsv4 init-random /tmp/tiny") and len(RUNNABLE) >= 4
    lines = [line.replace("/tmp/tiny", str(tmp_path / "tiny")) for line in RUNNABLE]
    r = subprocess.run([sys.executable, "-c", RUN_IN_TURN, *lines], capture_output=True, text=True,
                       env=_env(tmp_path), cwd=ROOT, timeout=600)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert [ln[2:] for ln in r.stdout.splitlines() if ln.startswith("$ ")] == lines, r.stdout


def test_other_commands_parse():
    from dsv4.cli import build_parser
    parser = build_parser()
    assert any("convert" in ln for ln in OTHERS)
    for line in OTHERS:
        parser.parse_args(shlex.split(line)[1:])
    assert 'make serve ARGS="--port 8080"' in README
    r = subprocess.run(["make", "-n", "serve", "ARGS=--port 8080"], capture_output=True, text=True, cwd=ROOT)
    assert "dsv4 serve --port 8080" in r.stdout, r.stdout + r.stderr


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


def test_sigterm_during_a_stream_finishes_it_and_cleans_up(served):
    engines = _children(served.proc.pid)
    assert engines and list(served.tmp.glob("dsv4-ipc-*"))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "dsv4-demo", "prompt": "def", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}", headers=headers, trust_env=False,
                      timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            events = r.iter_lines()
            assert next(events).startswith("data: ")
            served.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not _refused(served.port):
                assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
                time.sleep(0.05)
            rest = [e for e in events if e.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2], rest[-3:]
    assert served.proc.wait(60) == 0, served.log.read_text()
    # the engine core is joined before exit; helpers such as multiprocessing's resource
    # tracker see the server's pipe close and leave on their own, a moment later
    deadline = time.monotonic() + 20
    while not all(_gone(pid) for pid in engines):
        assert time.monotonic() < deadline, [(pid, _gone(pid)) for pid in engines]
        time.sleep(0.05)
    assert not list(served.tmp.glob("dsv4-ipc-*"))
