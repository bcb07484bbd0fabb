"""`dsv4 serve` stopped before it is ready: SIGTERM while the model loads ends the server
and its engine core at once (exit 130), leaving no IPC folder. (SIGTERM of a running server:
tests/serve/test_readme.py and test_server_policy.py::test_stop_drains_then_fails_what_still_runs.)"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

pytest_plugins = ["serve.server_fixtures"]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_while_loading_stops_everything(demo_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "serve", "--model", demo_dir, "--port", "0"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    engines: list[int] = []
    while not engines:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        engines = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 130, log.read_text()
    assert "interrupted while loading the model" in log.read_text()
    deadline = time.monotonic() + 10
    while _alive(engines[0]):
        assert time.monotonic() < deadline, "the engine core outlived the server"
        time.sleep(0.05)
    assert not list(tmp_path.glob("dsv4-ipc-*"))
