"""Data-parallel replicas placed by Ray: `kvflow serve --data-parallel-size N --data-parallel-backend ray`.

Each replica is a Ray actor (`ReplicaHost`) holding one CPU bundle of a placement group (SPREAD:
on different nodes where the cluster has them); the actor runs the replica's `kvflow serve` on its
node, bound to the node's address on a port free there, exactly as the `mp` backend runs one on
this machine (the same command line, a log file, its own process group, SIGTERM when the actor
dies). The router in this process reaches the replicas over HTTP at the URLs the actors report, so
nothing but requests crosses machines. A replica process that exits is restarted by its actor in
place (same node, same port: the router's backend list stays valid) within the restart budget of
`ReplicaSet` (`replica_set.py`); an actor that is lost (its node died) takes its replica out of
rotation for good. `RayReplica` is this process's `Replica` (`replica.py`) for one actor.

Ray joins the cluster named by RAY_ADDRESS, or the one this process already started, or starts a
local one (and stops it at the end). Actor calls carry plain data (lists, dicts of strings and
numbers) -- no objects of kvflow's cross the wire.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Any

from kvflow.router.local_replica import LocalReplica
from kvflow.router.replica import REPLICA_LOGGER, ReplicaSpec, ReplicaStartError
from kvflow.utils.processes import ServerError, free_port, what_failed
from kvflow.utils.ray import import_ray, join_ray

logger = logging.getLogger(REPLICA_LOGGER)

CALL_TIMEOUT_S = 30.0  # one actor call (a /health probe there, a poll): a node that does not answer is lost
PLACEMENT_TIMEOUT_S = 60.0
# The variables of a replica's environment that belong to it; the rest is the node's own.
_REPLICA_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "KVFLOW_API_KEY", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE")


class ReplicaHost:
    """On a Ray node: one replica's `kvflow serve` process. `argv` is the command line built for
    this machine; its interpreter, --host and --port are replaced by the node's own."""

    def __init__(
        self,
        index: int,
        argv: list[str],
        env: dict[str, str],
        threads: int,
        log_name: str,
        stop_timeout: float,
        startup_timeout: float,
    ) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        argv = [sys.executable, *argv[1:]]
        for flag, value in (("--host", host), ("--port", str(port))):
            argv[argv.index(flag) + 1] = value
        log_dir = os.path.join(tempfile.gettempdir(), "kvflow-dp-ray")
        os.makedirs(log_dir, exist_ok=True)
        self.spec = ReplicaSpec(
            index, port, argv, {**os.environ, **env}, None, threads, os.path.join(log_dir, log_name), host=host
        )
        self.stop_timeout, self.startup_timeout = stop_timeout, startup_timeout
        self.proc: LocalReplica | None = None

    def launch(self, restarts: int) -> dict[str, Any]:
        self.proc = LocalReplica(self.spec, self.stop_timeout, self.startup_timeout, restarts=restarts)
        self.proc.launch()
        return {"url": self.spec.url, "pid": self.proc.pid, "log_path": self.spec.log_path}

    def exit_code(self) -> int | None:
        return self.proc.exit_code()

    def poll_healthy(self) -> tuple[bool, int | None]:
        """(answers /health, the exit code when it has exited)."""
        try:
            return self.proc.poll_healthy(), None
        except ServerError:
            return False, self.proc.exit_code()

    def log_tail(self, lines: int = 20) -> str:
        return self.proc.log_tail(lines) if self.proc is not None else "    (no log)"

    def terminate(self) -> None:
        if self.proc is not None:
            self.proc.terminate()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()


class RayReplica:
    """`Replica` for one that a `ReplicaHost` actor runs: this process's handle on it."""

    def __init__(
        self,
        spec: ReplicaSpec,
        stop_timeout: float,
        startup_timeout: float,
        *,
        placement: RayPlacement,
        restarts: int = 0,
        actor: Any = None,
    ) -> None:
        self.spec, self.name, self.restarts = spec, spec.name, restarts
        self.stop_timeout, self.startup_timeout = stop_timeout, startup_timeout
        self.placement, self.actor = placement, actor
        self._info: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return self._info["url"] if self._info else self.spec.url

    @property
    def pid(self) -> int | None:
        return self._info["pid"] if self._info else None

    @property
    def log_path(self) -> str:
        return self._info["log_path"] if self._info else self.spec.log_path

    @property
    def started(self) -> bool:
        return self._info is not None

    def launch(self) -> None:
        ray = import_ray()
        try:
            if self.actor is None:
                self.actor = self.placement.actor(self.spec, self.stop_timeout, self.startup_timeout)
            self._info = ray.get(self.actor.launch.remote(self.restarts), timeout=self.startup_timeout)
        except Exception as e:  # the actor could not be created, or its node could not start the process
            raise ReplicaStartError(
                f"data-parallel {self.name}: its Ray actor could not start it ({type(e).__name__}: {e})"
            ) from None

    def exit_code(self) -> int | None:
        try:
            return self._call("exit_code")
        except ReplicaStartError:
            return -1  # the actor (its node) is gone: as an exit

    def poll_healthy(self) -> bool:
        healthy, code = self._call("poll_healthy")
        if code is not None:
            raise self.failure(code)
        return healthy

    def failure(self, returncode: int | None) -> ReplicaStartError:
        return ReplicaStartError(
            f"data-parallel {self.name} ({self.url}, a Ray actor) "
            f"{what_failed(returncode, self.startup_timeout)}; its log is {self.log_path} on its "
            f"node, last lines:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return self._call("log_tail", lines)
        except ReplicaStartError as e:
            return f"    ({e})"

    def terminate(self) -> None:
        if self.actor is not None:
            self.actor.terminate.remote()  # answered by stop()

    def stop(self) -> None:
        if self.actor is None:
            return
        try:
            import_ray().get(self.actor.stop.remote(), timeout=self.stop_timeout + CALL_TIMEOUT_S)
        except Exception as e:  # the actor is gone (its process with it) or does not answer
            logger.warning("data-parallel %s: stopping it through its Ray actor failed: %s", self.name, e)

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._call("kill")

    def renewed(self, restarts: int) -> RayReplica:
        """The replica's next process, by the same actor (same node, same port)."""
        return RayReplica(
            self.spec,
            self.stop_timeout,
            self.startup_timeout,
            placement=self.placement,
            restarts=restarts,
            actor=self.actor,
        )

    def close(self) -> None:
        if self.actor is not None:
            with contextlib.suppress(Exception):
                import_ray().kill(self.actor)

    def _call(self, method: str, *args: Any) -> Any:
        ray = import_ray()
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=CALL_TIMEOUT_S)
        except Exception as e:  # RayActorError, GetTimeoutError, ...
            raise ReplicaStartError(
                f"data-parallel {self.name}: its Ray actor is lost ({type(e).__name__}: {e})"
            ) from None


class RayPlacement:
    """Ray for the replicas: joined or started, one placement group of `n` bundles of `threads`
    CPUs (SPREAD), and the `ReplicaFactory` of `ReplicaSet`. `close` gives it all back."""

    def __init__(self, n: int, threads: int) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group

        self._started_ray = join_ray()
        self.threads = threads
        self.pg = placement_group([{"CPU": threads}] * n, strategy="SPREAD")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            cpus = ray.cluster_resources().get("CPU", 0)
            self.close()
            raise ValueError(
                f"Ray could not place {n} data-parallel replicas of {threads} CPU(s) each within "
                f"{PLACEMENT_TIMEOUT_S:g} s (the cluster has {cpus:g} CPUs)"
            )
        self._actor_cls = ray.remote(ReplicaHost)

    def factory(self, spec: ReplicaSpec, stop_timeout: float, startup_timeout: float) -> RayReplica:
        return RayReplica(spec, stop_timeout, startup_timeout, placement=self)

    def actor(self, spec: ReplicaSpec, stop_timeout: float, startup_timeout: float) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=spec.index)
        env = {k: spec.env[k] for k in _REPLICA_ENV if k in spec.env}
        return self._actor_cls.options(num_cpus=self.threads, scheduling_strategy=strategy, max_restarts=0).remote(
            spec.index,
            list(spec.argv),
            env,
            spec.threads,
            os.path.basename(spec.log_path),
            stop_timeout,
            startup_timeout,
        )

    def close(self) -> None:
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
