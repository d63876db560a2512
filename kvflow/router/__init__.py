"""`kvflow router`: an HTTP proxy in front of kvflow servers, choosing a backend per request by a
policy (`policies.py`): `pd` (prefill/decode disaggregation), or over data-parallel replicas
`round_robin`, `least_loaded` or `cache_aware` (prefix affinity, `prefix_tree.py`).

Names are imported lazily: `kvflow --help` reads `config` and `policies` without the web stack."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Router": "app", "build_router_app": "app", "serve_router": "app",
    "RouterConfig": "config",
    "RouterMetrics": "metrics",
    "POLICIES": "policies", "Backend": "policies", "Route": "policies", "RouteRequest": "policies",
    "RoutingPolicy": "policies", "RoundRobinPolicy": "policies", "PrefillDecodePolicy": "policies",
    "ReplicaPolicy": "policies", "LeastLoadedPolicy": "policies", "CacheAwarePolicy": "policies",
    "make_policy": "policies", "DATA_PARALLEL_POLICIES": "policies",
    "PrefixTree": "prefix_tree", "prompt_texts": "prefix_tree",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"kvflow.router.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'kvflow.router' has no attribute {name!r}")
