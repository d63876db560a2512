"""Scheduling policies: the scheduler asks its policy, every step, in what order to serve running
requests (the last is preempted first), in what order to admit waiting ones, which prompts get the
step's prefill tokens (started ones or new ones), whether a waiting request may displace a running
one, how many tokens the step may compute, and whether a new request is admitted at all. The scheduler keeps the mechanics (blocks, chunks, preemption); a
policy only orders and sizes. No tensors, no wall clock: `now` is passed in, so every policy runs
under a fake clock in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.core.request import Request


class AdmissionRejected(Exception):
    """A request the policy refuses at arrival (the server answers 503 with Retry-After)."""

    def __init__(self, message: str, reason: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass
class QueueView:
    """What a policy may look at besides the request at hand."""

    running: Sequence[Request]
    waiting: Sequence[Request]
    max_num_batched_tokens: int


class SchedulingPolicy:
    """First come, first served: the base every policy refines."""

    name = "fcfs"

    def running_order(self, running: list[Request], now: float) -> list[Request]:
        """Served in this order; under memory pressure the last ones are preempted first."""
        return running

    def waiting_order(self, waiting: Sequence[Request], now: float) -> list[Request]:
        return list(waiting)

    def prefill_order(self, partial: Sequence[Request], waiting: Sequence[Request], now: float) -> list[Request]:
        """Who gets the step's prefill tokens (after the decodes): running requests part-way
        through their prompt (in running order) and waiting ones (in admission order). Here the
        running ones first, so a started prompt finishes before the next begins."""
        return [*partial, *waiting]

    def may_displace(self, candidate: Request, victim: Request, now: float) -> bool:
        """Whether a waiting request may preempt a running one to take its place."""
        return False

    def token_budget(self, view: QueueView, now: float) -> int:
        return view.max_num_batched_tokens

    def check_admission(self, req: Request, view: QueueView, now: float) -> None:
        """Raise AdmissionRejected to refuse `req` at arrival."""


def merge_started(
    partial: Sequence[Request], waiting: Sequence[Request], key: Callable[[Request], Any]
) -> list[Request]:
    """Started prompts (sorted by `key`) merged into the admission order by the same key, the
    admission order itself kept (fairness may have interleaved it by client). Each key is
    computed once."""
    started = sorted(((key(r), r) for r in partial), key=lambda kr: kr[0])
    out, i = [], 0
    for w in waiting:
        k = key(w)
        while i < len(started) and started[i][0] <= k:
            out.append(started[i][1])
            i += 1
        out.append(w)
    return out + [r for _, r in started[i:]]
