"""Scheduling policies (fcfs, priority, slo) and fairness across clients (VTC)."""

from __future__ import annotations

from kvflow.config import SCHEDULING_POLICIES
from kvflow.core.sched.fairness import VirtualTokenCounter
from kvflow.core.sched.policy import AdmissionRejected, SchedulingPolicy
from kvflow.core.step_cost import StepCostModel

__all__ = [
    "AdmissionRejected",
    "SchedulingPolicy",
    "VirtualTokenCounter",
    "make_policy",
]


def make_policy(
    name: str, cost: StepCostModel, max_num_batched_tokens: int, aging_s: float, admission_factor: float | None
) -> SchedulingPolicy:
    if name == "priority":
        from kvflow.core.sched.priority import PriorityPolicy

        return PriorityPolicy(aging_s)
    if name == "slo":
        from kvflow.core.sched.slo import SLOPolicy

        return SLOPolicy(cost, max_num_batched_tokens, admission_factor)
    if name != "fcfs":
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}")
    return SchedulingPolicy()
