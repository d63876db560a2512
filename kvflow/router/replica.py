"""One data-parallel replica as the replica set sees it: the `Replica` protocol, the `ReplicaSpec`
it is built from, and the error of a replica that does not come up.

Two implementations: `local_replica.LocalReplica` (a `kvflow serve` process on this machine) and
`ray_replica.RayReplica` (one that a Ray actor runs on its node). `replica_set.ReplicaSet` starts,
watches, restarts and stops them through this protocol alone; `data_parallel` builds the specs and
puts the router in front.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvflow.utils.processes import ServerError

# The replica layer (local, Ray, the set) logs under one name, whichever module writes.
REPLICA_LOGGER = "kvflow.router.replicas"


class ReplicaStartError(ServerError):
    """A replica did not come up (it exited, or did not answer /health in time)."""


@dataclass
class ReplicaSpec:
    """One replica to start: its command line (taskset included), environment, port, CPUs, log."""

    index: int
    port: int
    argv: list[str]
    env: dict[str, str]
    cpus: list[int] | None  # None: not pinned (no taskset, or the CPUs are unknown)
    threads: int  # OMP_NUM_THREADS / MKL_NUM_THREADS
    log_path: str
    host: str = "127.0.0.1"  # where it listens (a Ray node's address under the ray backend)

    @property
    def name(self) -> str:
        return f"replica {self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@runtime_checkable
class Replica(Protocol):
    """One process of one replica. A restart is a new `Replica` (`renewed`) for the same spec: same
    command line, CPUs and port, the log appended to."""

    spec: ReplicaSpec
    restarts: int  # how many processes of this replica came before this one

    @property
    def name(self) -> str:
        """ "replica K", for messages."""

    @property
    def url(self) -> str:
        """Its base URL, as the router reaches it."""

    @property
    def pid(self) -> int | None:
        """Its server process's pid (None before it started)."""

    @property
    def log_path(self) -> str | None:
        """Its server's log file (on its node, for a Ray replica)."""

    @property
    def started(self) -> bool:
        """Whether `launch` has started its process."""

    def launch(self) -> None:
        """Start its process, not waiting for /health. ReplicaStartError (Ray) or OSError (local)
        when it cannot be started at all."""

    def poll_healthy(self) -> bool:
        """One /health probe: True when it answers 200; ServerError (`failure`) when it exited."""

    def exit_code(self) -> int | None:
        """None while it runs, else how it exited (a lost Ray actor: -1)."""

    def failure(self, returncode: int | None) -> ReplicaStartError:
        """The error for a start that failed: it exited with `returncode`, or (None) it did not
        answer /health in time; names the replica and its log's last lines."""

    def terminate(self) -> None:
        """SIGTERM, once (it drains); `stop` then waits for it."""

    def stop(self) -> None:
        """SIGTERM unless sent, wait up to the stop timeout, then SIGKILL its process group. Idempotent."""

    def kill(self) -> None:
        """SIGKILL to its process group at once (a restarted replica that never came up)."""

    def renewed(self, restarts: int) -> Replica:
        """A new, unstarted process for the same replica, the `restarts`-th."""

    def close(self) -> None:
        """Release what holds the replica beyond its process (a Ray actor); after `stop`."""


# How ReplicaSet builds a replica from its spec: (spec, stop_timeout, startup_timeout) -> Replica.
ReplicaFactory = Callable[[ReplicaSpec, float, float], Replica]
