"""A `dsv4 serve` child process of a benchmark: wait until its log says it is ready."""
from __future__ import annotations

import re
import subprocess
import time

READY = re.compile(r"ready at (http://\S+)")


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
