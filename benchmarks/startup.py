"""How long `kvflow serve` takes to be ready: launch to its first /health 200 (probed every 0.5 s), first on an empty
kernel cache (the native libraries compile, the linear-kernel autotune measures), then on the cache
that start left (the stored choice read back), and what importing torch and transformers alone
costs in a fresh interpreter on this machine.

    python benchmarks/startup.py [--starts 3] [--server-args "--model DIR ..."]
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    from kvflow.bench.report import cpu_line
    from kvflow.bench.servers import ManagedProcess, free_port

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
            argv = [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port),
                    *shlex.split(args.server_args)]
            t = time.monotonic()
            with ManagedProcess(argv, port, startup_timeout=600.0, stop_timeout=30.0, env=env, echo=False):
                ready = time.monotonic() - t
            print(f"start {i + 1} ({'empty kernel cache' if i == 0 else 'cache from start 1'}): ready in {ready:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
