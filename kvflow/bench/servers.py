"""Managed server processes for the benchmark harnesses (benchmarks/slo_scheduling.py, benchmarks/pd_disagg.py,
benchmarks/dp_router.py) and for the replicas of `kvflow serve --data-parallel-size N` (kvflow/router/replicas.py).

- Ports and flags: `free_port(s)`, `flag_value` (a flag's value in a `kvflow serve` argv list).
- `ManagedProcess`: a server (`kvflow serve`, `kvflow router`, ...) as a child in its own process
  group, its stdout and stderr in a log file; started and waited for until /health answers, a
  `ServerError` with the log's last lines when it exits or does not come up in time; stopped with
  SIGTERM, then SIGKILL to the whole group after a timeout. `started` runs several in order;
  `launch` / `poll_healthy` / `terminate` let a caller start or stop several at once.
- `exit_on_sigterm`: a SIGTERM handler that unwinds through the `with` blocks, which stop the servers.
- /metrics: `scrape` and the Prometheus text parser (`parse_prometheus`, `sample_sum`, `by_label`).
- /v1/models: `served_model`, `server_max_model_len`; the harness tokenizer (`harness_tokenizer`).
- CPU pinning: `usable_cpus`, `pinning_cpus`, `pinned` (an argv under `taskset -c`), `thread_env`.
- Argument types the harnesses share with each other (finite numbers; kvflow.cli.bench has those
  that accept inf).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import IO, Any, Iterator, Mapping, Sequence, Self

# ----------------------------------------------------------------------------------------------
# Ports, flags, arguments
# ----------------------------------------------------------------------------------------------


class ServerError(RuntimeError):
    """A server did not start, died, or failed a request the harness needs: the harness stops."""


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports free on 127.0.0.1 now (held together while the OS picks them)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def what_failed(returncode: int | None, startup_timeout: float) -> str:
    """How a server failed to start: it exited with `returncode`, or (None) never answered /health."""
    return (f"exited with code {returncode}" if returncode is not None
            else f"did not answer /health within {startup_timeout:g} s")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
    return free_ports(1)[0]


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
# Server processes
# ----------------------------------------------------------------------------------------------


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the process group of `proc` (start_new_session made it: the server and its children)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def indented_tail(text: str, lines: int = 20) -> str:
    """The last `lines` lines of `text`, each indented by four spaces."""
    return "\n".join("    " + ln for ln in text.strip().splitlines()[-lines:])


class ManagedProcess:
    """A server as a child in its own process group, its stdout and stderr in a log file.

    Its own group: a Ctrl-C in the terminal reaches only the harness, which then stops the server
    in order (SIGTERM: drain, then SIGKILL to the whole group if it does not exit in time).
    The log is `log_path`, or without one a temporary file removed when the server is stopped.
    `name` labels the messages (None: "starting: ...", "server PID ..."). Use as a context
    manager (`with ManagedProcess(...) as p:`), or `start()` and `stop()`; `stop` is idempotent.
    Subclasses may override `failure` to explain a failed start from the log.
    `echo` False: no "starting ..." line on stdout. `die_with_parent` (Linux): the child gets SIGTERM
    when the thread that started it dies, even by SIGKILL of the process (PR_SET_PDEATHSIG; start it
    from a thread that lives as long as the child should). `append_log`: add to `log_path` rather
    than overwrite it (a restarted server keeps its predecessor's log).
    """

    def __init__(self, argv: Sequence[str], port: int, *, startup_timeout: float, stop_timeout: float,
                 name: str | None = None, env: Mapping[str, str] | None = None, log_path: str | None = None,
                 echo: bool = True, die_with_parent: bool = False, append_log: bool = False):
        self.argv, self.port, self.name = list(argv), port, name
        self.env = dict(env) if env is not None else None
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.log_path = log_path
        self.append_log = append_log
        self.echo, self.die_with_parent = echo, die_with_parent
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._terminated_at: float | None = None  # when SIGTERM was sent (once: a second one forces an exit)
        self._stopped = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _open_log(self) -> IO[bytes]:
        if self.log_path is not None:
            return open(self.log_path, "ab" if self.append_log else "wb")
        log = tempfile.NamedTemporaryFile(prefix="kvflow-serve-", suffix=".log")  # removed when closed
        self.log_path = log.name
        return log

    def start(self) -> None:
        """Start it and wait for /health; on any failure (Ctrl-C included) it is stopped first."""
        try:
            self.launch()
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def launch(self) -> None:
        """Start the process (its own session and process group, output to the log); no waiting."""
        if self.echo:
            label = f" {self.name}" if self.name else ""
            print(f"starting{label}: {shlex.join(self.argv)}", flush=True)
        self._log = self._open_log()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True,
                                     preexec_fn=_die_with_parent if self.die_with_parent else None)

    def log_text(self) -> str | None:
        """Everything in the log so far, None when it cannot be read."""
        if self.log_path is None:
            return None
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return None

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_text()
        return "    (no log)" if text is None else indented_tail(text, lines)

    def failure(self, returncode: int | None) -> ServerError:
        """The error when it exited with `returncode`, or (None) did not answer /health in time."""
        return ServerError(f"{self.name or 'the server'} {what_failed(returncode, self.startup_timeout)}; its log "
                           f"is {self.log_path}, last lines:\n{self.log_tail()}")

    def check_alive(self) -> None:
        """ServerError (`failure`) if it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            raise self.failure(self.proc.returncode if self.proc is not None else None)

    def poll_healthy(self) -> bool:
        """One /health probe: True when it answers 200; ServerError (`failure`) when it exited."""
        import httpx

        self.check_alive()
        try:
            return httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False  # not listening yet

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.poll_healthy():
                return
            time.sleep(0.5)
        raise self.failure(None)

    def terminate(self) -> None:
        """SIGTERM to the group, once (the server drains); `stop` then waits for it."""
        proc = self.proc
        if proc is not None and proc.poll() is None and self._terminated_at is None:
            signal_group(proc, signal.SIGTERM)
            self._terminated_at = time.monotonic()

    def stop(self) -> None:
        """SIGTERM to the group (unless `terminate` sent it), wait up to `stop_timeout` since then,
        SIGKILL on timeout; then SIGKILL to whatever it left in its group (its own children), and
        the log is closed. Idempotent."""
        proc = self.proc
        if proc is not None and not self._stopped:
            if proc.poll() is None:
                self.terminate()
                assert self._terminated_at is not None
                try:
                    proc.wait(max(0.0, self._terminated_at + self.stop_timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    who = f"{self.name} (pid {proc.pid})" if self.name else f"server {proc.pid}"
                    print(f"{who} still up {self.stop_timeout:g} s after SIGTERM: killing it", flush=True)
                    signal_group(proc, signal.SIGKILL)
                    proc.wait()
            signal_group(proc, signal.SIGKILL)  # no member left: nothing happens
            self._stopped = True
        if self._log is not None:
            self._log.close()
            self._log = None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own stop() is what ends the child


@contextlib.contextmanager
def started(procs: Sequence[ManagedProcess]) -> Iterator[list[ManagedProcess]]:
    """Start every process in order (each healthy before the next); stop them in reverse order,
    a failed start included."""
    with contextlib.ExitStack() as stack:
        for p in procs:
            stack.callback(p.stop)  # registered first: a failed start is stopped too
            p.start()
        yield list(procs)


def exit_on_sigterm(signum: int, frame: Any) -> None:
    """A SIGTERM handler (`signal.signal(signal.SIGTERM, exit_on_sigterm)`): SystemExit(128 + signum)
    unwinds through the `with` blocks of the managed processes, which stop them."""
    raise SystemExit(128 + signum)


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


Sample = tuple[str, dict[str, str], float]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[Sample]:
    """(name, labels, value) of every sample line (comments and unparsable lines skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(2) or "")}
        out.append((m.group(1), labels, value))
    return out


def sample_sum(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when none)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def by_label(samples: Sequence[Sample], name: str, label: str) -> dict[str, float]:
    """The samples called `name`, summed by the value of their label `label` (those without it left out)."""
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name and label in lab:
            out[lab[label]] = out.get(lab[label], 0.0) + v
    return out


# ----------------------------------------------------------------------------------------------
# CPU pinning
# ----------------------------------------------------------------------------------------------


def usable_cpus() -> list[int] | None:
    """The CPUs this process may run on (None where the OS does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def pinning_cpus(spec: Sequence[int] | None = None, need: int = 2) -> list[int] | None:
    """The CPUs to pin servers to: `spec` (each must be usable here), else the first `need` usable
    ones; None when taskset is missing or fewer than `need` CPUs are usable."""
    usable = usable_cpus()
    if shutil.which("taskset") is None or usable is None:
        return None
    if spec is not None:
        missing = [c for c in spec if c not in usable]
        if missing:
            raise ValueError(f"--cpus {','.join(map(str, spec))}: CPU {missing[0]} is not usable here "
                             f"(usable: {','.join(map(str, usable))})")
        return list(spec)
    return usable[:need] if len(usable) >= need else None


def pinned(argv: Sequence[str], cpus: Sequence[int] | None) -> list[str]:
    """argv run under `taskset -c CPUS` (unchanged when cpus is None)."""
    if cpus is None:
        return list(argv)
    return ["taskset", "-c", ",".join(str(c) for c in cpus), *argv]


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
    ap.add_argument("--server-args", default="",
                    help="more `kvflow serve` flags for every server, one string (e.g. \"--model DIR\")")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer for the prompts (default: the --tokenizer/--model of --server-args, "
                         "else the default model's)")
    ap.add_argument("--request-timeout", type=positive_finite_float, default=600.0,
                    help="seconds per request (default 600)")
    ap.add_argument("--startup-timeout", type=positive_finite_float, default=600.0,
                    help="seconds to wait for each server's /health (default 600)")
    ap.add_argument("--stop-timeout", type=positive_finite_float, default=stop_timeout_s,
                    help=f"seconds after SIGTERM before a server is killed (default {stop_timeout_s:g})")
    ap.add_argument("--result-json", default=None, help="write config, machine info and every figure here")


def parse_server_flags(ap, args, own_flags: Sequence[str], hint: str) -> None:
    """args.server_flags from --server-args; refuse the flags the harness sets itself."""
    import shlex

    args.server_flags = shlex.split(args.server_args)
    own = [f for f in own_flags if flag_value(args.server_flags, f) is not None or f in args.server_flags]
    if own:
        ap.error(f"the harness sets {', '.join(own)} itself: drop it from --server-args ({hint})")

