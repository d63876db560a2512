"""What the speculator asks of a proposer (prompt lookup, a draft model): drafts for a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvflow.core.request import Request
    from kvflow.core.scheduler import SchedulerOutput
    from kvflow.core.step_cost import StepCostModel


@dataclass(frozen=True, slots=True)
class Drafts:
    """A request's draft tokens and what predicts whether the first is accepted (`evidence`: for
    prompt lookup the length of the n-gram it matched; None where the proposer has nothing beyond
    the request's own history: kvflow.spec_decode.acceptance)."""

    tokens: list[int]
    evidence: int | None = None


class Proposer(Protocol):
    """Drafts for a batch: `plan` says how many each request may get (0: none). `cost`: what one
    more draft depth costs (a model's passes), or None when proposing is free (prompt lookup)."""

    cost: StepCostModel | None

    def propose(self, requests: list[Request], plan: dict[str, int]) -> dict[str, Drafts]: ...
    def observe(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None: ...
    def release(self, request_ids) -> None: ...
