"""How long `kvflow serve` takes to be ready: launch to its first /health 200 (probed every 20 ms
with a plain HTTP connection, which costs the server's CPUs next to nothing), first on an empty
kvflow cache (the native libraries compile, the linear-kernel autotune measures, the GGUF's
metadata and tokenizer are prepared), then on the cache that start left (all of it read back); and
how long the first chat completion then takes (8 tokens, sent the moment /health answers: it runs
beside the grammar compiler's background build), and what importing torch and transformers alone
costs in a fresh interpreter on this machine.

    python benchmarks/startup.py [--starts 3] [--server-args "--model DIR ..."]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def import_seconds(module: str) -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.monotonic() - t


def _get(port: int, path: str, body: dict | None = None) -> int:
    """One request on a fresh connection; its status (ConnectionError while nothing listens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def wait_ready(server, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        server.check_alive()
        try:
            if _get(server.port, "/health") == 200:
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.02)
    raise TimeoutError(f"not ready in {deadline_s:g} s")


def main() -> int:
    from kvflow.bench.report import cpu_line
    from kvflow.utils.processes import ManagedProcess, free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=3, help="starts in all, the first on an empty cache (default 3)")
    ap.add_argument("--server-args", default="", help="extra `kvflow serve` flags")
    args = ap.parse_args()
    print(cpu_line())
    for module in ("torch", "transformers"):
        print(f"python -c 'import {module}': {import_seconds(module):.2f} s")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "KVFLOW_CACHE_DIR": cache}
        for i in range(args.starts):
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "kvflow.cli.main",
                "serve",
                "--port",
                str(port),
                *shlex.split(args.server_args),
            ]
            server = ManagedProcess(argv, port, startup_timeout=600.0, stop_timeout=30.0, env=env, echo=False)
            t = time.monotonic()
            try:
                server.launch()
                wait_ready(server, 600.0)
                ready = time.monotonic() - t
                t = time.monotonic()
                status = _get(
                    port,
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "What is the capital of Japan?"}], "max_tokens": 8},
                )
                first = time.monotonic() - t
            finally:
                server.stop()
            print(
                f"start {i + 1} ({'empty kvflow cache' if i == 0 else 'cache from start 1'}): ready in {ready:.2f} s; "
                f"first chat completion (8 tokens) {first:.2f} s later (HTTP {status})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
