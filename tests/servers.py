"""Starting a harli-train command that serves HTTP (``serve``, ``--colocate-with ... --serve``) from a test."""

import os
import re
import subprocess
import sys
import time

READY = re.compile(r"on http://127\.0\.0\.1:(\d+)/v1")


def launch(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 120.0, **popen):
    """Run ``python -m harli_train *args`` (stdout and stderr piped, text) until it logs the address it serves
    on; returns (process, base URL). The process's own environment, less TRITON_INTERPRET (the server runs the
    torch paths), plus ``env``. AssertionError with its stderr when it does not start within ``timeout_s``."""
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    cmd = [sys.executable, "-m", "harli_train", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, **popen
    )
    deadline = time.time() + timeout_s
    for line in proc.stderr:
        found = READY.search(line)
        if found:
            return proc, f"http://127.0.0.1:{found.group(1)}"
        if time.time() > deadline:
            break
    proc.kill()
    raise AssertionError(f"the server did not start: {proc.stderr.read()}")
