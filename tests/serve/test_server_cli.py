"""`dsv4 serve` start-up and shutdown: clear failures (model folder, engine start, port),
and the engine core exiting when the API process dies."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4.cli import build_parser, main
from dsv4.text.tokenizer import TEST_TOKENIZER_DIR

pytest_plugins = ["serve.server_fixtures"]


def test_serve_flags_include_the_engine_flags():
    args = build_parser().parse_args(["serve", "--port", "0", "--num-pages", "4", "--served-model-name", "a", "b"])
    assert (args.host, args.port, args.num_pages, args.served_model_name, args.model) == ("127.0.0.1", 0, 4, ["a", "b"], None)


def test_missing_model_folder_is_named():
    with pytest.raises(SystemExit, match="--model /no/such/dir: no such directory"):
        main(["serve", "--model", "/no/such/dir"])


def test_model_folder_without_tokenizer_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        main(["serve", "--model", str(tmp_path)])


def test_busy_port_fails_before_loading(demo_dir, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", demo_dir, "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "loading" not in err


def test_engine_that_cannot_start_fails_with_its_reason(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):     # a tokenizer but no checkpoint
        (tmp_path / name).write_bytes((TEST_TOKENIZER_DIR / name).read_bytes())
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "serve", "--model", str(tmp_path), "--port", "0"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1
    assert f"dsv4 serve: the engine could not start: cannot load model '{tmp_path}'" in r.stderr


def test_engine_client_reports_an_engine_that_dies_or_hangs_at_start_up():
    from serve.server_fixtures import exiting_engine_core, silent_engine_core

    from dsv4.serve.client import EngineClient, EngineStartError
    exiting = EngineClient("m", None, exiting_engine_core)
    with pytest.raises(EngineStartError, match="exited with code 2 while loading 'm'"):
        exiting.start()
    client = EngineClient("m", None, silent_engine_core)
    with pytest.raises(EngineStartError, match="did not get ready within 1 s"):
        client.start(timeout=1)
    assert not client.process.is_alive()
    assert not any(os.path.exists(c.addresses.folder) for c in (exiting, client))   # IPC folders removed


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_engine_core_exits_when_the_api_process_dies(demo_dir, tmp_path):
    from serve.server_fixtures import ServerProcess
    server = ServerProcess(["--model", demo_dir, "--port", "0", "--num-pages", "4", "--max-model-len", "256"],
                           tmp_path / "serve.log")
    engines = [c for c in _children(server.proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1 and _alive(engines[0])
    server.proc.send_signal(signal.SIGKILL)
    server.stop()
    deadline = time.monotonic() + 15
    while _alive(engines[0]):
        assert time.monotonic() < deadline, "the engine core outlived the API process"
        time.sleep(0.1)
