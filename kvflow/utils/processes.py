"""Server processes: a server (`kvflow serve`, `kvflow router`, a replica) as a child in its own
process group with a log file, and the ports and CPUs it gets. Used by the data-parallel replicas
(`kvflow.router.local_replica`) and by the benchmark harnesses (benchmarks/).

- `ManagedProcess`: started and waited for until /health answers, a `ServerError` with the log's
  last lines when it exits or does not come up in time; stopped with SIGTERM, then SIGKILL to the
  whole group after a timeout. `started` runs several in order; `launch` / `poll_healthy` /
  `terminate` let a caller start or stop several at once. `exit_on_sigterm`: a SIGTERM handler that
  unwinds through the `with` blocks, which stop the servers.
- Ports: `free_port(s)`. Signals: `signal_group`. CPUs: `usable_cpus`, `pinned` (an argv under
  `taskset -c`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, Self


class ServerError(RuntimeError):
    """A server did not start, died, or failed a request its caller needs."""


def free_ports(n: int, host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> list[int]:
    """`n` distinct TCP ports free on `host` now (held together while the OS picks them), none of
    `exclude`: ports already promised to a server that has not bound them yet (the OS would hand
    them out again)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    taken = set(exclude)
    socks, ports = [], []
    try:
        while len(ports) < n:
            if len(socks) >= n + 64:
                raise OSError(f"no {n} free TCP ports on {host} outside {sorted(taken)}")
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)  # (an excluded pick stays held, so the OS picks another)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in taken:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick)."""
    return free_ports(1, host)[0]


def what_failed(returncode: int | None, startup_timeout: float) -> str:
    """How a server failed to start: it exited with `returncode`, or (None) never answered /health."""
    return (
        f"exited with code {returncode}"
        if returncode is not None
        else f"did not answer /health within {startup_timeout:g} s"
    )


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

    Its own group: a Ctrl-C in the terminal reaches only the parent, which then stops the server
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

    def __init__(
        self,
        argv: Sequence[str],
        port: int,
        *,
        startup_timeout: float,
        stop_timeout: float,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        echo: bool = True,
        die_with_parent: bool = False,
        append_log: bool = False,
    ):
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
        """Start the process (in a new process group of its own, output to the log); no waiting."""
        if self.echo:
            label = f" {self.name}" if self.name else ""
            print(f"starting{label}: {shlex.join(self.argv)}", flush=True)
        self._log = self._open_log()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )

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
        return ServerError(
            f"{self.name or 'the server'} {what_failed(returncode, self.startup_timeout)}; its log "
            f"is {self.log_path}, last lines:\n{self.log_tail()}"
        )

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


def usable_cpus() -> list[int] | None:
    """The CPUs this process may run on (None where the OS does not say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def pinned(argv: Sequence[str], cpus: Sequence[int] | None) -> list[str]:
    """argv run under `taskset -c CPUS` (unchanged when cpus is None)."""
    if cpus is None:
        return list(argv)
    return ["taskset", "-c", ",".join(str(c) for c in cpus), *argv]
