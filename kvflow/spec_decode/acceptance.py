"""How likely each draft is to be accepted: what the speculator's plan weighs against a draft's cost.

A draft at depth j (1-based) is accepted only if every draft before it was. The model keeps two
rates: the first draft's, and each further draft's given the one before it (the continuation), so
the expected gain of depth j is first x continuation^(j - 1). Measured on prompt lookup, the two
differ: once a copied span starts it tends to go on (continuations high at every depth, rising with
it), while whether a lookup's first guess is right depends mostly on how long the n-gram it matched
was (a 4-gram's far more often than a 2-gram's; figures: docs/benchmarks/results/). One rate for all
depths (first = continuation) over-drafts after short matches and under-drafts inside a copied
span.

So the first rate comes from the proposer's evidence where it gives one (prompt lookup: the
matched length; the rate over all requests' first drafts with that evidence), else from the
request's own history; the continuation is the request's own. Each is a moving average, and a new
request starts from the averages over all requests. No tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_PRIOR = 0.5  # any first draft's rate before anything was verified
CONTINUATION_PRIOR = 0.8  # given an accepted draft, the next one's (measured higher, see above)
REQUEST_WEIGHT = 0.2  # weight of a verification in a request's own first-draft average
EVIDENCE_WEIGHT = 0.2  # ... in the average over all first drafts with the same evidence (recent ones:
# a workload whose long matches stop predicting turns it down within a few steps)
CONTINUATION_WEIGHT = 0.3  # of each verified later depth in a request's continuation average
GLOBAL_WEIGHT = 0.02  # of each verified depth in the averages over all requests (new requests' start)


def depth_gain(first: float, continuation: float, depth: int) -> float:
    """The chance that the draft at `depth` (1-based) and every one before it are accepted."""
    return first * continuation ** (depth - 1)


@dataclass
class AcceptanceModel:
    first_by_request: dict[str, float] = field(default_factory=dict)
    first_by_evidence: dict[int, float] = field(default_factory=dict)
    continuation: dict[str, float] = field(default_factory=dict)
    first_all: float = FIRST_PRIOR
    continuation_all: float = CONTINUATION_PRIOR

    def first(self, request_id: str, evidence: int | None = None) -> float:
        """The chance that the request's first draft is accepted, given the proposer's `evidence`
        (None: none, the request's own rate)."""
        if evidence is None:
            return self.first_by_request.get(request_id, self.first_all)
        return self.first_by_evidence.get(evidence, self.first_all)

    def rates(self, request_id: str, evidence: int | None) -> tuple[float, float]:
        """(first, continuation): the request's first draft's rate given `evidence`, and each later
        draft's given the one before it."""
        return self.first(request_id, evidence), self.continuation.get(request_id, self.continuation_all)

    def gain(self, request_id: str, evidence: int | None, depth: int) -> float:
        """Expected tokens a draft at `depth` (1-based) adds: the chance it and all before it are accepted."""
        return depth_gain(*self.rates(request_id, evidence), depth)

    def observe(self, request_id: str, evidence: int | None, proposed: int, accepted: int) -> None:
        """A verification of `proposed` drafts of which the first `accepted` were accepted."""
        hit = 1.0 if accepted else 0.0
        own = self.first_by_request.get(request_id, self.first_all)
        self.first_by_request[request_id] = own + REQUEST_WEIGHT * (hit - own)
        if evidence is not None:
            rate = self.first_by_evidence.get(evidence, self.first_all)
            self.first_by_evidence[evidence] = rate + EVIDENCE_WEIGHT * (hit - rate)
        self.first_all += GLOBAL_WEIGHT * (hit - self.first_all)
        cont = self.continuation.get(request_id, self.continuation_all)
        for depth in range(1, min(proposed, accepted + 1)):  # later depths tested: accepted ones, then one miss
            hit = 1.0 if depth < accepted else 0.0
            cont += CONTINUATION_WEIGHT * (hit - cont)
            self.continuation_all += GLOBAL_WEIGHT * (hit - self.continuation_all)
        self.continuation[request_id] = cont

    def release(self, request_id: str) -> None:
        self.first_by_request.pop(request_id, None)
        self.continuation.pop(request_id, None)
