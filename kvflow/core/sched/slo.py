"""`slo`: serve for goodput, the requests that meet their TTFT and TPOT SLOs per second.

Every prediction comes from the engine's `StepCostModel` (fitted online from measured step times:
tokens, multi-token chunks, attention context):

- Step size from slack (Sarathi-Serve's budget, sized each step as in Niyama): the decoding
  requests' tightest next-token deadline (first token + tokens so far x TPOT SLO, since TPOT is an
  average) leaves `slack`; the prefill chunk
  is the largest the cost model says fits in it, so a step is big while decodes have room and small
  when a TPOT deadline is near (never below `min_chunk`, so prefill still progresses).
- Admission order: earliest TTFT deadline plus the request's own predicted prefill time (a hybrid
  of EDF and shortest-remaining-prompt-first: among equal deadlines the short prompt goes first).
- Relegation: a waiting request that cannot make its TTFT any more (deadline - now < its own
  prefill time) drops behind those that still can; it still runs, in arrival order, and once it
  has waited `promote_after` times its TTFT SLO it goes first, so nothing starves.
- Admission control (Mooncake's early rejection): a new request whose predicted TTFT (the prefill
  work queued ahead of it, plus its own) exceeds `admission_factor` x its TTFT SLO is refused with
  the predicted drain time as Retry-After, instead of queueing work that is already late.

Requests without SLOs have infinite deadlines: they go after every request with one. Until the
cost model has seen `min_samples` steps it predicts nothing: the budget is the full one, the order
plain EDF, and every request is admitted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvflow.core.request import Request
from kvflow.core.sched.policy import AdmissionRejected, QueueView, SchedulingPolicy
from kvflow.core.step_cost import StepCostModel


class SLOPolicy(SchedulingPolicy):
    name = "slo"

    def __init__(self, cost: StepCostModel, max_num_batched_tokens: int, admission_factor: float | None = 2.0,
                 min_chunk: int = 32, promote_after: float = 2.0, min_samples: int = 8) -> None:
        self.cost = cost
        self.min_samples = min_samples
        self.max_tokens = max_num_batched_tokens
        self.admission_factor = admission_factor
        self.min_chunk = min_chunk
        self.promote_after = promote_after

    # ---- predictions ---------------------------------------------------------------------------
    @property
    def predicts(self) -> bool:
        return len(self.cost.samples) >= self.min_samples

    def step_time(self, decode_rows: int, prefill_tokens: int, context: int) -> float:
        chunks = 1 if prefill_tokens > 0 else 0
        return self.cost.predict(decode_rows + prefill_tokens, chunks, context + prefill_tokens)

    def prefill_time(self, tokens: int, view: QueueView) -> float:
        """Seconds to prefill `tokens` in full chunks beside today's decodes."""
        if not self.predicts:
            return 0.0
        decodes = _decoding(view.running)
        chunk = max(self.max_tokens - len(decodes), 1)
        context = sum(r.num_tokens for r in view.running)
        return math.ceil(tokens / chunk) * self.step_time(len(decodes), min(chunk, tokens), context) if tokens else 0.0

    # ---- the policy ------------------------------------------------------------------------------
    def token_budget(self, view: QueueView, now: float) -> int:
        decodes = _decoding(view.running)
        # TPOT is an average ((last - first) / (tokens - 1)), so the next token of a request with n
        # tokens is due by first + n x SLO: steps that ran fast bank slack for a big chunk later.
        deadlines = [r.first_token_time + r.num_output_tokens * r.tpot_slo for r in decodes
                     if r.tpot_slo is not None and r.first_token_time is not None]
        if not deadlines or not self.predicts:
            return view.max_num_batched_tokens
        slack = min(deadlines) - now
        context = sum(r.num_tokens for r in view.running)
        base = self.step_time(len(decodes), 1, context)  # a step with a (one-token) prefill chunk
        per_token = self.step_time(len(decodes), 2, context) - base
        room = int((slack - base) / per_token) if per_token > 0 else view.max_num_batched_tokens
        return len(decodes) + max(self.min_chunk, min(room, view.max_num_batched_tokens - len(decodes)))

    def waiting_order(self, waiting: Sequence[Request], now: float) -> list[Request]:
        view = QueueView((), waiting, self.max_tokens)
        promoted, ranked, relegated = [], [], []
        for r in waiting:
            if r.ttft_slo is None:
                ranked.append((math.inf, r.arrival_time, r))
                continue
            deadline = r.arrival_time + r.ttft_slo
            own = self.prefill_time(r.num_tokens - r.num_computed_tokens, view)
            if now - r.arrival_time > self.promote_after * r.ttft_slo:
                promoted.append(r)
            elif deadline - now >= own:
                ranked.append((deadline + own, r.arrival_time, r))
            else:
                relegated.append(r)
        ranked.sort(key=lambda x: x[:2])
        by_arrival = lambda r: r.arrival_time  # noqa: E731
        return sorted(promoted, key=by_arrival) + [r for *_, r in ranked] + sorted(relegated, key=by_arrival)

    def check_admission(self, req: Request, view: QueueView, now: float) -> None:
        if self.admission_factor is None or req.ttft_slo is None or not self.predicts:
            return
        deadline = req.arrival_time + req.ttft_slo
        ahead = sum(r.num_tokens - r.num_computed_tokens for r in view.waiting
                    if r.ttft_slo is None or r.arrival_time + r.ttft_slo <= deadline)
        ahead += sum(r.num_tokens - r.num_computed_tokens for r in view.running
                     if r.num_computed_tokens < len(r.prompt_token_ids))
        own = req.num_tokens
        predicted = self.prefill_time(ahead + own, view)
        if predicted > self.admission_factor * req.ttft_slo:
            drain = max(predicted - self.prefill_time(own, view), 0.0)
            raise AdmissionRejected(
                f"the server cannot meet this request's TTFT SLO ({1000 * req.ttft_slo:.0f} ms): its predicted "
                f"TTFT is {1000 * predicted:.0f} ms (> {self.admission_factor:g}x the SLO); retry later",
                reason="slo", retry_after_s=drain)


def _decoding(running: Sequence[Request]) -> list[Request]:
    return [r for r in running if r.num_computed_tokens >= len(r.prompt_token_ids)]
