"""How much CPU other processes took while a block of code ran: what makes a timing on a shared
machine (and kernels that keep every core in an OpenMP team) untrustworthy. Read from /proc/stat
(all CPUs' busy time) less this process's own user + system time."""

from __future__ import annotations

import os
import resource
import time


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _own_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class ForeignLoad:
    """`with ForeignLoad() as load: ...`; then `load.value`: CPU-seconds per wall second that
    *other* processes used meanwhile (cores' worth; nan where /proc/stat is missing). Other
    tenants of a virtual machine's host are not visible this way."""

    value: float = float("nan")

    def __enter__(self) -> ForeignLoad:
        self._proc = os.path.exists("/proc/stat")
        self._t, self._own = time.perf_counter(), _own_seconds()
        self._busy = _busy_seconds() if self._proc else 0.0
        return self

    def __exit__(self, *exc) -> None:
        dt = time.perf_counter() - self._t
        if self._proc and dt > 0:
            own = _own_seconds() - self._own
            self.value = max(0.0, (_busy_seconds() - self._busy - own) / dt)
