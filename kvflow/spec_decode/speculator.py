"""Speculation policy: which requests get draft tokens this step, and how many.

Before each step the engine asks the speculator to propose drafts for the running requests that
are decoding; the scheduler then schedules them as extra tokens of those requests (inside the
step's token budget) and the runner verifies them. After the step the speculator learns from
what was accepted and how long the step took.

How many drafts (the goodput rule of SmartSpec, arXiv 2406.14066): a draft at depth j adds the
chance that it and every draft before it are accepted (`AcceptanceModel`: the first draft's rate,
for prompt lookup that of first drafts after an n-gram match of the same length, times the
request's continuation rate to the power j - 1). The step's time comes from `StepCostModel` (a + b *
tokens + c * multi-token sequences + m if there are any; none counted where the step still rides the
model's one-call decode pass: a draft there is one more row, and one that opens a tile of the
kernels' rows a pass over the weights, t). Drafts are handed out highest expected gain first, while
a draft's gain per second it costs (its gain / what it adds to the predicted step: b, t where it
opens a tile, and where it makes its request a chunk off the decode pass, c and maybe m) beats the
step's tokens per second without it (E / T); where tiles are modelled, the drafts that would share
a tile are judged together (the run of them that leaves the most tokens per second): at batch 1 a pass costs about the same for
1 or 5 tokens, so drafts are almost free; at a large batch E / T approaches 1 / b and no draft (gain
< 1) can beat it, so speculation switches itself off; so does a request whose drafts keep failing
(gain below `_MIN_GAIN`). `adaptive: false` always proposes `num_speculative_tokens`.

Prompt lookup costs next to nothing to ask, so every decoding request is looked up first and
the plan is made over the drafts found and their match lengths (a request without a match takes no
share of the step). Once a plan declines every draft it could give, speculation is off: the plan
(and lookups) run again only every `_PROBE_EVERY` steps, so the steps in between cost the
speculator nothing; with prompt lookup each such check gives one request in turn a single probing
draft, so the estimates can learn when drafts start to pay again.

Who never speculates: requests still prefilling, with penalties (their distribution at a draft
position would depend on the drafts before it), before `min_tokens`, or one token short of
`max_tokens`. No tensors here.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

from kvflow.config import SpeculativeConfig
from kvflow.core.request import Request
from kvflow.core.scheduler import SchedulerOutput
from kvflow.core.step_cost import StepCostModel, chunk_pairs
from kvflow.spec_decode.acceptance import AcceptanceModel, depth_gain
from kvflow.spec_decode.ngram_proposer import NgramBatchProposer, NgramProposer
from kvflow.spec_decode.proposer import Drafts, Proposer

# A draft expected to add less than this is not proposed, however cheap the cost model says a token
# is (the fit is noisy, and a proposal is not free). A request that drops below it stops speculating.
_MIN_GAIN = 0.02
_PROBE_EVERY = 8  # while speculation is off: one check (with a probing draft) every this many steps


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # (request, step) pairs that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at depth j + 1

    def snapshot(self) -> SpecDecodeStats:
        return dataclasses.replace(self, accepted_per_pos=list(self.accepted_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step emits per request on average (accepted drafts + 1)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class _StepShape:
    """The next step as the cost model sees it (rows, chunks, contexts, chunk pairs), from the running
    requests' remaining tokens; drafts are added one at a time (`add_draft`)."""

    def __init__(self, cost: StepCostModel, running: list[Request]) -> None:
        self.predict = cost.shape_predictor()
        self.new = {r.request_id: max(1, r.num_tokens - r.num_computed_tokens) for r in running}
        self.start = {r.request_id: r.num_computed_tokens for r in running}
        self.shape = (
            sum(self.new.values()),  # rows
            max(self.new.values(), default=0),  # the longest sequence's new tokens
            sum(1 for n in self.new.values() if n > 1),  # multi-token sequences
            sum(self.start[rid] + n for rid, n in self.new.items()),  # context
            sum(chunk_pairs(self.start[rid], n) for rid, n in self.new.items() if n > 1),  # chunk pairs
        )

    def seconds(self, shape: tuple[int, int, int, int, int] | None = None) -> float:
        return self.predict(*(shape or self.shape))

    def with_draft(self, rid: str) -> tuple[int, int, int, int, int]:
        """The shape with one more draft for `rid`."""
        rows, longest, multi, context, pairs = self.shape
        n, start = self.new[rid], self.start[rid]
        pairs += chunk_pairs(start, n + 1) - (chunk_pairs(start, n) if n > 1 else 0)
        return rows + 1, max(longest, n + 1), multi + (n == 1), context + 1, pairs

    def add_draft(self, rid: str, shape: tuple[int, int, int, int, int]) -> None:
        self.new[rid] += 1
        self.shape = shape


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer | None = None, cost: StepCostModel | None = None
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        if proposer is None:
            proposer = NgramBatchProposer(NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k))
        self.proposer = proposer
        self.cost = cost or StepCostModel()  # of a target step
        self.acceptance = AcceptanceModel()
        self._evidence: dict[str, int | None] = {}  # each request's drafts in flight: their evidence
        self._steps_off = 0  # steps since a plan declined every draft it could give (0: speculating)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)

    # ---- before a step ----------------------------------------------------------------------------
    def propose(self, running: list[Request]) -> None:
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        limits = {r.request_id: self._limit(r) for r in decoding}
        drafts: dict[str, Drafts] | None = None
        if not self.config.adaptive:
            plan = limits
        elif self._steps_off % _PROBE_EVERY:  # off: nothing until the next check
            self._steps_off += 1
            plan, drafts = {}, {}
        elif self.proposer.cost is not None:  # a draft model: drafts only for the plan (each costs a pass)
            plan = self._plan(running, limits)
            self._check(plan, limits)
        else:
            # Prompt lookup is free to ask: look every request up, then plan over what was found and
            # how long a match found it, so a request with no match in its text takes no share of
            # the step from those that have one.
            drafts = self.proposer.propose(decoding, limits)
            limits = {rid: len(drafts[rid].tokens) if rid in drafts else 0 for rid in limits}
            plan = self._plan(running, limits, {rid: d.evidence for rid, d in drafts.items()})
            self._check(plan, limits)
        if drafts is None:
            drafts = self.proposer.propose(decoding, plan)
        for r in decoding:
            d = drafts.get(r.request_id)
            r.spec_token_ids = d.tokens[: plan.get(r.request_id, 0)] if d is not None else []
            if r.spec_token_ids:
                self._evidence[r.request_id] = d.evidence

    def _limit(self, r: Request) -> int:
        p = r.params
        if p.has_penalties or r.num_output_tokens < p.min_tokens:
            return 0
        return max(0, min(self.k, r.max_tokens - r.num_output_tokens - 1))

    def _plan(
        self, running: list[Request], limits: dict[str, int], evidence: dict[str, int | None] | None = None
    ) -> dict[str, int]:
        """Drafts per request (at most `limits`), given what predicts each one's first draft
        (`evidence`, AcceptanceModel.first; absent: the request's own history)."""
        # What a draft costs is what it adds to the predicted step: one more row, and where it makes
        # its request a multi-token sequence off the decode pass, the chunk (c, and m for the
        # step's first). A draft model adds a pass per draft depth (a_d, paid by the first draft at
        # that depth) and a row in it (b_d); prompt lookup costs nothing measurable.
        draft_cost = self.proposer.cost
        a_d, b_d = draft_cost.coefficients[:2] if draft_cost is not None and draft_cost.num_samples else (0.0, 0.0)
        step = _StepShape(self.cost, running)
        target = seconds = step.seconds()  # the target pass alone; seconds: with the draft passes
        expected = float(len(running))  # every running request emits about one token per step
        gamma = dict.fromkeys(limits, 0)
        depth = 0  # deepest draft handed out so far
        evidence = evidence or {}
        rates = {rid: self.acceptance.rates(rid, evidence.get(rid)) for rid, lim in limits.items() if lim > 0}
        heap = [(-first, rid) for rid, (first, _) in rates.items()]
        heapq.heapify(heap)
        tile = self.cost.decode_pass.tile_rows
        while heap:
            # The best drafts up to the end of the tile of rows the next one falls in (one draft
            # where the cost model has no tiles), then the run of them that leaves the most tokens
            # per second, if it beats the step without them: a draft that opens a tile costs a pass
            # over the weights, those that fill it a row each, so a first draft is judged with the
            # ones that would share its tile. (With no tiles: while gain / cost > E / T.)
            span = tile - step.shape[0] % tile if tile > 0 else 1
            tried = []  # the state before each draft taken: (rid, shape, target, depth, expected, seconds)
            best, best_rate = 0, expected / seconds
            while heap and len(tried) < span:
                neg_gain, rid = heapq.heappop(heap)
                gain = -neg_gain
                if gain < _MIN_GAIN:
                    break
                trial = step.with_draft(rid)
                after = step.seconds(trial)
                cost = after - target + b_d + (a_d if gamma[rid] + 1 > depth else 0.0)
                tried.append((rid, step.shape, target, depth, expected, seconds))
                step.add_draft(rid, trial)
                target = after
                gamma[rid] += 1
                depth = max(depth, gamma[rid])
                expected += gain
                seconds += cost
                if gamma[rid] < limits[rid]:
                    heapq.heappush(heap, (-depth_gain(*rates[rid], gamma[rid] + 1), rid))
                if expected / seconds > best_rate:
                    best, best_rate = len(tried), expected / seconds
            if best < len(tried):  # the drafts after the best run lower the goodput: take them back, stop
                for rid, *_ in tried[best:]:
                    gamma[rid] -= 1
                    step.new[rid] -= 1
                _, step.shape, target, depth, expected, seconds = tried[best]
                break
            if len(tried) < span:
                break
        return gamma

    def _check(self, plan: dict[str, int], limits: dict[str, int]) -> None:
        """After a plan: if it declined every draft it could give, speculation is off, and is
        checked again (lookups and plan) only every `_PROBE_EVERY` steps; with prompt lookup each
        check gives one request (in turn) a single probing draft: without trials the acceptance
        estimates could never learn that drafts pay again. (A draft model would first have to
        catch up on the request's whole sequence: a probe would cost a prefill, so it does not
        probe; its checks follow the step-time model.)"""
        if any(plan.values()):
            self._steps_off = 0
            return
        eligible = sorted(rid for rid, lim in limits.items() if lim > 0)
        if eligible and self._steps_off and self.proposer.cost is None:
            plan[eligible[(self._steps_off // _PROBE_EVERY) % len(eligible)]] = 1
        if eligible or self._steps_off:  # (declined drafts turn it off; nothing to draft at all does not)
            self._steps_off += 1

    # ---- after a step -----------------------------------------------------------------------------
    def observe(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """After a step (its time went into the engine's StepCostModel, `cost`)."""
        self.proposer.observe(sched, sampled)
        for seq in sched.seqs:
            k = len(seq.spec_token_ids)
            tokens = sampled.get(seq.request_id)
            if not k or tokens is None:
                continue
            accepted = len(tokens) - 1
            st = self.stats
            st.num_drafts += 1
            st.num_draft_tokens += k
            st.num_accepted_tokens += accepted
            for j in range(accepted):
                st.accepted_per_pos[j] += 1
            self.acceptance.observe(seq.request_id, self._evidence.pop(seq.request_id, None), k, accepted)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.acceptance.release(rid)
            self._evidence.pop(rid, None)
        self.proposer.release(request_ids)
