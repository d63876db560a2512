"""The replicas of `kvflow serve --data-parallel-size N`, as one set: started together, waited for
together, stopped together; once serving, `ReplicaSet.watch` restarts those that exit.

A replica that exits while serving (a crash, the OOM killer, a failed engine step) is restarted:
the same command line (port, CPUs, flags), its log appended to. `RestartBudget` bounds the restarts
of each replica (`--replica-max-restarts` within `--replica-restart-window-s`), so one that crashes
at once is not restarted forever; a restarted one that does not answer /health within its startup
timeout is killed and counts as another exit. Past the bound it stays out of rotation; when every
replica is gone for good, the set says so (`on_all_gone`).

The replicas are `Replica`s (`replica.py`), local processes by default (`LocalReplica`) or those of
Ray actors (`ray_replica.RayPlacement.factory`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvflow.router.local_replica import LocalReplica
from kvflow.router.replica import REPLICA_LOGGER, Replica, ReplicaFactory, ReplicaSpec
from kvflow.utils.processes import ServerError

logger = logging.getLogger(REPLICA_LOGGER)

# A replica loading a large model on a slow disk may take minutes; one that neither exits nor
# answers /health by then is a failed start, not a reason to wait forever.
STARTUP_TIMEOUT_S = 900.0


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds: a replica that keeps dying
    (a bad flag, a machine out of memory) is given up on instead of restarted in a loop."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts, self.window_s = max_restarts, window_s
        self._times: deque[float] = deque()

    def take(self, now: float) -> bool:
        """True (and counted) when one more restart at `now` is within the budget."""
        while self._times and now - self._times[0] >= self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    def describe(self) -> str:
        if self.max_restarts == 0:
            return "--replica-max-restarts is 0"
        return f"{self.max_restarts} restart(s) within {self.window_s:g} s already"


class ReplicaSet:
    """The replicas: started together, waited for together, stopped together; once serving, `watch`
    restarts those that exit (within `max_restarts` per `restart_window_s` each). `procs[k]` is
    replica k's current process (a restart replaces it), built by `factory`."""

    def __init__(
        self,
        specs: Sequence[ReplicaSpec],
        *,
        stop_timeout: float,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        max_restarts: int = 0,
        restart_window_s: float = 300.0,
        factory: ReplicaFactory = LocalReplica,
    ) -> None:
        self.specs = list(specs)
        self.procs: list[Replica] = [factory(s, stop_timeout, startup_timeout) for s in self.specs]
        self.stop_timeout, self.startup_timeout = stop_timeout, startup_timeout
        self._budgets = [RestartBudget(max_restarts, restart_window_s) for _ in self.specs]
        # Restarted replicas not healthy yet: index -> the time by which they must be.
        self._restarting: dict[int, float] = {}
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        # Held by each watcher pass: once stop() has taken it, no replica is launched any more.
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    def launch(self) -> None:
        """Start every replica (no waiting); from the main thread (PR_SET_PDEATHSIG is per thread)."""
        for p in self.procs:
            p.launch()

    def wait_healthy(self, cancelled: Callable[[], bool] = lambda: False, interval_s: float = 0.25) -> bool:
        """Until every replica answers /health: True; False when `cancelled()` turned true first.
        ReplicaStartError as soon as one exits, or when one is not healthy in time."""
        deadline = time.monotonic() + self.startup_timeout
        pending = list(self.procs)
        while pending:
            if cancelled():
                return False
            pending = [p for p in pending if not p.poll_healthy()]  # raises when one exited
            if pending and time.monotonic() > deadline:
                raise pending[0].failure(None)
            if pending:
                time.sleep(interval_s)
        return True

    def running(self) -> list[bool]:
        return [p.started and p.exit_code() is None for p in self.procs]

    def watch(self, on_all_gone: Callable[[], None], interval_s: float = 0.5) -> None:
        """In a daemon thread: restart each replica that exits, within its budget (the router's
        health checks keep it out of rotation until it answers again); log one given up on, and
        call `on_all_gone()` once every replica is. The restarted replicas are this thread's
        children, so it lives until `stop` has stopped them: PR_SET_PDEATHSIG sends a child SIGTERM
        when the thread that started it ends, and a second SIGTERM would cut a replica's drain."""

        def loop() -> None:
            gone: set[int] = set()
            while not self._stopping.wait(interval_s):
                with self._lock:
                    if self._stopping.is_set():
                        break
                    for k in range(len(self.procs)):
                        try:
                            if k not in gone and self._tend(k):
                                gone.add(k)
                        except Exception:  # this thread must outlive its children (see above)
                            logger.exception("data-parallel replica %d: watching it failed", k)
                if len(gone) == len(self.procs):
                    logger.error("every data-parallel replica has exited: stopping")
                    on_all_gone()
                    return
            self._stopped.wait()

        self._watcher = threading.Thread(target=loop, name="kvflow-dp-watch", daemon=True)
        self._watcher.start()

    def _tend(self, k: int) -> bool:
        """One look at replica `k`: restart it if it exited (True when it is given up on instead),
        or, restarted, see whether it answers /health yet."""
        p = self.procs[k]
        code = p.exit_code()
        if code is None:
            if k in self._restarting:
                self._check_restarted(k, p)
            return False
        self._restarting.pop(k, None)
        budget = self._budgets[k]
        if not budget.take(time.monotonic()):
            logger.error(
                "data-parallel %s (pid %d, %s) exited with code %s: out of rotation, not restarted (%s; "
                "GET /health is 503 until the server restarts); its log is %s",
                p.name,
                p.pid,
                p.url,
                code,
                budget.describe(),
                p.log_path,
            )
            return True
        return not self._restart(k, p, code)

    def _restart(self, k: int, old: Replica, code: int) -> bool:
        """A new process for replica `k` (same command line, CPUs, port; the log goes on); False when
        it cannot even be started."""
        old.stop()  # it has exited: this reaps it and kills what it left in its process group
        n = old.restarts + 1
        logger.error(
            "data-parallel %s (pid %d, %s) exited with code %s: restarting it (restart %d; its log %s goes on)",
            old.name,
            old.pid,
            old.url,
            code,
            n,
            old.log_path,
        )
        try:
            with open(old.log_path, "a", encoding="utf-8") as f:
                f.write(f"\n---- kvflow: {old.name} exited with code {code}; restart {n} ----\n")
        except OSError:
            pass  # the log is for people: a restart does not depend on it
        new = old.renewed(n)
        try:
            new.launch()
        except Exception as e:  # OSError here; a Ray actor that is gone there
            logger.error("data-parallel %s could not be restarted (%s): out of rotation", old.name, e)
            return False
        self.procs[k] = new
        self._restarting[k] = time.monotonic() + self.startup_timeout
        return True

    def _check_restarted(self, k: int, p: Replica) -> None:
        try:
            healthy = p.poll_healthy()
        except ServerError:
            return  # it exited: the next pass restarts it again or gives up on it
        if healthy:
            del self._restarting[k]
            logger.warning(
                "data-parallel %s (pid %d, %s) answers /health again after restart %d: back in "
                "rotation at the router's next probe",
                p.name,
                p.pid,
                p.url,
                p.restarts,
            )
        elif time.monotonic() > self._restarting[k]:
            # It serves nothing yet: nothing to drain, so no SIGTERM and wait.
            logger.error(
                "data-parallel %s (pid %d) did not answer /health within %g s of its restart: killing it",
                p.name,
                p.pid,
                self.startup_timeout,
            )
            p.kill()

    def stop(self) -> None:
        """SIGTERM to every replica at once, then wait for each (SIGKILL to its group after the
        stop timeout). Idempotent."""
        self._stopping.set()
        with self._lock:  # a watcher pass under way (a restart) finishes first; none comes after
            procs = list(self.procs)
        for p in procs:
            p.terminate()
        for p in procs:
            p.stop()
        for p in procs:
            p.close()
        self._stopped.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(5)
