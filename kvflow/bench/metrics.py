"""Latency and throughput metrics of a benchmark run, computed from per-request timestamps.

Definitions (MLPerf Inference wording; see shared/seed-facts.md):

- **TTFT** (time to first token): first content chunk received − request sent.
- **ITL** (inter-token latency): the list of gaps between consecutive *content chunks* of one
  request, **excluding TTFT** (GenAI-Perf convention; LLMPerf includes the TTFT as the first gap,
  we do not). A streaming server may pack several tokens into one chunk; ITL then measures the
  chunk gaps as the client saw them.
- **TPOT** (time per output token): (E2EL − TTFT) / (output_tokens − 1). Undefined when a
  request produced 0 or 1 tokens; such requests are left out of the TPOT statistics.
- **E2EL** (end-to-end latency): last byte received − request sent.

All timestamps of a record come from one clock (the client uses `time.perf_counter`; the offline
benchmark uses the engine's `time.monotonic`). Latencies are in seconds; summaries convert to
milliseconds where the field name says `_ms`.

"Sent" is `send_time`: when the client actually issued the HTTP request, after waiting for the
`--max-concurrency` semaphore. `arrival_time` is when the arrival process scheduled the request;
`send_time − arrival_time` is client-side queueing, reported separately as `queue_delay`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """Everything measured about one request. Times in seconds on one clock; None = never happened."""

    request_id: int | str = 0
    prompt_len: int = 0  # prompt tokens (server's usage.prompt_tokens when it reports it)
    expected_output_len: int = 0  # what the workload asked for (max_tokens)
    arrival_time: float = 0.0  # when the arrival process released the request
    send_time: float | None = None  # when the request was actually sent
    first_token_time: float | None = None  # first non-empty content chunk
    chunk_times: list[float] = field(default_factory=list)  # every content chunk, the first included
    end_time: float | None = None  # end of the response (stream closed / [DONE])
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    generated_text: str = ""
    rate: float | None = None  # request rate of the run this record belongs to (sweeps)
    request_class: str | None = None  # the workload's class of this request (mixed: interactive / batch)
    user: str | None = None  # the client it was sent as (the body's `user`)
    slo: SLO | None = None  # this request's own SLO (what it asked the server for); None = the run's

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ttft"] = ttft(self)
        d["tpot"] = tpot(self)
        d["e2el"] = e2el(self)
        d["itl"] = itl(self)
        return d


# ----------------------------------------------------------------------------------------------
# Per-request figures
# ----------------------------------------------------------------------------------------------


def _start(rec: RequestRecord) -> float:
    return rec.arrival_time if rec.send_time is None else rec.send_time


def ttft(rec: RequestRecord) -> float | None:
    """Seconds from sending the request to its first non-empty content chunk (None if none came)."""
    if not rec.success or rec.first_token_time is None:
        return None
    return rec.first_token_time - _start(rec)


def e2el(rec: RequestRecord) -> float | None:
    """Seconds from sending the request to the end of its response (None for failed requests)."""
    if not rec.success or rec.end_time is None:
        return None
    return rec.end_time - _start(rec)


def itl(rec: RequestRecord) -> list[float]:
    """Gaps between consecutive content chunks, in seconds, EXCLUDING the TTFT (GenAI-Perf).

    A request with n content chunks has n − 1 ITL values. Failed requests have none.
    """
    if not rec.success:
        return []
    t = rec.chunk_times
    return [t[i + 1] - t[i] for i in range(len(t) - 1)]


def tpot(rec: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (output_tokens − 1) in seconds; None when output_tokens <= 1 or failed."""
    first, total = ttft(rec), e2el(rec)
    if first is None or total is None or rec.output_tokens <= 1:
        return None
    return (total - first) / (rec.output_tokens - 1)


def queue_delay(rec: RequestRecord) -> float | None:
    """Seconds the request waited on the client (concurrency limit) before it was sent."""
    if rec.send_time is None:
        return None
    return rec.send_time - rec.arrival_time


# ----------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """numpy.percentile with linear interpolation; NaN for an empty list."""
    import numpy as np

    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="linear"))


def summarize(
    values: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES, scale: float = 1.0
) -> dict[str, float]:
    """count, mean, std, min, max, median and p<q> for each q, all multiplied by `scale`.

    Empty input gives count 0 and NaN elsewhere (never raises).
    """
    import numpy as np

    arr = np.asarray(list(values), dtype=np.float64) * scale
    out: dict[str, float] = {"count": int(arr.size)}
    if arr.size == 0:
        out.update(mean=math.nan, std=math.nan, min=math.nan, max=math.nan, median=math.nan)
        for q in percentiles:
            out[_pkey(q)] = math.nan
        return out
    out.update(
        mean=float(arr.mean()),
        std=float(arr.std()),
        min=float(arr.min()),
        max=float(arr.max()),
        median=float(np.median(arr)),
    )
    for q in percentiles:
        out[_pkey(q)] = float(np.percentile(arr, q, method="linear"))
    return out


def _pkey(q: float) -> str:
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}".replace(".", "_")


# ----------------------------------------------------------------------------------------------
# SLOs and goodput
# ----------------------------------------------------------------------------------------------


@dataclass
class SLO:
    """Service-level objectives in milliseconds; None = no limit on that figure.

    itl_ms bounds every ITL gap of the request (the strictest reading of an "ITL ≤ x" SLO).
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: float | None = None

    def is_empty(self) -> bool:
        return all(v is None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms, self.itl_ms))

    def met_by(self, rec: RequestRecord) -> bool:
        """True if the request succeeded and meets every SLO given.

        A request with an undefined TPOT (<= 1 output token) cannot violate the TPOT SLO.
        """
        if not rec.success:
            return False
        if self.ttft_ms is not None:
            t = ttft(rec)
            if t is None or t * 1e3 > self.ttft_ms:
                return False
        if self.e2el_ms is not None:
            t = e2el(rec)
            if t is None or t * 1e3 > self.e2el_ms:
                return False
        if self.tpot_ms is not None:
            t = tpot(rec)
            if t is not None and t * 1e3 > self.tpot_ms:
                return False
        if self.itl_ms is not None and any(g * 1e3 > self.itl_ms for g in itl(rec)):
            return False
        return True


def goodput(records: Sequence[RequestRecord], duration: float, slo: SLO) -> float:
    """Completed requests per second that meet every SLO given (DistServe's goodput)."""
    if duration <= 0:
        return math.nan
    return sum(1 for r in records if slo.met_by(r)) / duration


def meets_own_slo(rec: RequestRecord, default: SLO | None = None) -> bool:
    """Whether the request met its own SLO (`rec.slo`), else `default`; with neither, whether it succeeded."""
    slo = rec.slo if rec.slo is not None else default
    return slo.met_by(rec) if slo is not None else rec.success


@dataclass
class GroupMetrics:
    """A group of requests (a request class, a client, or all of them), each judged on its own SLO."""

    sent: int
    completed: int
    met_slo: int
    attainment: float  # met_slo / sent
    goodput: float  # met_slo / run duration, req/s
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    slo: dict | None  # the SLO when every request of the group has the same one, else None

    def to_dict(self) -> dict:
        return asdict(self)


def group_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    default: SLO | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> GroupMetrics:
    """Attainment, goodput and TTFT/TPOT of `records`, each request judged on its own SLO (else `default`)."""
    # p50 and p99 always: the per-class tables show them whatever --percentiles says.
    qs = sorted(set(percentiles) | {50.0, 99.0})
    met = sum(meets_own_slo(r, default) for r in records)
    ok = [r for r in records if r.success]
    own = [r.slo if r.slo is not None else default for r in records]
    shared = own[0] if own and all(s == own[0] for s in own) else None
    return GroupMetrics(
        sent=len(records),
        completed=len(ok),
        met_slo=met,
        attainment=met / len(records) if records else math.nan,
        goodput=met / duration if duration > 0 else math.nan,
        ttft_ms=summarize([v for v in map(ttft, ok) if v is not None], qs, 1e3),
        tpot_ms=summarize([v for v in map(tpot, ok) if v is not None], qs, 1e3),
        slo=asdict(shared) if shared is not None else None,
    )


def groups_by(
    records: Sequence[RequestRecord],
    key: Callable[[RequestRecord], str | None],
    duration: float,
    default: SLO | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> dict[str, GroupMetrics]:
    """GroupMetrics of each value of `key` (None = not in any group), in name order."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        k = key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    return {k: group_metrics(groups[k], duration, default, percentiles) for k in sorted(groups)}


# ----------------------------------------------------------------------------------------------
# Whole-run metrics
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchmarkMetrics:
    duration_s: float
    num_requests: int
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float
    goodput: float | None  # requests / s meeting every SLO; None when no SLO was given
    slo: dict | None
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    queue_delay_ms: dict[str, float]
    max_concurrent_requests: int
    # Every request against its own SLO (mixed workloads); None when no request carries one.
    per_request_slo: GroupMetrics | None = None
    classes: dict[str, GroupMetrics] = field(default_factory=dict)  # by request class
    users: dict[str, GroupMetrics] = field(default_factory=dict)  # by client (`user`)

    def to_dict(self) -> dict:
        return asdict(self)


def max_concurrency_seen(records: Sequence[RequestRecord]) -> int:
    """Largest number of requests in flight at once (sent, not yet ended)."""
    events: list[tuple[float, int]] = []
    for r in records:
        if r.send_time is None:
            continue
        end = r.end_time if r.end_time is not None else r.send_time
        events.append((r.send_time, 1))
        events.append((end, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    slo: SLO | None = None,
    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    """Aggregate per-request records of one run lasting `duration` seconds (wall clock)."""
    percentiles = tuple(percentiles)
    ok = [r for r in records if r.success]
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    d = duration if duration > 0 else math.nan
    ttfts = [v for v in (ttft(r) for r in ok) if v is not None]
    tpots = [v for v in (tpot(r) for r in ok) if v is not None]
    e2els = [v for v in (e2el(r) for r in ok) if v is not None]
    itls = [g for r in ok for g in itl(r)]
    qd = [v for v in (queue_delay(r) for r in records) if v is not None]
    use_slo = slo is not None and not slo.is_empty()
    return BenchmarkMetrics(
        duration_s=duration,
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=in_tok,
        total_output_tokens=out_tok,
        request_throughput=len(ok) / d,
        input_throughput=in_tok / d,
        output_throughput=out_tok / d,
        total_token_throughput=(in_tok + out_tok) / d,
        goodput=goodput(records, duration, slo) if use_slo else None,
        slo=asdict(slo) if use_slo else None,
        ttft_ms=summarize(ttfts, percentiles, 1e3),
        tpot_ms=summarize(tpots, percentiles, 1e3),
        itl_ms=summarize(itls, percentiles, 1e3),
        e2el_ms=summarize(e2els, percentiles, 1e3),
        queue_delay_ms=summarize(qd, percentiles, 1e3),
        max_concurrent_requests=max_concurrency_seen(records),
        per_request_slo=group_metrics(records, duration, slo, percentiles)
        if any(r.slo is not None for r in records)
        else None,
        classes=groups_by(records, lambda r: r.request_class, duration, slo, percentiles),
        users=groups_by(records, lambda r: r.user, duration, slo, percentiles),
    )
