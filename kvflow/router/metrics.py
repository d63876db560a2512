"""The router's own Prometheus counters (prefix `kvflow_router:`; the engines' `kvflow:` metrics
stay on each engine's /metrics). One `CollectorRegistry` per router, so several routers in one
process (tests) do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# errors_total reasons
UNREACHABLE = "unreachable"  # could not connect
TIMEOUT = "timeout"  # connected, then nothing for --timeout-s
HTTP_5XX = "http_5xx"  # answered with a server error
BAD_RESPONSE = "bad_response"  # a prefill answer that is not the JSON object expected
STREAM_BROKEN = "stream_broken"  # the connection failed in the middle of a stream

_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # prometheus_client adds the _total suffix to counters
        self.requests = Counter(
            "kvflow_router:requests",
            "Requests sent to a backend, by its role",
            ["backend", "role"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvflow_router:errors", "Failed backend requests, by reason", ["backend", "reason"], registry=self.registry
        )
        self.prefill_fallbacks = Counter(
            "kvflow_router:prefill_fallbacks",
            "Requests whose prefill engine failed, sent whole to a decode engine (it computed the prompt)",
            registry=self.registry,
        )
        # pd with --max-local-prefill-length: requests that could take the prefill step, by where
        # their prompt was computed (local_prefill: on the decode engine; remote_prefill: on a
        # prefill engine, its KV fetched). Both series exist from the start, at 0.
        self.pd_decisions = Counter(
            "kvflow_router:pd_decisions",
            "pd: requests prefilled on their decode engine (local_prefill, at most "
            "--max-local-prefill-length tokens to compute) or on a prefill engine (remote_prefill)",
            ["decision"],
            registry=self.registry,
        )
        # data-parallel policies (--backend)
        self.cache_hits = Counter(
            "kvflow_router:cache_aware_hits",
            "cache_aware: requests routed to the replica matching their prefix",
            registry=self.registry,
        )
        self.cache_misses = Counter(
            "kvflow_router:cache_aware_misses",
            "cache_aware: requests routed by load (match below --cache-threshold, or loads imbalanced)",
            registry=self.registry,
        )
        self.prefix_match_ratio = Histogram(
            "kvflow_router:prefix_match_ratio",
            "cache_aware: longest prefix match over the candidate replicas / prompt characters",
            buckets=_RATIO_BUCKETS,
            registry=self.registry,
        )
        self.backend_healthy = Gauge(
            "kvflow_router:backend_healthy",
            "1 while a replica is in rotation (its /health passes), else 0",
            ["backend"],
            registry=self.registry,
        )
        self.backend_unhealthy = Counter(
            "kvflow_router:backend_unhealthy",
            "Times a replica was taken out of rotation",
            ["backend"],
            registry=self.registry,
        )
        self.retries = Counter(
            "kvflow_router:retries",
            "Requests sent again to another replica after theirs failed before answering",
            registry=self.registry,
        )
        # cache_aware with --router-kv-events
        self.kv_event_batches = Counter(
            "kvflow_router:kv_event_batches",
            "KV event batches applied to the router's view of a replica's cache",
            ["backend"],
            registry=self.registry,
        )
        self.kv_event_replays = Counter(
            "kvflow_router:kv_event_replays",
            "Replays asked of a replica's KV event replay socket (at start, after a gap or a restart)",
            ["backend"],
            registry=self.registry,
        )
        self.kv_event_lost = Counter(
            "kvflow_router:kv_event_lost_batches",
            "KV event batches of a replica missed for good (not replayable): its view is approximate",
            ["backend"],
            registry=self.registry,
        )
        self.kv_view_blocks = Gauge(
            "kvflow_router:kv_view_blocks",
            "Blocks the router believes a replica holds, by medium (GPU: its KV pool; CPU, DISK: its tiers)",
            ["backend", "medium"],
            registry=self.registry,
        )
        self.tokenize_failures = Counter(
            "kvflow_router:tokenize_failures",
            "cache_aware with KV events: prompts a replica's /tokenize did not answer (routed by their text)",
            registry=self.registry,
        )
        self.ttfb = Histogram(
            "kvflow_router:time_to_first_byte_seconds",
            "From a request's arrival at the router to the first byte of a 200 answer "
            "from its backend (a stream's first chunk; a JSON body whole)",
            buckets=_TTFB_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
