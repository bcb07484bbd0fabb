"""A `dsv4 serve` child process of a benchmark: wait until its log says it is ready; its
processes' pids (API processes and engine core) from the same log."""
from __future__ import annotations

import re
import subprocess
import time

READY = re.compile(r"ready at (http://\S+)")
PROCESSES = re.compile(r"processes: api ([\d ]+); engine core (\d+)")    # logged just before READY


def wait_ready(proc: subprocess.Popen, log_path: str, timeout: float) -> str:
    """The server's URL once `log_path` (its stderr) announces it; RuntimeError (with the log's
    tail) when it exits first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = READY.search(open(log_path, errors="replace").read())
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"dsv4 serve exited with {proc.returncode}:\n"
                               + open(log_path, errors="replace").read()[-3000:])
        time.sleep(0.3)
    raise RuntimeError(f"dsv4 serve not ready in {timeout:.0f} s")


def server_pids(log_path: str) -> dict[str, int]:
    """{"api0": pid, "api1": pid, ..., "engine": pid} as the ready server logged them (API
    process 0 first: `--api-server-count`, serve/http/api_workers.py)."""
    found = PROCESSES.search(open(log_path, errors="replace").read())
    if found is None:
        raise RuntimeError(f"{log_path}: no 'processes: api ...; engine core ...' line")
    pids = {f"api{i}": int(pid) for i, pid in enumerate(found.group(1).split())}
    pids["engine"] = int(found.group(2))
    return pids


def with_api_total(values: dict[str, float]) -> dict[str, float]:
    """`values` by process plus "api": the sum over the API processes (api0, api1, ...)."""
    return {**values, "api": sum(v for k, v in values.items() if k.startswith("api") and k != "api")}
