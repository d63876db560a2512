"""What the benchmark harnesses (benchmarks/slo_scheduling.py, benchmarks/pd_disagg.py,
benchmarks/dp_router.py) share about the servers they start and ask. The processes themselves
(`ManagedProcess`, ports, `taskset`) are `kvflow.utils.processes`; the /metrics parser is
`kvflow.utils.prometheus`.

- Flags: `flag_value` (a flag's value in a `kvflow serve` argv list), `add_harness_args` and
  `parse_server_flags` (the flags every server-starting harness takes).
- /metrics: `scrape`. /v1/models: `served_model`, `server_max_model_len`; the harness tokenizer
  (`harness_tokenizer`).
- CPU pinning: `pinning_cpus` (the CPUs a harness pins its servers to), `thread_env`.
- Argument types the harnesses share with each other (finite numbers; kvflow.cli.bench has those
  that accept inf).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections.abc import Sequence
from typing import Any

from kvflow.utils.processes import ServerError, usable_cpus

# ----------------------------------------------------------------------------------------------
# Flags, arguments
# ----------------------------------------------------------------------------------------------


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in an argv list ('--flag V' or '--flag=V'), None if absent."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def nonneg_int(s: str) -> int:
    """An argparse type: an integer >= 0."""
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def positive_finite_float(s: str) -> float:
    """An argparse type: a finite number > 0 (kvflow.cli.bench's _positive_float also takes inf)."""
    v = float(s)
    if not v > 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


def nonneg_finite_float(s: str) -> float:
    """An argparse type: a finite number >= 0."""
    v = float(s)
    if not v >= 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def harness_tokenizer(tokenizer: str | None, server_flags: Sequence[str], required: bool = False) -> Any:
    """The prompts' tokenizer: `tokenizer` (--tokenizer), else the served model's (--tokenizer /
    --model in `server_flags`), else the default model's. Without any of them: None (prompts of
    common words), or with `required` the error of load_tokenizer('default') (ValueError)."""
    from kvflow.bench.datasets import default_model_gguf, load_tokenizer

    spec = tokenizer or flag_value(server_flags, "--tokenizer") or flag_value(server_flags, "--model")
    if not spec:
        spec = "default" if required or default_model_gguf() is not None else None
    return load_tokenizer(spec)


# ----------------------------------------------------------------------------------------------
# Asking a server: /v1/models, /metrics
# ----------------------------------------------------------------------------------------------


def served_model(base_url: str, timeout: float = 30.0) -> str:
    """The first model id of GET /v1/models; ServerError when there is none."""
    import asyncio

    import httpx

    from kvflow.bench.serve_client import fetch_model_id

    async def model_id() -> str:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            return await fetch_model_id(client, base_url)

    try:
        return asyncio.run(model_id())
    except ValueError as e:
        raise ServerError(str(e)) from None


def server_max_model_len(base_url: str, timeout: float = 10.0) -> int | None:
    """max_model_len of the first model in GET /v1/models (None if it cannot be read)."""
    import httpx

    try:
        data = httpx.get(base_url + "/v1/models", timeout=timeout, trust_env=False).json()["data"]
        return int(data[0]["max_model_len"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def scrape(base_url: str, timeout: float = 10.0) -> str:
    """The text of GET /metrics ('' when it cannot be reached)."""
    import httpx

    try:
        return httpx.get(base_url + "/metrics", timeout=timeout, trust_env=False).text
    except httpx.HTTPError:
        return ""


# ----------------------------------------------------------------------------------------------
# CPU pinning
# ----------------------------------------------------------------------------------------------


def pinning_cpus(spec: Sequence[int] | None = None, need: int = 2) -> list[int] | None:
    """The CPUs to pin servers to: `spec` (each must be usable here), else the first `need` usable
    ones; None when taskset is missing or fewer than `need` CPUs are usable."""
    usable = usable_cpus()
    if shutil.which("taskset") is None or usable is None:
        return None
    if spec is not None:
        missing = [c for c in spec if c not in usable]
        if missing:
            raise ValueError(
                f"--cpus {','.join(map(str, spec))}: CPU {missing[0]} is not usable here "
                f"(usable: {','.join(map(str, usable))})"
            )
        return list(spec)
    return usable[:need] if len(usable) >= need else None


def thread_env(threads: int | None) -> dict[str, str]:
    """The environment of a server: `threads` torch / OpenMP threads (None: its own choice)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def add_harness_args(ap, stop_timeout_s: float = 30.0) -> None:
    """The flags every server-starting benchmark takes: seed, server flags, tokenizer, timeouts,
    the result file."""
    ap.add_argument("--seed", type=int, default=0, help="workload seed, the same for every setup (default 0)")
    ap.add_argument(
        "--server-args", default="", help='more `kvflow serve` flags for every server, one string (e.g. "--model DIR")'
    )
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for the prompts (default: the --tokenizer/--model of --server-args, else the default model's)",
    )
    ap.add_argument(
        "--request-timeout", type=positive_finite_float, default=600.0, help="seconds per request (default 600)"
    )
    ap.add_argument(
        "--startup-timeout",
        type=positive_finite_float,
        default=600.0,
        help="seconds to wait for each server's /health (default 600)",
    )
    ap.add_argument(
        "--stop-timeout",
        type=positive_finite_float,
        default=stop_timeout_s,
        help=f"seconds after SIGTERM before a server is killed (default {stop_timeout_s:g})",
    )
    ap.add_argument("--result-json", default=None, help="write config, machine info and every figure here")


def parse_server_flags(ap, args, own_flags: Sequence[str], hint: str) -> None:
    """args.server_flags from --server-args; refuse the flags the harness sets itself."""
    import shlex

    args.server_flags = shlex.split(args.server_args)
    own = [f for f in own_flags if flag_value(args.server_flags, f) is not None or f in args.server_flags]
    if own:
        ap.error(f"the harness sets {', '.join(own)} itself: drop it from --server-args ({hint})")
