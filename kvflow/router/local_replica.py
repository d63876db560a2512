"""A replica as a process on this machine (the `mp` data-parallel backend, and what a Ray actor runs on
its node): its `kvflow serve` in its own process group with a log file, SIGTERM when the thread that
started it dies (PR_SET_PDEATHSIG, Linux)."""

from __future__ import annotations

import signal

from kvflow.router.replica import ReplicaSpec, ReplicaStartError
from kvflow.utils.processes import ManagedProcess, signal_group, what_failed


class LocalReplica(ManagedProcess):
    """`Replica` for a local process."""

    def __init__(self, spec: ReplicaSpec, stop_timeout: float, startup_timeout: float, restarts: int = 0) -> None:
        super().__init__(
            spec.argv,
            spec.port,
            name=spec.name,
            env=spec.env,
            log_path=spec.log_path,
            startup_timeout=startup_timeout,
            stop_timeout=stop_timeout,
            echo=False,
            die_with_parent=True,
            append_log=restarts > 0,
        )
        self.spec = spec
        self.restarts = restarts  # how many processes of this replica came before this one

    @property
    def url(self) -> str:
        return self.spec.url

    def failure(self, returncode: int | None) -> ReplicaStartError:
        return ReplicaStartError(
            f"data-parallel {self.name} ({self.url}) {what_failed(returncode, self.startup_timeout)}; its log "
            f"is {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def started(self) -> bool:
        return self.proc is not None

    def kill(self) -> None:
        """SIGKILL to its whole process group (a restarted replica that never came up)."""
        signal_group(self.proc, signal.SIGKILL)

    def renewed(self, restarts: int) -> LocalReplica:
        """A new process for the same replica (same command line, CPUs, port; the log goes on)."""
        return LocalReplica(self.spec, self.stop_timeout, self.startup_timeout, restarts=restarts)

    def close(self) -> None:
        """Nothing holds a local replica beyond its process."""
