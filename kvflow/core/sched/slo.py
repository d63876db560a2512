"""`slo`: serve for goodput, the requests that meet their TTFT and TPOT SLOs per second.

Every prediction comes from the engine's `StepCostModel` (fitted online from measured step times:
tokens, multi-token chunks, the decode rows' contexts and the chunks' query-key pairs):

- Prefill order, over started prompts and waiting ones alike: earliest TTFT deadline plus the
  request's own predicted prefill time (a hybrid of EDF and shortest-remaining-prompt-first:
  among equal deadlines the short prompt goes first). A long prompt part-way through its chunks
  yields the next step's prefill tokens to an interactive request that arrived behind it.
- Step size from slack (Sarathi-Serve's budget, sized each step as in Niyama): the step may last
  as long as the tightest of
  - the decoding requests' next-token deadline (first token + tokens so far x TPOT SLO, since
    TPOT is an average: fast steps bank slack for a big chunk later), and
  - the arrival reserve: `arrival_share` x the tightest TTFT SLO seen in the last
    `slo_memory_s`, because a request arriving just after a step starts waits for all of it;
  the prefill chunk is the largest the cost model says fits; the most urgent prompt goes whole
  when that makes its TTFT and the step stays within twice the reserve (a split prompt's first
  token comes a whole step later). A chunk under `min_chunk` is not worth its step: with decodes
  running, the step stays decode-only instead (decode-only steps run the fused native pass and
  bank slack for a real chunk a step or two later), unless the most urgent prompt's TTFT deadline
  is closer than twice its own prefill time, which then gets `min_chunk`.
- Relegation: a request that cannot make its TTFT any more (deadline - now < its own prefill
  time) drops behind those that still can; it still runs, in arrival order, and once it has
  waited `promote_after` times its TTFT SLO it goes first, so nothing starves.
- Admission control (Mooncake's early rejection): a new request whose predicted TTFT (the prefill
  work ordered ahead of it, plus its own) exceeds `admission_factor` x its TTFT SLO is refused
  with the predicted drain time as Retry-After, instead of queueing work that is already late.

Requests without SLOs have infinite deadlines: they go after every request with one. Until the
cost model has seen `min_samples` steps it predicts nothing: the budget is the full one, the order
plain EDF, and every request is admitted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvflow.core.request import Request
from kvflow.core.sched.policy import AdmissionRejected, QueueView, SchedulingPolicy, merge_started
from kvflow.core.step_cost import StepCostModel, chunk_pairs

PROMOTED, RANKED, RELEGATED = 0, 1, 2


class SLOPolicy(SchedulingPolicy):
    name = "slo"

    def __init__(
        self,
        cost: StepCostModel,
        max_num_batched_tokens: int,
        admission_factor: float | None = 2.0,
        min_chunk: int = 32,
        promote_after: float = 2.0,
        min_samples: int = 8,
        arrival_share: float = 0.4,
        slo_memory_s: float = 60.0,
    ) -> None:
        self.cost = cost
        self.min_samples = min_samples
        self.max_tokens = max_num_batched_tokens
        self.admission_factor = admission_factor
        self.min_chunk = min_chunk
        self.promote_after = promote_after
        self.arrival_share = arrival_share
        self.slo_memory_s = slo_memory_s
        self._ttft_seen: dict[float, float] = {}  # TTFT SLO -> when a request with it was last seen
        # The running decodes and chunk size of the last budget: what waiting requests' prefill
        # times are predicted against.
        self._decodes: Sequence[Request] = ()
        self._chunk = max_num_batched_tokens

    # ---- predictions ---------------------------------------------------------------------------
    @property
    def predicts(self) -> bool:
        return self.cost.num_samples >= self.min_samples

    def step_time(self, decodes: Sequence[Request], chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of a step computing these decode rows and prefill chunks (start, tokens)."""
        return self.cost.predict(*self.cost.features([(r.num_tokens - 1, 1) for r in decodes] + list(chunks)))

    def prefill_time(self, req: Request, decodes: Sequence[Request] | None = None, chunk: int | None = None) -> float:
        """Seconds to compute req's remaining prompt in chunks of `chunk` tokens beside `decodes`
        (default: those of the last step's budget)."""
        rest = req.num_tokens - req.num_computed_tokens
        if not self.predicts or rest <= 0:
            return 0.0
        decodes = self._decodes if decodes is None else decodes
        steps = math.ceil(rest / max(chunk or self._chunk, 1))
        # The model is linear: `steps` steps of the average chunk add up to the chunked prefill
        # (the pairs of a prompt do not depend on how it is cut).
        avg = rest / steps
        start = req.num_computed_tokens + (rest - avg) / 2
        pairs = chunk_pairs(req.num_computed_tokens, rest) / steps
        context = sum(r.num_tokens for r in decodes) + start + avg
        return steps * self.cost.predict(len(decodes) + avg, 1, context, pairs)

    def largest_chunk(self, decodes: Sequence[Request], candidates: Sequence[Request], seconds: float, cap: int) -> int:
        """The most prefill tokens (at most `cap`, handed to `candidates` in order) whose step
        the cost model says lasts at most `seconds`; the cost grows with tokens: bisection."""

        def fits(n: int) -> bool:
            return self.step_time(decodes, _hand_out(candidates, n)) <= seconds

        if fits(cap):
            return cap
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # ---- ranking -------------------------------------------------------------------------------
    def rank(self, req: Request, now: float) -> tuple[int, float, float]:
        """(group, key, arrival): promoted first, then ranked by deadline + own prefill time, then
        relegated, each by arrival where the key ties."""
        if req.ttft_slo is None:
            return RANKED, math.inf, req.arrival_time
        if now - req.arrival_time > self.promote_after * req.ttft_slo:
            return PROMOTED, req.arrival_time, req.arrival_time
        deadline = req.arrival_time + req.ttft_slo
        own = self.prefill_time(req, chunk=self.max_tokens)  # at best: the budget can grow for it
        if deadline - now < own:
            return RELEGATED, req.arrival_time, req.arrival_time
        return RANKED, deadline + own, req.arrival_time

    def waiting_order(self, waiting: Sequence[Request], now: float) -> list[Request]:
        return sorted(waiting, key=lambda r: self.rank(r, now))

    def prefill_order(self, partial: Sequence[Request], waiting: Sequence[Request], now: float) -> list[Request]:
        return merge_started(partial, waiting, lambda r: self.rank(r, now))

    # ---- the step budget -----------------------------------------------------------------------
    def _remember(self, reqs: Sequence[Request], now: float) -> None:
        for r in reqs:
            if r.ttft_slo is not None:
                self._ttft_seen[r.ttft_slo] = now
        for slo, seen in list(self._ttft_seen.items()):
            if now - seen > self.slo_memory_s:
                del self._ttft_seen[slo]

    def token_budget(self, view: QueueView, now: float) -> int:
        self._remember([*view.running, *view.waiting], now)
        decodes = [r for r in view.running if not r.prefilling]
        cap = view.max_num_batched_tokens - len(decodes)
        self._decodes = decodes
        # TPOT is an average ((last - first) / (tokens - 1)), so the next token of a request with n
        # tokens is due by first + n x SLO.
        due = [
            r.first_token_time + r.num_output_tokens * r.tpot_slo - now
            for r in decodes
            if r.tpot_slo is not None and r.first_token_time is not None
        ]
        reserve = self.arrival_share * min(self._ttft_seen) if self._ttft_seen else None
        limits = [*([min(due)] if due else []), *([reserve] if reserve is not None else [])]
        if not limits or not self.predicts or cap <= 0:
            self._chunk = max(cap, 1)
            return view.max_num_batched_tokens
        candidates = self.prefill_order(
            [r for r in view.running if r.prefilling], self.waiting_order(view.waiting, now), now
        )
        n = self.largest_chunk(decodes, candidates, min(limits), cap)
        if candidates and candidates[0].ttft_slo is not None:
            # The most urgent prompt whole when that makes its TTFT and the step stays within
            # twice the reserve: a decode's TPOT is an average (one longer step is made up), but
            # a split prompt's first token comes a whole step later.
            urgent = candidates[0]
            rest = urgent.num_tokens - urgent.num_computed_tokens
            whole = self.step_time(decodes, [(urgent.num_computed_tokens, rest)])
            if (
                n < rest <= cap
                and now + whole <= urgent.arrival_time + urgent.ttft_slo
                and (reserve is None or whole <= 2 * reserve)
            ):
                n = rest
        if n < self.min_chunk:
            n = self.min_chunk if not decodes or self._must_progress(candidates, now) else 0
        n = min(n, cap)
        self._chunk = max(n, self.min_chunk)  # (prefill times are predicted in chunks of at least this)
        return len(decodes) + n

    def _must_progress(self, candidates: Sequence[Request], now: float) -> bool:
        """Whether the first prompt in the prefill order needs tokens this step: its TTFT deadline
        is closer than twice its own predicted prefill time."""
        if not candidates or candidates[0].ttft_slo is None:
            return False
        first = candidates[0]
        left = first.arrival_time + first.ttft_slo - now
        return left < 2 * self.prefill_time(first, chunk=self.max_tokens)

    # ---- admission -----------------------------------------------------------------------------
    def check_admission(self, req: Request, view: QueueView, now: float) -> None:
        self._remember([req], now)
        if self.admission_factor is None or req.ttft_slo is None or not self.predicts:
            return
        mine = self.rank(req, now)
        ahead = [
            r
            for r in (*view.waiting, *(r for r in view.running if r.prefilling))
            if r.ttft_slo is not None and self.rank(r, now) <= mine
        ]
        queued = sum(self.prefill_time(r) for r in ahead)
        predicted = queued + self.prefill_time(req)
        if predicted > self.admission_factor * req.ttft_slo:
            raise AdmissionRejected(
                f"the server cannot meet this request's TTFT SLO ({1000 * req.ttft_slo:.0f} ms): its predicted "
                f"TTFT is {1000 * predicted:.0f} ms (> {self.admission_factor:g}x the SLO); retry later",
                reason="slo",
                retry_after_s=queued,
            )


def _hand_out(candidates: Sequence[Request], tokens: int) -> list[tuple[int, int]]:
    """`tokens` prefill tokens given to the candidates in order: (start, tokens) per chunk."""
    chunks = []
    for r in candidates:
        if tokens <= 0:
            break
        n = min(r.num_tokens - r.num_computed_tokens, tokens)
        chunks.append((r.num_computed_tokens, n))
        tokens -= n
    return chunks
