"""`priority`, as vLLM's: lower `priority` first, ties by arrival; the least important running
request is preempted first, a more important waiting request displaces it even when
`max_num_seqs` are running (vLLM #40004: there it waits behind them), and a more important prompt
gets the step's prefill tokens before a less important one part-way through its chunks.

Aging: a request's effective priority improves by one level for every `aging_s` seconds since its
arrival, so nothing waits forever: a request that arrived `d` seconds earlier is outranked only by
requests more than `d / aging_s` levels more important. Effective priorities of two requests keep
the same difference as time passes (both age alike), so an order once decided never flips back
and forth, and displacement cannot ping-pong.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.core.request import Request
from kvflow.core.sched.policy import SchedulingPolicy, merge_started


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s

    def key(self, req: Request, now: float) -> tuple[float, float]:
        return req.priority - (now - req.arrival_time) / self.aging_s, req.arrival_time

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        return sorted(running, key=lambda r: self.key(r, now))

    def waiting_order(self, waiting: Sequence[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: self.key(r, now))

    def prefill_order(self, partial: Sequence[Request], waiting: Sequence[Request], now: float) -> list[Request]:
        """A more important prompt gets the prefill tokens before a started, less important one."""
        return merge_started(partial, waiting, lambda r: self.key(r, now))

    def may_displace(self, candidate: Request, victim: Request, now: float) -> bool:
        return self.key(candidate, now) < self.key(victim, now)
