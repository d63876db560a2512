"""The router's own Prometheus counters (prefix `kvflow_router:`; the engines' `kvflow:` metrics
stay on each engine's /metrics). One `CollectorRegistry` per router, so several routers in one
process (tests) do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

# errors_total reasons
UNREACHABLE = "unreachable"  # could not connect
TIMEOUT = "timeout"  # connected, then nothing for --timeout-s
HTTP_5XX = "http_5xx"  # answered with a server error
BAD_RESPONSE = "bad_response"  # a prefill answer that is not the JSON object expected
STREAM_BROKEN = "stream_broken"  # the connection failed in the middle of a stream


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # prometheus_client adds the _total suffix to counters
        self.requests = Counter("kvflow_router:requests", "Requests sent to a backend, by its role",
                                ["backend", "role"], registry=self.registry)
        self.errors = Counter("kvflow_router:errors", "Failed backend requests, by reason",
                              ["backend", "reason"], registry=self.registry)
        self.prefill_fallbacks = Counter(
            "kvflow_router:prefill_fallbacks",
            "Requests whose prefill engine failed, sent whole to a decode engine (it computed the prompt)",
            registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
