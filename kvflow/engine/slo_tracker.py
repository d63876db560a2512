"""SLO attainment and goodput (requests per second that met all their SLOs; DistServe's measure),
from finished requests' timestamps: TTFT = first token - arrival, TPOT = (last token - first
token) / (tokens - 1). A request without an SLO of a kind meets it; one that failed or was aborted
meets none."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvflow.outputs import RequestOutput

SLO_KINDS = ("ttft", "tpot", "all")


@dataclass
class SLOStats:
    attained: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SLO_KINDS, 0))
    missed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SLO_KINDS, 0))
    goodput: float = 0.0  # requests/s that met all their SLOs, over the last window_s
    window_s: float = 60.0

    @property
    def attainment(self) -> float:
        total = self.attained["all"] + self.missed["all"]
        return self.attained["all"] / total if total else 1.0


class SLOTracker:
    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.stats = SLOStats(window_s=window_s)
        self._good: deque[float] = deque()  # finish times of requests that met all their SLOs

    def record(self, outputs: Iterable[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._record(out)

    def _record(self, out: RequestOutput) -> None:
        m = out.metrics
        ok = out.error is None and all(c.finish_reason in ("stop", "length") for c in out.outputs)
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
        tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        tpot = (m.last_token_time - m.first_token_time) / (tokens - 1) if tokens > 1 and ttft is not None else 0.0
        met = {
            "ttft": ok and ttft is not None and (m.ttft_slo is None or ttft <= m.ttft_slo),
            "tpot": ok and (m.tpot_slo is None or tpot <= m.tpot_slo),
        }
        met["all"] = met["ttft"] and met["tpot"]
        for kind, hit in met.items():
            (self.stats.attained if hit else self.stats.missed)[kind] += 1
        if met["all"]:
            self._good.append(m.finished_time if m.finished_time is not None else self.clock())

    def snapshot(self) -> SLOStats:
        now = self.clock()
        while self._good and self._good[0] < now - self.window_s:
            self._good.popleft()
        self.stats.goodput = len(self._good) / self.window_s
        return SLOStats(dict(self.stats.attained), dict(self.stats.missed), self.stats.goodput, self.window_s)
