"""Step records: a bounded ring of what each engine step computed, and `explain(request_id)`, which
answers "why was this request slow?" from it (GET /debug/requests/{id}).

Each step that computed something leaves one `StepRecord`: when it ran, how long the model pass
took, the cost model's prediction made before it ran, the sequences in it (request id, kind,
tokens, position: plain tuples, no tensors), the requests preempted to make room and those waiting
on a KV transfer. Each request leaves one `_Arrival` (the step count when it arrived). Recording is
a few appends per step; the explanation scans the ring when asked.

Memory: at most `capacity` steps (the oldest go first) and `capacity` requests; a request whose
arrival step has left the ring, or that was forgotten, is "unknown or expired".
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.core.scheduler import SchedulerOutput
    from kvflow.core.step_cost import StepCostModel

# What a sequence computed in a step.
PREFILL = "prefill"  # a chunk of its prompt
RECOMPUTE = "recompute"  # prompt + generated tokens again, after a preemption
DECODE = "decode"  # one token
VERIFY = "verify"  # its last token and draft tokens to verify (speculative decoding)

MAX_LISTED_OTHERS = 8  # other requests named per step in an explanation (the largest first)
MAX_LISTED_STEPS = 64  # steps listed in full per span (the latest ones; the summaries count them all)
MAX_WORST_GAPS = 8  # the slowest inter-token gaps listed


@dataclass(slots=True)
class StepRecord:
    index: int
    time: float  # wall clock (time.time()) when the pass started
    duration_s: float  # the model pass (what the step-cost model predicts)
    predicted_s: float | None  # the cost model's prediction before the step ran (None: not fitted yet)
    # (request id, kind, tokens computed, start position, sampled a token)
    seqs: tuple[tuple[str, str, int, int, bool], ...]
    preempted: tuple[str, ...]
    kv_waiting: tuple[str, ...]  # requests waiting for a KV transfer during this step

    def tokens_by_kind(self) -> dict[str, int]:
        out = {PREFILL: 0, RECOMPUTE: 0, DECODE: 0, VERIFY: 0}
        for _, kind, n, _, _ in self.seqs:
            out[kind] += n
        return out


@dataclass(slots=True)
class _Arrival:
    parent_id: str
    children: tuple[str, ...]
    prompt_tokens: int
    step: int  # the index the next step would get when the request arrived
    time: float  # wall clock


class StepRecords:
    """The ring of steps and the map of recent requests. Used on the engine thread only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.steps: deque[StepRecord] = deque(maxlen=max(capacity, 1))
        self.requests: OrderedDict[str, _Arrival] = OrderedDict()
        self.next_index = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def on_arrival(self, parent_id: str, children: list[str], prompt_tokens: int) -> None:
        if not self.enabled:
            return
        self.requests[parent_id] = _Arrival(parent_id, tuple(children), prompt_tokens, self.next_index, time.time())
        if len(self.requests) > self.capacity:
            self.requests.popitem(last=False)

    def record(
        self,
        sched: SchedulerOutput,
        started: float,
        duration_s: float,
        predicted_s: float | None,
        kv_waiting: tuple[str, ...] = (),
    ) -> None:
        if not self.enabled:
            return
        seqs = []
        for s in sched.seqs:
            n, spec = len(s.token_ids), len(s.spec_token_ids)
            if spec:
                kind = VERIFY
            elif s.start_pos < s.num_prompt_tokens:
                kind = PREFILL
            elif n > 1:
                kind = RECOMPUTE
            else:
                kind = DECODE
            seqs.append((s.request_id, kind, n, s.start_pos, s.sample))
        self.steps.append(
            StepRecord(
                self.next_index, started, duration_s, predicted_s, tuple(seqs), tuple(sched.preempted), kv_waiting
            )
        )
        self.next_index += 1

    @property
    def oldest_index(self) -> int:
        return self.steps[0].index if self.steps else self.next_index

    def explain(self, request_id: str, cost: StepCostModel | None = None, live: set[str] | None = None) -> dict | None:
        """What `request_id` (a user request: its n completions are its sequences) waited through,
        as plain data; None when it is unknown or its first steps have left the ring. `live`: the
        sequence ids still in the scheduler (running or waiting)."""
        arrival = self.requests.get(request_id)
        if arrival is None or arrival.step < self.oldest_index:
            return None
        steps = [r for r in self.steps if r.index >= arrival.step]
        fitted = cost is not None and cost.num_samples >= 8
        live = live or set()
        return {
            "request_id": request_id,
            "arrival_time": arrival.time,
            "arrival_step": arrival.step,
            "prompt_tokens": arrival.prompt_tokens,
            "status": "running" if any(c in live for c in arrival.children) else "finished",
            "cost_model_fitted": fitted,
            "sequences": [
                _explain_seq(child, steps, cost if fitted else None, child in live) for child in arrival.children
            ],
            "ring": {"capacity": self.capacity, "oldest_step": self.oldest_index, "next_step": self.next_index},
        }


def _own_cost(cost: StepCostModel, n: int, start: int) -> float:
    """The predicted time of a step computing only this sequence's tokens."""
    return cost.predict(*cost.features([(start, n)]))


def _step_view(rec: StepRecord, own: tuple | None, cost: StepCostModel | None) -> dict[str, Any]:
    """One step as seen from one sequence: its own work there, the excess, what else ran."""
    total = sum(s[2] for s in rec.seqs)
    own_tokens = 0 if own is None else own[2]
    own_s = None
    if own is not None and cost is not None:
        own_s = _own_cost(cost, own[2], own[3])
    share_s = rec.duration_s * own_tokens / total if total else 0.0
    excess = rec.duration_s - (own_s if own_s is not None else share_s)
    others = sorted((s for s in rec.seqs if own is None or s[0] != own[0]), key=lambda s: -s[2])
    return {
        "step": rec.index,
        "time": rec.time,
        "duration_s": rec.duration_s,
        "predicted_s": rec.predicted_s,
        "tokens": rec.tokens_by_kind(),
        "num_seqs": len(rec.seqs),
        "own": None if own is None else {"kind": own[1], "tokens": own[2], "start_pos": own[3], "sampled": own[4]},
        "own_predicted_s": own_s,
        "own_share_s": share_s,
        "excess_s": max(0.0, excess),
        "others": [{"request_id": s[0], "kind": s[1], "tokens": s[2]} for s in others[:MAX_LISTED_OTHERS]],
        "others_not_listed": max(0, len(others) - MAX_LISTED_OTHERS),
        "preempted": list(rec.preempted),
        "kv_transfer_wait": bool(own is not None and own[0] in rec.kv_waiting),
    }


def _summary(records: list[StepRecord], views: list[dict], child: str) -> dict[str, Any]:
    """Totals over steps, and who else's work filled them (by request and kind, largest first)."""
    by_other: dict[tuple[str, str], list[int]] = {}
    for rec in records:
        for rid, kind, n, _, _ in rec.seqs:
            if rid != child:
                entry = by_other.setdefault((rid, kind), [0, 0])
                entry[0] += n
                entry[1] += 1
    return {
        "steps": len(views),
        "steps_scheduled": sum(v["own"] is not None for v in views),
        "duration_s": sum(v["duration_s"] for v in views),
        "excess_s": sum(v["excess_s"] for v in views),
        "own_tokens": sum(v["own"]["tokens"] for v in views if v["own"] is not None),
        "step_tokens": {k: sum(v["tokens"][k] for v in views) for k in (PREFILL, RECOMPUTE, DECODE, VERIFY)},
        "behind": [
            {"request_id": rid, "kind": kind, "tokens": tokens, "steps": n}
            for (rid, kind), (tokens, n) in sorted(by_other.items(), key=lambda kv: -kv[1][0])[:MAX_LISTED_OTHERS]
        ],
        "preemptions": [v["step"] for v in views if child in v["preempted"]],
        "kv_transfer_wait_steps": sum(v["kv_transfer_wait"] for v in views),
    }


def _explain_seq(child: str, steps: list[StepRecord], cost: StepCostModel | None, live: bool) -> dict[str, Any]:
    mine = {}
    for rec in steps:
        for s in rec.seqs:
            if s[0] == child:
                mine[rec.index] = s
                break
    # The steps it lived through: from its arrival to its last step (to now while it runs).
    last = steps[-1].index if (live or not mine) and steps else max(mine, default=-1)
    lived = [r for r in steps if r.index <= last]
    first_token = next((i for i, s in sorted(mine.items()) if s[4]), None)
    pre = [r for r in lived if first_token is None or r.index <= first_token]
    post = [r for r in lived if first_token is not None and r.index > first_token]
    pre_views = [_step_view(r, mine.get(r.index), cost) for r in pre]
    post_views = [_step_view(r, mine.get(r.index), cost) for r in post]
    # Inter-token gaps: the steps from one token to the next, summed (a preempted or waiting
    # sequence's gap spans several steps).
    gaps: list[dict[str, Any]] = []
    current: list[dict] = []
    for v in post_views:
        current.append(v)
        if v["own"] is not None and v["own"]["sampled"]:
            gaps.append(_gap(current))
            current = []
    worst = sorted(gaps, key=lambda g: -g["duration_s"])[:MAX_WORST_GAPS]
    return {
        "id": child,
        "status": "running" if live else "finished",
        "first_token_step": first_token,
        "before_first_token": {
            **_summary(pre, pre_views, child),
            "step_list": pre_views[-MAX_LISTED_STEPS:],
            "steps_not_listed": max(0, len(pre_views) - MAX_LISTED_STEPS),
        },
        "between_tokens": {
            **_summary(post, post_views, child),
            "gaps": len(gaps),
            "worst_gaps": worst,
        },
    }


def _gap(views: list[dict]) -> dict[str, Any]:
    return {
        "steps": [v["step"] for v in views],
        "duration_s": sum(v["duration_s"] for v in views),
        "excess_s": sum(v["excess_s"] for v in views),
        "step_list": views[-MAX_LISTED_STEPS:],
    }
